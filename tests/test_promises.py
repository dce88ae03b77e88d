"""Promises the docs make that a one-line bug could break unseen (issue 35), each held here
at the cheapest level that shows it: the sweeper's side, children, and a process's
liveness before it takes a lease. In-process, memory stores, the run store's clock
injected (the liveness test: the real clock and the real liveness thread).

The limiter's are in store/conformance/limits.py (every limit store), the tool timeouts'
in tests/test_turn_guarantees.py and tests/test_probes.py, the budget top-up's in
tests/test_budget_raise.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from runtime.children import child_run_id, waits_for
from runtime.fsm import rebuild
from runtime.models import Event, RunState
from runtime.recovery import OPERATOR, SWEEPER, consecutive_recoveries
from store.conformance import FakeClock
from tasks.children import deliver
from tasks.context import Context
from tasks.liveness import beats, claim, process_id
from tasks.recovery import sweep_orphans
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, drive, memory_context, turn, write_agent
from tests.test_recovery import LEASE_MS, clocked_context


def no_enqueue(run_id: str, seq: int) -> None:
    """The tests take the turns themselves."""


def parent_of_children(ctx: Context, home: Path, children: int) -> str:
    """A parent that starts ``children`` children one after another, each of one turn."""
    write_agent(home, [turn("A1 is a kettle.")], name="kettle")
    asks = [turn(f"Asking {i}.", call("run_child", agent="kettle", input=f"Look up A{i}"))
            for i in range(children)]  # fmt: skip
    agent = write_agent(
        home, [*asks, turn("Done.")], name="parent", tools=["run_child"],
        extra='[children]\nkettle = "kettle.toml"',
    )  # fmt: skip
    return create_run(ctx, agent, "look them up", "parent").run_id


def state_of(ctx: Context, run_id: str) -> RunState:
    state = rebuild(list(ctx.runs.events(run_id, after_seq=0)))
    assert state is not None
    return state


# --- the sweeper's side -----------------------------------------------------------


def test_a_child_that_ended_untold_is_found_by_the_sweeper_which_tells_its_parent(
    tmp_path: Path,
) -> None:
    clock = FakeClock(1_000_000)
    ctx = clocked_context(clock)
    # Given a parent waiting for its child, and the child ended, its worker dead before
    # `ratchet.deliver` told the parent
    parent = parent_of_children(ctx, tmp_path, 1)
    assert drive(ctx, parent).outcome == "suspended"
    child = child_run_id(parent, "call_1_1")
    assert drive(ctx, child).outcome == "completed"
    # When the sweeper sweeps
    told: list[str] = []
    found = sweep_orphans(ctx, lambda run, seq: None, tell=told.append)
    # Then it finds the child and tells the parent, which then goes on to complete
    assert found == [child] and told == [child]
    chained: list[tuple[str, int]] = []
    assert deliver(ctx, child, lambda run, seq: chained.append((run, seq))) == "told"
    assert [run for run, _ in chained] == [parent]
    assert drive(ctx, parent).outcome == "completed"
    # and once told, the child is not found again
    assert sweep_orphans(ctx, lambda run, seq: None, tell=told.append) == []


def test_a_sweep_postpones_what_it_enqueued_so_the_next_sweep_does_not_enqueue_it_again(
    tmp_path: Path,
) -> None:
    clock = FakeClock(1_000_000)
    ctx = clocked_context(clock)
    agent = write_agent(tmp_path, [turn("Done.")])
    run_id = create_run(ctx, agent, "x").run_id
    enqueued: list[str] = []
    # Given a run overdue (waiting in a long queue, say)
    clock.now_ms += LEASE_MS + 1
    # When the sweeper sweeps once, and again a moment later, and again a lease later
    first = sweep_orphans(ctx, lambda run, seq: enqueued.append(run))
    clock.now_ms += 1000
    second = sweep_orphans(ctx, lambda run, seq: enqueued.append(run))
    clock.now_ms += LEASE_MS
    third = sweep_orphans(ctx, lambda run, seq: enqueued.append(run))
    # Then the first and the third enqueue its resume, the second does not
    assert (first, second, third) == ([run_id], [], [run_id])
    assert enqueued == [run_id, run_id]


def test_a_live_run_between_turns_is_not_overdue_until_a_lease_has_passed(
    tmp_path: Path,
) -> None:
    clock = FakeClock(1_000_000)
    ctx = clocked_context(clock)
    agent = write_agent(
        tmp_path, [turn("Looking.", call("lookup_order", order_id="A1")), turn("Done.")]
    )
    run_id = create_run(ctx, agent, "x").run_id
    # Given a turn that ended with the next one queued (a long queue ahead of it)
    clock.now_ms += LEASE_MS - 1  # just short of overdue since it was created
    assert advance(ctx, run_id, None).outcome == "next"
    # When the sweeper looks just before a lease has passed since that turn
    clock.now_ms += LEASE_MS - 1
    before = sweep_orphans(ctx, lambda run, seq: None)
    clock.now_ms += 2
    after = sweep_orphans(ctx, lambda run, seq: None)
    # Then it is not overdue before, and is after
    assert (before, after) == ([], [run_id])


def resumed(seq: int, by: str) -> Event:
    return Event(seq=seq, type="run.resumed", at_ms=seq, data={"by": by, "attempt": seq})


def test_an_operators_resume_resets_the_count_of_recoveries_in_a_row() -> None:
    # Given two sweeper recoveries that did not help, then an operator's resume, then one more
    created = Event(seq=1, type="run.created", at_ms=0, data={})
    events = [created, resumed(2, SWEEPER), resumed(3, SWEEPER), resumed(4, OPERATOR)]
    # Then the count starts again after the operator's: the next crash is not dead-lettered
    assert consecutive_recoveries(events) == []
    assert consecutive_recoveries([*events, resumed(5, SWEEPER)]) == [resumed(5, SWEEPER)]
    assert len(consecutive_recoveries(events[:3])) == 2


# --- children -----------------------------------------------------------------------


def test_a_duplicate_delivery_of_a_childs_result_does_not_answer_the_parents_next_wait(
    tmp_path: Path,
) -> None:
    ctx = memory_context()
    # Given a parent whose first child was delivered, now waiting for its second
    parent = parent_of_children(ctx, tmp_path, 2)
    assert drive(ctx, parent).outcome == "suspended"
    first = child_run_id(parent, "call_1_1")
    assert drive(ctx, first).outcome == "completed"
    assert deliver(ctx, first, no_enqueue) == "told"
    assert drive(ctx, parent).outcome == "suspended"
    second = child_run_id(parent, "call_2_1")
    waiting = state_of(ctx, parent)
    # Then the first child's result is not what the parent waits for now, the second's is
    assert not waits_for(waiting, first) and waits_for(waiting, second)
    # and a duplicate delivery of the first changes nothing on the parent
    before = list(ctx.runs.events(parent, after_seq=0))
    assert deliver(ctx, first, no_enqueue) == "stale"
    assert list(ctx.runs.events(parent, after_seq=0)) == before
    assert waits_for(state_of(ctx, parent), second)


# --- liveness -----------------------------------------------------------------------


def test_a_process_whose_liveness_record_lapsed_renews_it_before_it_takes_a_lease(
    tmp_path: Path,
) -> None:
    ctx = memory_context(liveness_s=0.4, heartbeat_interval_s=0.1, lease_s=60.0)
    run_id = create_run(ctx, write_agent(tmp_path, [turn("Done.")]), "x").run_id
    # Given this process's liveness record in the store lapsed (its beats stopped)
    beats().keep_alive(ctx)
    beats().forget(ctx.runs)
    deadline = time.monotonic() + 10
    while (until := ctx.runs.liveness(process_id())) is not None and until > ctx.runs.clock():
        assert time.monotonic() < deadline, "the liveness record never lapsed"
        time.sleep(0.02)
    # When it takes a run's lease
    assert claim(ctx, run_id, f"{process_id()}/t1").taken
    # Then it is alive in the store as it does: no other worker may take the run back
    until = ctx.runs.liveness(process_id())
    assert until is not None and until > ctx.runs.clock()
    assert not ctx.runs.claim_lease(run_id, "other-host:1:x/t1", 60).taken
    beats().forget(ctx.runs)
