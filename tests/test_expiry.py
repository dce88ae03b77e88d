"""``max_suspended_s``: the sweep expires a run through the due index, exactly once.

A run waiting for a person under its agent's ``max_suspended_s`` sits in the run
store's due index at the first instant it has waited too long
(:func:`runtime.continuation.expires_at_ms`); the sweep finds it there and records
``run.expired``. An answer racing the expiry and the expiry resolve exactly once.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from runtime.continuation import expires_at_ms, make_continuation
from runtime.errors import RatchetError
from runtime.fsm import apply, created_event
from runtime.models import Event, RunStatus
from store.conformance import FakeClock
from store.runs import RunRecord
from store.runs.memory import MemoryRunStore
from store.runs.redis import RedisRunStore
from store.snapshots import format as snapshot_format
from store.snapshots.memory import MemorySnapshotStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.context import Context
from tasks.control import apply_continuation, expire_if_due
from tasks.recovery import sweep_orphans
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, drive, turn, write_agent

pytestmark = pytest.mark.timeout(60)

ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]
T0_MS = 1_700_000_000_000


def suspended(ctx: Context, directory: Path, extra: str = "max_suspended_s = 60") -> str:
    agent = write_agent(directory, ASK, extra=extra)
    run_id = create_run(ctx, agent, "refund my order").run_id
    assert drive(ctx, run_id).outcome == "suspended"
    return run_id


def no_resume(run_id: str, seq: int) -> None:
    raise AssertionError(f"a suspended run {run_id} was resumed at {seq}")


def sweep(ctx: Context) -> list[str]:
    return sweep_orphans(ctx, enqueue=no_resume, wake=lambda *_: None, tell=lambda _: None)


def test_the_sweep_expires_a_run_through_the_due_index_at_the_instant_it_waited_too_long(
    tmp_path: Path, ledger: Path
) -> None:
    clock, ctx = clocked()
    limited = suspended(ctx, tmp_path / "a")
    forever = suspended(ctx, tmp_path / "b", extra="")
    # Given a run waiting under max_suspended_s = 60 and one with no limit
    record = ctx.runs.get(limited)
    assert record is not None and record.suspension is not None
    assert record.due_at_ms == expires_at_ms(record.suspension, 60) == T0_MS + 60_001
    assert ctx.runs.get(forever).due_at_ms is None  # type: ignore[union-attr]

    # When exactly 60 s have passed, the sweep finds nothing: waiting that long is allowed
    clock.now_ms += 60_000
    assert sweep(ctx) == []
    # Then a millisecond later the sweep expires the limited run, and only it
    clock.now_ms += 1
    assert sweep(ctx) == [limited]
    assert [e.type for e in ctx.runs.events(limited)][-1] == "run.expired"
    assert ctx.runs.get(limited).status == RunStatus.FAILED  # type: ignore[union-attr]
    assert ctx.snapshots.load(limited) is None
    # And it has left the index: the next sweep finds nothing, the other run waits on
    clock.now_ms += 3_600_000
    assert sweep(ctx) == []
    assert ctx.runs.get(forever).status == RunStatus.NEEDS_USER_INPUT  # type: ignore[union-attr]


RACES = 12


def test_an_answer_racing_the_expiry_resolves_exactly_once(
    redis_url: str, tmp_path: Path, ledger: Path
) -> None:
    clock = FakeClock()
    ctx = Context(
        Settings(lease_s=5),
        RedisSnapshotStore.from_url(redis_url),
        RedisRunStore.from_url(redis_url, clock=clock),
    )
    try:
        # Given runs that each waited past max_suspended_s = 1, so either path expires them
        runs = [suspended(ctx, tmp_path / str(i), "max_suspended_s = 1") for i in range(RACES)]
        clock.now_ms += 1_001
        outcomes: dict[str, list[Any]] = {run_id: [] for run_id in runs}

        def race(run_id: str, barrier: threading.Barrier, by_sweep: bool) -> None:
            barrier.wait()
            try:
                if by_sweep:
                    outcomes[run_id].append(expire_if_due(ctx, run_id))
                else:
                    answer = make_continuation(run_id, f"late-{run_id}", input="Order B2")
                    outcomes[run_id].append(apply_continuation(ctx, answer, no_resume))
            except RatchetError as exc:
                outcomes[run_id].append(type(exc).__name__)

        # When the sweep's expiry and a late answer reach each run at once
        threads = []
        for run_id in runs:
            barrier = threading.Barrier(2)
            threads += [
                threading.Thread(target=race, args=(run_id, barrier, by_sweep))
                for by_sweep in (True, False)
            ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

        # Then each run expired exactly once, no answer was taken, and each loser was told
        for run_id in runs:
            kinds = [e.type for e in ctx.runs.events(run_id)]
            assert kinds.count("run.expired") == 1 and "run.continued" not in kinds, kinds
            assert len(outcomes[run_id]) == 2, outcomes[run_id]
            assert outcomes[run_id].count(True) <= 1, outcomes[run_id]
            assert all(o in (True, False, "SuspensionExpired", "RunRefused", "RunBusy")
                       for o in outcomes[run_id]), outcomes[run_id]  # fmt: skip
    finally:
        ctx.close()


def test_the_sweep_expires_a_run_whose_lease_a_dead_process_still_holds(
    tmp_path: Path, ledger: Path
) -> None:
    clock, ctx = clocked()
    run_id = suspended(ctx, tmp_path)
    # Given a process that took the run's lease for 10 minutes, then died
    ctx.runs.renew_liveness("gone-host:4242:deadbeef", 0.05)
    assert ctx.runs.claim_lease(run_id, "gone-host:4242:deadbeef/a", 600).taken
    # When the run has waited past its max_suspended_s, the lease still unexpired
    clock.now_ms += 60_001
    assert [o.run_id for o in ctx.runs.orphaned()] == [run_id]
    # Then the sweep expires it now, not once the dead process's lease runs out
    assert sweep(ctx) == [run_id]
    assert ctx.runs.get(run_id).status == RunStatus.FAILED  # type: ignore[union-attr]


# --- the limit a run started with, recorded in its state ----------------------------


def first_event_reads(ctx: Context) -> list[str]:
    """The runs whose first event is read from now on (``events(run, 0, 1)``)."""
    reads: list[str] = []
    events = ctx.runs.events

    def counted(run_id: str, after_seq: int = 0, limit: int | None = None) -> list[Any]:
        if after_seq == 0 and limit == 1:
            reads.append(run_id)
        return events(run_id, after_seq, limit)

    ctx.runs.events = counted  # type: ignore[method-assign]
    return reads


def clocked() -> tuple[FakeClock, Context]:
    """A memory context whose run store keeps a :class:`FakeClock`'s time, and the clock."""
    clock = FakeClock()
    return clock, Context(Settings(), MemorySnapshotStore(), MemoryRunStore(clock=clock))


