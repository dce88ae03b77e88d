"""The RunStore contract (:mod:`store.conformance.runs`) on every backend: memory, sqlite,
redis (the ``run_store`` fixture, tests/contract/conftest.py).

Below the suite: what only one backend can show (Redis keys and a dead server, a
SQLite file written before retention and by racing processes).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from runtime.errors import StoreUnavailable
from runtime.models import RunStatus
from store.conformance import RunStoreContract
from store.conformance.records import LEASE_MS, LEASE_S, created, event, new_run, record
from store.runs.redis import LEASE_TTL_GRACE_MS, RedisRunStore
from tests.contract.conftest import T0_MS, FakeClock
from tests.redis_server import RedisServer

__all__ = ["created", "event", "new_run", "record"]
"""Other tests build their runs with the suite's helpers."""


class TestRunStores(RunStoreContract):
    """Every test of the contract, once per backend of the ``run_store`` fixture."""


# --- redis only ---------------------------------------------------------------


@pytest.fixture
def redis_run_store(redis_url: str, clock: FakeClock) -> Any:
    store = RedisRunStore.from_url(redis_url, clock=clock)
    client = redis.Redis.from_url(redis_url)
    yield store, client
    client.close()
    store.close()


def test_redis_keeps_a_runs_due_index_entry_while_its_due_time_moves_within_the_slack(
    redis_run_store: tuple[RedisRunStore, redis.Redis], clock: FakeClock
) -> None:
    store, client = redis_run_store
    new_run(store, "run-1", due_at_ms=T0_MS + 1000)
    for seq in range(2, 6):  # four quick transitions, each one due 100 ms later
        due = T0_MS + 1000 + 100 * (seq - 1)
        store.append(
            record("run-1", last_seq=seq, status=RunStatus.MODEL, due_at_ms=due),
            [event(seq)],
            owner=None,
        )
    # Kept where the first due time put it (the later ones were within append.lua's
    # DUE_SLACK of it): one ZADD, not one for every transition; overdue() still answers
    # by the record's exact due time (the contract's test of it).
    assert client.zscore(store._keys.of("run-1").due, "run-1") == T0_MS + 1000
    clock.advance(1399)
    assert store.overdue() == []
    clock.advance(1)
    assert store.overdue() == ["run-1"]


def test_every_key_of_a_run_shares_one_cluster_slot_with_its_snapshot(
    redis_run_store: tuple[RedisRunStore, redis.Redis],
) -> None:
    from redis.crc import key_slot

    from store.snapshots.redis import RedisSnapshotStore

    store, client = redis_run_store
    new_run(store, "run-1")
    store.append(record("run-1", last_seq=2), [event(2)], owner=None)
    assert store.acquire_lease("run-1", "worker-a", LEASE_S)
    snapshot_key = RedisSnapshotStore(client)._key("run-1")

    keys = cast("list[bytes]", client.keys("*"))
    run_keys = [k for k in keys if b"run-1" in k and b":runs:" not in k]

    assert len(run_keys) == 3
    assert {key_slot(k) for k in run_keys} == {key_slot(snapshot_key.encode())}


def test_a_lease_key_expires_in_redis_a_grace_period_after_its_lease(
    redis_run_store: tuple[RedisRunStore, redis.Redis],
) -> None:
    store, client = redis_run_store
    new_run(store, "run-1")

    assert store.acquire_lease("run-1", "worker-a", LEASE_S)

    lease_keys = [k for k in cast("list[bytes]", client.keys("*")) if k.endswith(b":lease")]
    assert len(lease_keys) == 1
    ttl_ms = client.pttl(lease_keys[0])
    assert LEASE_MS < ttl_ms <= LEASE_MS + LEASE_TTL_GRACE_MS


