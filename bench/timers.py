"""What waiting timers cost the crash sweeper: a sweep with none due, against one with none.

Runs ``tasks.recovery.sweep_orphans`` on a Redis run store and on the SQLite
one (the embedded default), first with nothing in the store but ten overdue
orphans, then again after adding N runs (default 10,000) in a ``wait`` that is
not due for an hour. Each sweep is timed many times and the best is kept; the
ratio is the figure (the target in issue 16: at most 2). The bench starts its
own ``redis-server`` on 127.0.0.1.

    python bench/timers.py
    python bench/timers.py --waiting 50000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.models import Event, RunStatus, Suspension  # noqa: E402
from store.runs import RunRecord, RunStore  # noqa: E402
from store.runs.redis import RedisRunStore  # noqa: E402
from store.runs.sqlite import SqliteRunStore  # noqa: E402
from tasks.recovery import sweep_orphans  # noqa: E402
from tests.redis_server import running_redis_server  # noqa: E402

NOW_MS = 1_800_000_000_000
ORPHANS = 10


def record(run_id: str, status: RunStatus, seq: int, due_at_ms: int | None,
           suspension: Suspension | None = None) -> RunRecord:  # fmt: skip
    return RunRecord(
        run_id=run_id, agent="a", agent_file="a.toml", status=status, created_at_ms=NOW_MS,
        updated_at_ms=NOW_MS, last_seq=seq, input="x", due_at_ms=due_at_ms, suspension=suspension,
    )  # fmt: skip


def add_orphans(runs: RunStore) -> None:
    for i in range(ORPHANS):
        run_id = f"orphan-{i}"
        runs.create(record(run_id, RunStatus.QUEUED, 1, NOW_MS - 60_000),
                    Event(seq=1, type="run.created", at_ms=NOW_MS, data={}))  # fmt: skip


def add_waiting(runs: RunStore, count: int) -> None:
    for i in range(count):
        run_id = f"waiting-{i}"
        runs.create(record(run_id, RunStatus.QUEUED, 1, NOW_MS),
                    Event(seq=1, type="run.created", at_ms=NOW_MS, data={}))  # fmt: skip
        suspension = Suspension(reason=RunStatus.WAITING, call_id="c", tool="wait",
                                arguments={"seconds": 3600}, seq=2, since_ms=NOW_MS)  # fmt: skip
        wake_due = NOW_MS + 3_600_000 - 2_000
        runs.append(record(run_id, RunStatus.WAITING, 2, wake_due, suspension),
                    [Event(seq=2, type="run.suspended", at_ms=NOW_MS, data={})], None)  # fmt: skip


def best_sweep_s(runs: RunStore, repeats: int) -> float:
    from store.snapshots.memory import MemorySnapshotStore
    from tasks.context import Context
    from tasks.settings import Settings

    ctx = Context(Settings(), MemorySnapshotStore(), runs)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        found = sweep_orphans(ctx, lambda run, seq: None, wake=lambda run, rec: None)
        best = min(best, time.perf_counter() - started)
        assert len(found) == ORPHANS, found
    return best


def measure(name: str, runs: RunStore, waiting: int, repeats: int) -> None:
    add_orphans(runs)
    without = best_sweep_s(runs, repeats)
    started = time.perf_counter()
    add_waiting(runs, waiting)
    added_s = time.perf_counter() - started
    with_waiting = best_sweep_s(runs, repeats)
    print(f"{name:8s} sweep with {ORPHANS} orphans: {without * 1000:7.3f} ms   "
          f"with {waiting:,} timers not due as well: {with_waiting * 1000:7.3f} ms   "
          f"ratio {with_waiting / without:5.2f}  (target <= 2; {waiting:,} timers written in "
          f"{added_s:.1f} s)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    clock = lambda: NOW_MS  # noqa: E731
    with tempfile.TemporaryDirectory() as scratch:
        with running_redis_server(Path(scratch)) as server:
            runs = RedisRunStore.from_url(f"{server.url}/0", clock=clock)
            measure("redis", runs, args.waiting, args.repeats)
            runs.close()
        sqlite = SqliteRunStore(Path(scratch) / "runs.sqlite3", clock=clock)
        measure("sqlite", sqlite, args.waiting, args.repeats)
        sqlite.close()


if __name__ == "__main__":
    main()