def suspended_by_the_previous_release(ctx: Context, tmp_path: Path) -> str:
    """A run as the release before this one started it, of an agent file in ``tmp_path``
    (``max_suspended_s = 60``), suspended on a person: its ``run.created`` does not record
    ``max_suspended_s`` at the top (only in its binding document), so neither its state nor
    any snapshot of it holds the limit."""
    agent = ctx.agent(write_agent(tmp_path, ASK, extra="max_suspended_s = 60"))
    now = ctx.runs.clock()
    data = created_event("earlier-release-run", agent, "refund my order", now)
    assert data.pop("max_suspended_s") == 60
    assert data["binding_document"]["max_suspended_s"] == 60
    first = Event(seq=1, type="run.created", at_ms=now, data=data)
    state = apply(None, first)
    ctx.runs.create(RunRecord.from_state(state, now, now + 60_000), first)
    ctx.snapshots.save(state, None)
    assert drive(ctx, state.run_id).outcome == "suspended"
    return state.run_id


def test_a_run_records_its_limit_in_its_state_and_expires_without_reading_its_first_event(
    tmp_path: Path, ledger: Path
) -> None:
    clock, ctx = clocked()
    reads = first_event_reads(ctx)
    # Given a run started under max_suspended_s = 60, waiting for a person
    run_id = suspended(ctx, tmp_path)
    saved = ctx.snapshots.load(run_id)
    assert saved is not None and saved.max_suspended_s == 60
    assert b'"max_suspended_s": 60' in snapshot_format.encode(saved)
    record = ctx.runs.get(run_id)
    assert record is not None and record.due_at_ms == T0_MS + 60_001
    # When it has waited too long and the sweep comes
    clock.now_ms += 60_001
    assert sweep(ctx) == [run_id]
    # Then it expired, and nothing read its first event for the limit
    assert ctx.runs.get(run_id).status == RunStatus.FAILED  # type: ignore[union-attr]
    assert reads == []


def test_a_run_with_no_limit_adds_nothing_to_its_snapshot(tmp_path: Path, ledger: Path) -> None:
    _, ctx = clocked()
    run_id = suspended(ctx, tmp_path, extra="")
    saved = ctx.snapshots.load(run_id)
    assert saved is not None and saved.max_suspended_s is None
    assert b"max_suspended_s" not in snapshot_format.encode(saved)
    assert "max_suspended_s" not in ctx.runs.events(run_id)[0].data


def test_a_run_the_previous_release_started_and_checkpointed_still_expires(
    tmp_path: Path, ledger: Path
) -> None:
    clock, ctx = clocked()
    # Given a run the previous release started, suspended on a person, whose snapshot
    # is the previous release's: no max_suspended_s in it
    run_id = suspended_by_the_previous_release(ctx, tmp_path)
    saved = ctx.snapshots.load(run_id)
    assert saved is not None and saved.max_suspended_s is None
    assert b"max_suspended_s" not in snapshot_format.encode(saved)
    # Then it sits in the due index at its expiry all the same (its binding says)
    record = ctx.runs.get(run_id)
    assert record is not None and record.due_at_ms == T0_MS + 60_001
    # And when its agent file has changed since (a longer limit), the sweep still expires
    # it by the limit it started with, read from its first event
    write_agent(tmp_path, ASK, extra="max_suspended_s = 600")
    reads = first_event_reads(ctx)
    clock.now_ms += 60_001
    assert sweep(ctx) == [run_id]
    assert ctx.runs.get(run_id).status == RunStatus.FAILED  # type: ignore[union-attr]
    assert reads == [run_id]


def test_an_answer_to_a_run_the_previous_release_started_expires_it_when_late(
    tmp_path: Path, ledger: Path
) -> None:
    clock, ctx = clocked()
    # Given a run the previous release started and suspended
    run_id = suspended_by_the_previous_release(ctx, tmp_path)
    record = ctx.runs.get(run_id)
    assert record is not None and record.suspension is not None
    # When its answer arrives after 61 s
    clock.now_ms += 61_000
    answer = make_continuation(
        run_id, "late", input="order B2", suspension_seq=record.suspension.seq
    )
    # Then the answer is refused and the run has expired, by the limit it started with
    with pytest.raises(RatchetError, match="max_suspended_s of 60"):
        apply_continuation(ctx, answer)
    assert ctx.runs.get(run_id).status == RunStatus.FAILED  # type: ignore[union-attr]
