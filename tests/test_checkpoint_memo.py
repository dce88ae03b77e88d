"""A process's remembered checkpoint is used only for the very run it was saved for.

Two processes (two contexts, each with its own store objects) share the
embedded stores on disk: the file snapshot store and the SQLite run store. Run
ids may be reused once a finished run is purged, so "run X at seq 5" is not
one run's identity. A process that never saw the run reads its snapshot, and no
event, when the snapshot is at the record's last seq.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.models import Event, RunState, RunStatus
from store.runs import wall_ms
from store.runs.sqlite import SqliteRunStore
from store.snapshots import Prefetched
from store.snapshots.file import FileSnapshotStore
from tasks.context import Context
from tasks.control import cancel
from tasks.persistence import append_ending
from tasks.recovery import purge_finished
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, turn, write_agent

pytestmark = pytest.mark.usefixtures("ledger")  # the example tools book refunds there


class CountingFileSnapshotStore(FileSnapshotStore):
    """The file store, counting the snapshots this process reads."""

    loads = 0

    def load(self, run_id: str, prefetched: Prefetched | None = None) -> RunState | None:
        self.loads += 1
        return super().load(run_id, prefetched)


class CountingSqliteRunStore(SqliteRunStore):
    """The SQLite run store, counting the reads of event logs this process makes."""

    event_reads = 0

    def events(self, run_id: str, after_seq: int = 0, limit: int | None = None) -> list[Event]:
        self.event_reads += 1
        return super().events(run_id, after_seq, limit)


def process(data: Path) -> Context:
    """What one worker process opens: its own store objects over the shared files."""
    return Context(
        Settings(),
        CountingFileSnapshotStore(data / "snapshots"),
        CountingSqliteRunStore(data / "runs.sqlite3"),
    )


def agent(directory: Path, name: str) -> Path:
    return write_agent(
        directory / name,
        [turn(f"{name} look", call("lookup_order", order_id="B2")), turn(f"{name} done")],
        name=name,
    )


def test_a_process_never_serves_a_purged_runs_checkpoint_to_a_new_run_with_its_id(
    tmp_path: Path,
) -> None:
    p, q = process(tmp_path / "data"), process(tmp_path / "data")
    # Given run X checkpointed at seq 5 in process P
    first = create_run(p, agent(tmp_path, "old"), "refund B2", run_id="X")
    done = advance(p, "X", None)
    assert (done.outcome, done.seq) == ("next", 5)
    # And X cancelled and purged
    cancel(q, "X")
    assert purge_finished(q, before_ms=wall_ms() + 1) == 1
    # And a new run X, created later, driven to seq 5 by process Q
    while wall_ms() <= first.created_at_ms:
        pass
    create_run(q, agent(tmp_path, "new"), "refund B2", run_id="X")
    assert advance(q, "X", None) == done
    # When P takes X's next turn
    assert advance(p, "X", 5).outcome == "completed"
    # Then it was the new run's, not the purged run's remembered state
    record = p.runs.get("X")
    assert record is not None
    assert (record.agent, record.status, record.output) == ("new", RunStatus.COMPLETED, "new done")
    p.close()
    q.close()


def test_the_process_that_checkpointed_a_run_takes_its_next_turn_without_reading_the_snapshot(
    tmp_path: Path,
) -> None:
    p = process(tmp_path / "data")
    assert isinstance(p.snapshots, CountingFileSnapshotStore)
    create_run(p, agent(tmp_path, "only"), "refund B2", run_id="X")
    done = advance(p, "X", None)
    before = p.snapshots.loads
    assert advance(p, "X", done.seq).outcome == "completed"
    assert p.snapshots.loads == before
    p.close()


def test_another_process_takes_the_next_turn_from_the_snapshot_without_reading_the_log(
    tmp_path: Path,
) -> None:
    # Given run X checkpointed by process P at the end of a turn: its snapshot at the
    # record's last seq
    p, q = process(tmp_path / "data"), process(tmp_path / "data")
    assert isinstance(q.snapshots, CountingFileSnapshotStore)
    assert isinstance(q.runs, CountingSqliteRunStore)
    create_run(p, agent(tmp_path, "only"), "refund B2", run_id="X")
    done = advance(p, "X", None)
    # When process Q, which never saw X, takes the next turn
    assert advance(q, "X", done.seq).outcome == "completed"
    # Then it read the snapshot, and no event: none follows a snapshot at the record's seq
    assert q.snapshots.loads == 1 and q.runs.event_reads == 0
    p.close()
    q.close()


def test_a_cancel_that_lands_after_the_record_was_read_fences_the_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, q = process(tmp_path / "data"), process(tmp_path / "data")
    create_run(p, agent(tmp_path, "only"), "refund B2", run_id="X")
    done = advance(p, "X", None)
    # Given an operator's cancel (it takes no lease) whose run.cancelled lands between Q's
    # read of the record, with the lease, and of the snapshot, and which deletes the
    # snapshot just after Q read it (tasks.control.cancel, step by step)
    load = q.snapshots.load

    def cancelled_around(run_id: str) -> RunState | None:
        record = p.runs.get(run_id)
        assert record is not None
        append_ending(p, record, "run.cancelled", {"reason": "customer hung up"}, None)
        snapshot = load(run_id)
        p.snapshots.delete(run_id)
        return snapshot

    monkeypatch.setattr(q.snapshots, "load", cancelled_around)
    # When Q takes the turn from the snapshot, which has no cancel in it
    outcome = advance(q, "X", done.seq).outcome
    # Then its first write is refused by seq: nothing follows the cancel
    assert outcome == "fenced"
    events = q.runs.events("X")
    assert events[-1].type == "run.cancelled" and events[-1].seq == done.seq + 1
    record = q.runs.get("X")
    assert record is not None and record.status == RunStatus.CANCELLED
    p.close()
    q.close()
