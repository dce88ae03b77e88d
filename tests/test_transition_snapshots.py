"""A long run's snapshot is the same document whether its transitions were one call or several.

On one Redis the run store writes each checkpointed transition (events, snapshot,
the lease's release) in one script; with the snapshot store elsewhere (another
prefix here, so the run store cannot commit it) the same run makes the separate
calls the code made before, and with memory stores the whole-document path. The
embedded stores the same: SQLite snapshots in the run database (one transaction
per transition, the default) and the file store beside it (separate calls). A
60-turn run driven through real turns on each must leave byte-identical
documents and event logs, and the document must be what the run's own events
fold to.
"""

from __future__ import annotations

from pathlib import Path

from runtime.fsm import rebuild
from runtime.models import RunStatus
from store.runs import RunStore
from store.runs.memory import MemoryRunStore
from store.runs.redis import RedisRunStore
from store.runs.sqlite import SqliteRunStore
from store.snapshots import SnapshotStore
from store.snapshots import format as snapshot_format
from store.snapshots.file import FileSnapshotStore
from store.snapshots.memory import MemorySnapshotStore
from store.snapshots.redis import RedisSnapshotStore
from store.snapshots.sqlite import SqliteSnapshotStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.contract.conftest import FakeClock
from tests.helpers import call, turn, write_agent

TURNS = 60
RUN_ID = "long-run-1"


def long_agent(directory: Path) -> Path:
    return write_agent(
        directory,
        [
            turn(f"step {i}: " + "looking it up " * 20, call("lookup_order", order_id=f"A{i % 7}"))
            for i in range(TURNS)
        ]
        + [turn("Done.")],
        budgets={"max_turns": TURNS + 5, "max_tool_calls": TURNS + 5},
    )


def run_sixty_turns(
    agent: Path, runs: RunStore, snapshots: SnapshotStore, clock: FakeClock
) -> bytes:
    """Drive the run through TURNS real turns (lease, load, model, tool, checkpoints); its document."""
    ctx = Context(Settings(), snapshots, runs)
    create_run(ctx, agent, "where is my order?", run_id=RUN_ID)
    done = advance(ctx, RUN_ID, None)
    for _ in range(TURNS - 1):
        assert done.outcome == "next", done
        clock.advance(7)
        # A fresh process state each turn half the time, as the other pool process would be.
        if done.seq % 2:
            ctx = Context(Settings(), snapshots, runs)
        done = advance(ctx, RUN_ID, done.seq)
    assert done.outcome == "next" and done.turns == TURNS, done
    document = snapshots.load_document(RUN_ID)
    assert document is not None
    return document


def test_a_sixty_turn_run_leaves_the_same_snapshot_on_the_combined_and_separate_paths(
    tmp_path: Path, redis_url: str
) -> None:
    agent = long_agent(tmp_path)
    documents, logs = {}, {}
    pairs: dict[str, tuple[RunStore, SnapshotStore, FakeClock]] = {}
    # One Redis, one prefix: the combined path. The snapshots under another prefix: apart.
    for name, snapshot_prefix in (("combined", "combined"), ("separate", "separate-snapshots")):
        clock = FakeClock()
        redis_runs = RedisRunStore.from_url(redis_url, prefix=name, clock=clock)
        pairs[name] = (
            redis_runs,
            RedisSnapshotStore.from_url(redis_url, prefix=snapshot_prefix),
            clock,
        )
    clock = FakeClock()
    pairs["memory"] = (MemoryRunStore(clock=clock), MemorySnapshotStore(), clock)
    for name, snapshots_of in (
        ("sqlite", SqliteSnapshotStore),
        ("sqlite+file", lambda db: FileSnapshotStore(db.parent / "snapshots")),
    ):
        clock, db = FakeClock(), tmp_path / name / "runs.sqlite3"
        db.parent.mkdir()
        pairs[name] = (SqliteRunStore(db, clock=clock), snapshots_of(db), clock)
    assert pairs["combined"][0].commits_with(pairs["combined"][1])
    assert pairs["sqlite"][0].commits_with(pairs["sqlite"][1])
    assert not pairs["separate"][0].commits_with(pairs["separate"][1])
    assert not pairs["sqlite+file"][0].commits_with(pairs["sqlite+file"][1])
    try:
        for name, (runs, snapshots, clock) in pairs.items():
            documents[name] = run_sixty_turns(agent, runs, snapshots, clock)
            logs[name] = runs.events(RUN_ID)
        records = {
            name: (pairs[name][0].get(RUN_ID), pairs[name][0].lease(RUN_ID)) for name in pairs
        }
    finally:
        for runs, snapshots, _ in pairs.values():
            snapshots.close()
            runs.close()

    # The same bytes on every path, and the same events
    for name in pairs:
        assert documents[name] == documents["memory"], name
        assert logs[name] == logs["memory"], name
    # And the document is the encoding of what the events fold to: 60 turns, still live
    state = rebuild(logs["combined"])
    assert state is not None and state.status == RunStatus.MODEL
    assert state.usage.model_turns == TURNS and len(state.transcript) > 2 * TURNS
    assert documents["combined"] == snapshot_format.encode(state)
    # And the combined run's record and lease are as the separate run's: released, at its seq
    for name in ("combined", "separate", "sqlite", "sqlite+file"):
        record, lease = records[name]
        assert record is not None and record.last_seq == state.seq
        assert lease is None
