"""The project's backends under the conformance suites (store/conformance/).

Each test file subclasses a contract class; the fixtures here hand it every backend
in turn. A backend joins by adding a branch to ``open_snapshot_store`` or
``open_run_store``; it is done when the whole suite passes on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from store.conformance.support import T0_MS, FakeClock, race
from store.runs import RunStore
from store.snapshots import SnapshotStore

__all__ = ["T0_MS", "FakeClock", "open_run_store", "open_snapshot_store", "race"]

SNAPSHOT_BACKENDS = ("memory", "file", "sqlite", "redis", "redis-cluster", "s3")
RUN_BACKENDS = ("memory", "sqlite", "redis", "redis-cluster")
CONTRACT_SHARDS = 8
"""Shards of the cluster backends here: few runs a test, so few shards still put them in
several (the merges across shards are what differs from one server)."""


def cluster_url(request: pytest.FixtureRequest) -> str:
    """The session's cluster (tests/cluster_servers.py), with CONTRACT_SHARDS shards."""
    return str(request.getfixturevalue("redis_cluster").url(shards=CONTRACT_SHARDS))


def cluster_prefix(request: pytest.FixtureRequest) -> str:
    """The test's own key prefix on the cluster (a cluster has only database 0)."""
    return str(request.getfixturevalue("cluster_prefix"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def open_snapshot_store(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> SnapshotStore:
    if backend == "memory":
        from store.snapshots.memory import MemorySnapshotStore

        return MemorySnapshotStore()
    if backend == "file":
        from store.snapshots.file import FileSnapshotStore

        # Nested, so that a `../` escape would still land inside tmp_path where a test can see it.
        return FileSnapshotStore(tmp_path / "a" / "b" / "snapshots")
    if backend == "sqlite":
        from store.snapshots.sqlite import SqliteSnapshotStore

        # The run store's database (open_run_store): the embedded default keeps both in one.
        return SqliteSnapshotStore(tmp_path / "runs.sqlite3")
    if backend == "redis":
        from store.snapshots.redis import RedisSnapshotStore

        return RedisSnapshotStore.from_url(request.getfixturevalue("redis_url"))
    if backend == "redis-cluster":
        from store.snapshots.redis import RedisSnapshotStore

        return RedisSnapshotStore.from_url(cluster_url(request), prefix=cluster_prefix(request))
    if backend == "s3":
        from store.snapshots.s3 import S3SnapshotStore

        return S3SnapshotStore.from_url(request.getfixturevalue("s3_url"))
    raise AssertionError(f"no snapshot backend {backend}")


def open_run_store(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> RunStore:
    if backend == "memory":
        from store.runs.memory import MemoryRunStore

        return MemoryRunStore(clock=clock)
    if backend == "sqlite":
        from store.runs.sqlite import SqliteRunStore

        return SqliteRunStore(tmp_path / "runs.sqlite3", clock=clock)
    if backend == "redis":
        from store.runs.redis import RedisRunStore

        return RedisRunStore.from_url(request.getfixturevalue("redis_url"), clock=clock)
    if backend == "redis-cluster":
        from store.runs.redis import RedisRunStore

        return RedisRunStore.from_url(
            cluster_url(request), prefix=cluster_prefix(request), clock=clock
        )
    raise AssertionError(f"no run backend {backend}")


@pytest.fixture(params=SNAPSHOT_BACKENDS)
def snapshot_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SnapshotStore]:
    store = open_snapshot_store(request.param, request, tmp_path)
    yield store
    store.close()


@pytest.fixture(params=RUN_BACKENDS)
def run_store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> Iterator[RunStore]:
    store = open_run_store(request.param, request, tmp_path, clock)
    yield store
    store.close()