def test_overdue_pages_past_many_runs_with_a_live_lease(
    redis_run_store: tuple[RedisRunStore, redis.Redis],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("store.runs.redis.OVERDUE_BATCH", 2)
    store, _ = redis_run_store
    for i in range(7):
        new_run(store, f"busy-{i}", due_at_ms=T0_MS + i)
        assert store.acquire_lease(f"busy-{i}", "worker-a", LEASE_S)
    for i in range(3):
        new_run(store, f"free-{i}", due_at_ms=T0_MS + 10 + i)
    clock.advance(100)

    assert store.overdue(limit=2) == ["free-0", "free-1"]
    assert store.overdue() == ["free-0", "free-1", "free-2"]


def test_an_append_to_a_dead_redis_raises_store_unavailable_and_works_after_restart(
    redis_server: RedisServer, redis_url: str, clock: FakeClock
) -> None:
    store = RedisRunStore.from_url(redis_url, clock=clock)
    try:
        new_run(store, "run-1")
        redis_server.kill()

        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as refused:
            store.append(record("run-1", last_seq=2), [event(2)], owner=None)

        assert time.monotonic() - started < 10
        assert f"run store {redis_url} is unavailable" in str(refused.value)
        # The server comes back empty (nothing is persisted in tests); the store reconnects.
        redis_server.restart()
        new_run(store, "run-1")
        assert store.events("run-1") == [created("run-1")]
    finally:
        store.close()


# --- sqlite only --------------------------------------------------------------


def test_a_sqlite_database_made_before_retention_gets_its_finished_runs_indexed(
    tmp_path: Path, clock: FakeClock
) -> None:
    from store.runs.sqlite import SqliteRunStore

    # Given a database written by a version without the finished_at_ms column
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.executescript(
            "CREATE TABLE runs (run_id TEXT PRIMARY KEY, status TEXT NOT NULL, "
            "last_seq INTEGER NOT NULL, created_at_ms INTEGER NOT NULL, due_at_ms INTEGER, "
            "record TEXT NOT NULL);"
        )
        for run_id, status in (("old-done", RunStatus.COMPLETED), ("old-live", RunStatus.MODEL)):
            row = record(run_id, status=status)
            conn.execute(
                "INSERT INTO runs VALUES (?, ?, 1, ?, NULL, ?)",
                (run_id, status.value, T0_MS, row.model_dump_json()),
            )
    conn.close()
    # When the store opens it, its finished run is purged like any other
    store = SqliteRunStore(path, clock=clock)
    try:
        assert store.purge(T0_MS + 1) == 1
        assert [r.run_id for r in store.list()] == ["old-live"]
    finally:
        store.close()


WRITER = """
import json, sys, time
from pathlib import Path
from runtime.errors import StaleWrite
from runtime.models import Event
from store import retry
from store.runs.sqlite import SqliteRunStore

# No retries: a writer waits for the write lock (BEGIN IMMEDIATE and busy_timeout); a
# transaction that read first and found the lock taken would fail instead.
retry.ATTEMPTS = 1
path, name, target, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
store = SqliteRunStore(path)
while not go.exists():
    time.sleep(0.001)
won = stale = 0
while True:
    current = store.get("run-1")
    if current.last_seq >= target:
        break
    seq = current.last_seq + 1
    mine = current.model_copy(update={"last_seq": seq})
    try:
        store.append(mine, [Event(seq=seq, type="model.requested", at_ms=seq, data={"by": name})],
                     owner=None)
        won += 1
    except StaleWrite:
        stale += 1
print(json.dumps({"won": won, "stale": stale}))
"""


@pytest.mark.timeout(120)
def test_sqlite_writers_in_separate_processes_racing_on_one_file_each_seq_goes_to_exactly_one(
    tmp_path: Path, clock: FakeClock
) -> None:
    from store.runs.sqlite import SqliteRunStore

    # Given one database file and four worker processes with their own connections
    path, go, target = tmp_path / "runs.sqlite3", tmp_path / "go", 120
    store = SqliteRunStore(path, clock=clock)
    new_run(store, "run-1")
    root = Path(__file__).resolve().parents[2]
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), f"w{i}", str(target), str(go)],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    # When they all append the next seq as fast as they can
    go.touch()
    results = [w.communicate(timeout=100) for w in writers]

    # Then none saw the store fail, each seq was won by exactly one, and the log is whole
    for writer, (_, err) in zip(writers, results, strict=True):
        assert writer.returncode == 0, err[-2000:]
    tallies = [json.loads(out) for out, _ in results]
    assert sum(t["won"] for t in tallies) == target - 1
    events = store.events("run-1")
    assert [e.seq for e in events] == list(range(1, target + 1))
    assert {e.data["by"] for e in events[1:]} <= {f"w{i}" for i in range(4)}
    latest = store.get("run-1")
    assert latest is not None and latest.last_seq == target
    store.close()
