"""Backends under test: every contract test runs once per backend.

A backend joins the suite by adding a branch to ``open_snapshot_store`` or
``open_run_store``; it is done when the whole suite passes on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from store.runs import RunStore
from store.snapshots import SnapshotStore

SNAPSHOT_BACKENDS = ("memory", "file", "sqlite", "redis", "s3")
RUN_BACKENDS = ("memory", "sqlite", "redis")
T0_MS = 1_700_000_000_000
"""Where the injected clock starts: a fixed instant, far from the real one."""


class FakeClock:
    """A clock the test moves by hand; run stores read time only through it."""

    def __init__(self, now_ms: int = T0_MS) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


T = TypeVar("T")


def race(*calls: Callable[[], T]) -> list[T | Exception]:
    """Run the calls on threads released together; each one's result or error, in order."""
    start = threading.Barrier(len(calls))
    results: list[T | Exception] = [RuntimeError("did not finish")] * len(calls)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = calls[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


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
