"""The SnapshotStore contract (:mod:`store.conformance.snapshots`) on every backend:
memory, file, sqlite, redis, s3 (the ``snapshot_store`` fixture, tests/contract/conftest.py).

Below the suite: what only one medium can show: a file write killed midway, and a
Redis server that dies under the store.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from runtime.errors import StoreUnavailable
from runtime.models import RunState
from store.conformance import SnapshotStoreContract, SnapshotTransactionContract
from store.conformance.snapshots import OpenAnother, make_state, rich_state
from store.retry import ATTEMPTS
from store.snapshots import SnapshotStore
from store.snapshots.file import FileSnapshotStore
from store.snapshots.memory import MemorySnapshotStore
from store.snapshots.redis import RedisSnapshotStore
from store.snapshots.s3 import S3SnapshotStore
from store.snapshots.sqlite import SqliteSnapshotStore
from tests.contract.conftest import open_snapshot_store
from tests.redis_server import running_redis_server

__all__ = ["make_state", "rich_state"]
"""Other tests build their states with the suite's helpers."""

ROOT = Path(__file__).resolve().parents[2]


def quarantined_documents(store: SnapshotStore, run_id: str) -> list[bytes]:
    """What the backend keeps in its quarantine for ``run_id`` (each backend's own place)."""
    if isinstance(store, MemorySnapshotStore):
        return [d for name, d in store.quarantined.items() if name.startswith(f"{run_id}.")]
    if isinstance(store, FileSnapshotStore):
        return [p.read_bytes() for p in (store.directory / "quarantine").glob(f"{run_id}.*.json")]
    if isinstance(store, SqliteSnapshotStore):
        return [
            row[0]
            for row in store._connection().execute(
                "SELECT document FROM snapshots_quarantined WHERE run_id = ?", (run_id,)
            )
        ]
    if isinstance(store, RedisSnapshotStore):
        # SCAN, not KEYS: on a cluster redis-py scans every primary (KEYS asks one node).
        pattern = f"{store._shard(run_id).prefix}:quarantine:{{{run_id}}}:*:snapshot"
        keys = list(store._client.scan_iter(match=pattern))
        return [b"".join(cast(list[bytes], store._client.hvals(k))) for k in keys]
    assert isinstance(store, S3SnapshotStore)
    prefix = f"{store._prefix}quarantine/{run_id}."
    return [b"" for key in store._keys(prefix) if "/heads/" in key]


class TestSnapshotStores(SnapshotStoreContract, SnapshotTransactionContract):
    """Every test of the contract, once per backend of the ``snapshot_store`` fixture."""

    @pytest.fixture
    def another_snapshot_store(
        self, request: pytest.FixtureRequest, tmp_path: Path
    ) -> Iterator[OpenAnother | None]:
        # Another worker's store on the same backend; a memory store is one process's own.
        backend = request.node.callspec.params["snapshot_store"]
        if backend == "memory":
            yield None
            return
        opened: list[SnapshotStore] = []

        def another() -> SnapshotStore:
            opened.append(open_snapshot_store(backend, request, tmp_path))
            return opened[-1]

        yield another
        for store in opened:
            store.close()

    @pytest.fixture
    def quarantined(self) -> Any:
        return quarantined_documents


# --- file: a write killed midway ----------------------------------------------

BIG_CHARS = 2 * 1024 * 1024

WRITER = f"""
import sys
from runtime.models import Budgets, Message, RunState, RunStatus
from store.snapshots.file import FileSnapshotStore

def state(seq):
    body = f"{{seq}}:" + "x" * {BIG_CHARS} + f":{{seq}}"
    return RunState(run_id="run-1", seq=seq, agent="echo", agent_file="a.toml",
                    binding="0" * 64, input="hi", status=RunStatus.MODEL, budgets=Budgets(),
                    created_at_ms=0, transcript=(Message(role="user", content=body),))

store = FileSnapshotStore(sys.argv[1])
print("ready", flush=True)
while True:
    seq = store.load("run-1").seq
    store.save(state(seq + 1), seq)
"""


def _is_complete(state: RunState) -> bool:
    body = state.transcript[-1].content
    return body == f"{state.seq}:" + "x" * BIG_CHARS + f":{state.seq}"


def test_a_file_write_killed_midway_leaves_a_complete_snapshot(tmp_path: Path) -> None:
    directory = tmp_path / "snapshots"
    store = FileSnapshotStore(directory)
    store.save(make_state(seq=1), expected_seq=None)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    last_seq = 1

    for _ in range(5):
        # Given a worker saving multi-megabyte snapshots of one run as fast as it can
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(directory)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert writer.stdout is not None
        assert writer.stdout.readline() == b"ready\n", writer.stderr.read() if writer.stderr else ""

        # When it is SIGKILLed at a random instant
        time.sleep(random.uniform(0.05, 0.5))
        writer.send_signal(signal.SIGKILL)
        _, stderr = writer.communicate(timeout=30)
        assert writer.returncode == -signal.SIGKILL, stderr.decode()

        # Then the snapshot is a whole one, never older than what was there before
        state = store.load("run-1")
        assert state is not None
        assert state.seq >= last_seq
        if state.seq > 1:
            assert _is_complete(state)
        last_seq = state.seq

    # and the run can be checkpointed onwards from it
    store.save(make_state(seq=last_seq + 1), expected_seq=last_seq)
    assert store.list() == ["run-1"]
    assert last_seq > 1, "the writer never saved: the test proved nothing"


# --- redis: the server dies ---------------------------------------------------


def test_a_save_to_a_dead_redis_raises_store_unavailable_after_bounded_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_redis_server(tmp_path) as server:
        store = RedisSnapshotStore.from_url(f"{server.url}/0")
        attempts = 0
        # The Redis store appends transcripts: its saves write through `_put_parts`.
        primitive = "_put_parts" if store.appends_transcript else "_put"
        put = getattr(store, primitive)

        def counted_put(*args: Any) -> None:
            nonlocal attempts
            attempts += 1
            put(*args)

        monkeypatch.setattr(store, primitive, counted_put)
        try:
            store.save(make_state(seq=1), expected_seq=None)
            attempts = 0

            # Given the server dies
            server.kill()

            # When a worker checkpoints, it is told the store is unavailable within seconds
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as refused:
                store.save(make_state(seq=2), expected_seq=1)
            elapsed_s = time.monotonic() - started

            assert 2 <= attempts <= ATTEMPTS
            assert elapsed_s < 10
            message = str(refused.value)
            assert f"127.0.0.1:{server.port}" in message
            assert "check that it is running and reachable" in message

            # And once a server is back (empty: nothing was persisted) the same store works again
            server.restart()
            assert store.load("run-1") is None
            store.save(make_state(seq=2), expected_seq=None)
            assert store.load("run-1") == make_state(seq=2)
        finally:
            store.close()


def test_a_redis_store_opened_before_a_fork_works_in_the_child_and_the_parent(
    redis_url: str,
) -> None:
    # Celery's prefork pool forks after the app (and its stores) are set up.
    store = RedisSnapshotStore.from_url(redis_url)
    try:
        store.save(make_state(seq=1), expected_seq=None)

        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            code = 1
            try:
                store.save(make_state(seq=2), expected_seq=1)
                code = 0 if store.load("run-1") == make_state(seq=2) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)

        assert os.waitstatus_to_exitcode(status) == 0
        assert store.load("run-1") == make_state(seq=2)
        store.save(make_state(seq=3), expected_seq=2)
    finally:
        store.close()
