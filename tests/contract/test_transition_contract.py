"""``RunStore.commit`` (:mod:`store.conformance.transitions`) on the pairs a deployment
runs: memory + memory, SQLite + file, Redis + S3 (separate calls), and the two where
the run store ``commits_with`` the snapshot store: SQLite + SQLite in one database
file (the embedded default), the whole transition one transaction, and Redis + Redis
on one server and prefix, the whole transition one atomic script.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from store.conformance import TransitionContract
from store.conformance.transitions import LEASE_S, event, record_of, said, started
from store.runs import Checkpoint, RunStore
from store.runs.redis import RedisRunStore
from store.snapshots import SnapshotStore
from store.snapshots.redis import DEFAULT_PREFIX, RedisSnapshotStore
from tests.contract.conftest import FakeClock, open_run_store, open_snapshot_store

PAIRS = {
    "memory+memory": ("memory", "memory", False),
    "sqlite+file": ("sqlite", "file", False),
    "sqlite+sqlite": ("sqlite", "sqlite", True),
    "redis+s3": ("redis", "s3", False),
    "redis+redis": ("redis", "redis", True),
    "cluster+cluster": ("redis-cluster", "redis-cluster", True),
}
"""Each pair's run store and snapshot store, and whether they commit together."""


class TestTransitions(TransitionContract):
    """Every test of the contract, once per pair."""

    @pytest.fixture(params=list(PAIRS))
    def stores(
        self, request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
    ) -> Iterator[tuple[RunStore, SnapshotStore]]:
        runs_backend, snapshots_backend, _ = PAIRS[request.param]
        runs = open_run_store(runs_backend, request, tmp_path, clock)
        snapshots = open_snapshot_store(snapshots_backend, request, tmp_path)
        yield runs, snapshots
        snapshots.close()
        runs.close()

    def test_the_combined_path_is_taken_exactly_for_one_database_behind_both_stores(
        self, stores: tuple[RunStore, SnapshotStore], request: pytest.FixtureRequest
    ) -> None:
        runs, snapshots = stores
        assert runs.commits_with(snapshots) is PAIRS[request.node.callspec.params["stores"]][2]


# --- the Redis pair: what only it can show -----------------------------------------------------


@pytest.fixture
def redis_pair(
    redis_url: str, clock: FakeClock
) -> Iterator[tuple[RedisRunStore, RedisSnapshotStore]]:
    runs = RedisRunStore.from_url(redis_url, clock=clock)
    snapshots = RedisSnapshotStore.from_url(redis_url)
    yield runs, snapshots
    snapshots.close()
    runs.close()


def test_another_prefix_or_database_is_not_the_same_redis(redis_url: str) -> None:
    runs = RedisRunStore.from_url(redis_url)
    assert runs.commits_with(RedisSnapshotStore.from_url(redis_url))
    assert not runs.commits_with(RedisSnapshotStore.from_url(redis_url, prefix="other"))
    # (redis_url cycles through the databases: the other one is the next, never a fixed one.)
    server, db = redis_url.rsplit("/", 1)
    other_db = f"{server}/{(int(db) + 1) % 16}"
    assert not runs.commits_with(RedisSnapshotStore.from_url(other_db))


def test_a_transition_is_one_round_trip_and_touches_no_index_it_does_not_change(
    redis_pair: tuple[RedisRunStore, RedisSnapshotStore], redis_url: str
) -> None:
    runs, snapshots = redis_pair
    state = started(runs, snapshots)
    first = said(state, "one")  # (the first call also loads the script into the server)
    runs.commit(record_of(first), [event(2, "one")], "worker-a", Checkpoint(snapshots, first, 1))
    client = redis.Redis.from_url(redis_url)
    calls = client.info("commandstats")
    after = said(first, "two")
    runs.commit(record_of(after), [event(3, "two")], "worker-a", Checkpoint(snapshots, after, 2))
    spent = {
        k: v["calls"] - calls.get(k, {"calls": 0})["calls"]
        for k, v in client.info("commandstats").items()
        if v["calls"] != calls.get(k, {"calls": 0})["calls"]
    }
    client.close()
    # One script (the snapshot's tip came from this process's memory of its save);
    # the status did not change, so no status, created or finished index was written.
    assert spent.get("cmdstat_evalsha") == 1, spent
    assert "cmdstat_zrem" not in spent, spent
    assert spent.get("cmdstat_zadd", 0) <= 1, spent  # the due index, whose time moved
    # Inside the script: the record, the lease and the snapshot's tip read once each, the
    # event and the fragment pushed, the record and the tip written. The tip stands for the
    # transcript list (append.lua), so its length is not read again.
    assert spent.get("cmdstat_hmget") == 3, spent
    assert spent.get("cmdstat_rpush") == 2, spent
    assert spent.get("cmdstat_hset") == 2, spent
    assert "cmdstat_llen" not in spent, spent


def test_a_process_lease_index_follows_the_fast_path_and_the_release_on_a_transition(
    redis_pair: tuple[RedisRunStore, RedisSnapshotStore], redis_url: str
) -> None:
    # The index RunStore.orphaned walks (the runs each process holds): a lease taken with
    # its record in one call enters it, and the release that rides on a turn's last
    # checkpoint takes the run out again, as release_lease does.
    runs, snapshots = redis_pair
    process = "host-a:101:aaaa"
    owner = f"{process}/t1"
    held = f"{DEFAULT_PREFIX}:proc:{process}:leases"
    client = redis.Redis.from_url(redis_url)
    state = started(runs, snapshots, owner)
    assert runs.acquire_and_get("run-1", owner, LEASE_S) == (True, runs.get("run-1"))
    assert client.smembers(held) == {b"run-1"}
    after = said(state, "one")

    runs.commit(record_of(after), [event(2, "one")], owner, Checkpoint(snapshots, after, 1), True)

    assert runs.lease("run-1") is None
    assert client.smembers(held) == set()
    assert runs.acquire_and_get("run-1", owner, LEASE_S)[0]
    runs.release_lease("run-1", owner)
    assert client.smembers(held) == set()
    client.close()
