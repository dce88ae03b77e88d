"""Budget top-up: a run stopped on a budget goes on after an operator raises it (memory stores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.errors import InvalidRequest, RunRefused
from runtime.fsm import rebuild
from runtime.models import RunState, RunStatus
from store.conformance import FakeClock
from store.runs.memory import MemoryRunStore
from tasks.budget import raise_budgets
from tasks.context import Context
from tasks.control import cancel
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent

LOOKUPS = [turn(f"look {n}", call("lookup_order", order_id="A1")) for n in range(4)]


def state_of(ctx: Context, run_id: str) -> RunState:
    state = rebuild(list(ctx.runs.events(run_id, after_seq=0)))
    assert state is not None
    return state


def no_enqueue(run_id: str, seq: int) -> None:
    """The tests take the turns themselves."""


def stopped_on_turns(ctx: Context, tmp_path: Path) -> str:
    agent = write_agent(tmp_path, [*LOOKUPS, turn("Done.")], budgets={"max_turns": 2})
    run_id = create_run(ctx, agent, "look it up", "stopped").run_id
    assert drive(ctx, run_id).outcome == "failed"
    return run_id


def test_a_run_stopped_on_max_turns_completes_after_a_top_up_with_its_audit_record(
    tmp_path: Path,
) -> None:
    ctx = memory_context()
    # Given a run that failed on max_turns 2, its failure naming the budget and the command
    run_id = stopped_on_turns(ctx, tmp_path)
    failed = state_of(ctx, run_id)
    assert failed.error is not None and failed.error.startswith("budget `max_turns` exhausted")
    assert f"ratchet runs budget {run_id} --max-turns +N" in failed.error
    # When an operator gives it three more turns
    enqueued: list[tuple[str, int]] = []
    state = raise_budgets(
        ctx,
        run_id,
        {"max_turns": "+3"},
        "operator:ana",
        "ticket 42",
        lambda r, s: enqueued.append((r, s)),
    )
    # Then it is live again at the state it stopped in, and its next turn is enqueued
    assert state.status == RunStatus.MODEL and state.error is None
    assert state.budgets.max_turns == 5 and enqueued == [(run_id, state.seq)]
    assert state.transcript == failed.transcript
    # and it completes, with the audit record in its events
    assert drive(ctx, run_id).outcome == "completed"
    raised = [e for e in ctx.runs.events(run_id, after_seq=0) if e.type == "run.budget_raised"]
    assert [e.data for e in raised] == [
        {
            "by": "operator:ana",
            "reason": "ticket 42",
            "budgets": {"max_turns": 5},
            "was": {"max_turns": 2},
        }
    ]
    # and the agent file still matches the run's binding: nothing is refused as changed
    assert state_of(ctx, run_id).binding == failed.binding


def test_a_raise_names_the_budget_the_run_stopped_on(tmp_path: Path) -> None:
    ctx = memory_context()
    run_id = stopped_on_turns(ctx, tmp_path)
    before = list(ctx.runs.events(run_id, after_seq=0))
    with pytest.raises(InvalidRequest, match="stopped on `max_turns`: raise that one"):
        raise_budgets(ctx, run_id, {"max_tool_calls": "+5"}, "ana", "x", no_enqueue)
    with pytest.raises(InvalidRequest, match="`max_turns` is 2: 1 would not raise it"):
        raise_budgets(ctx, run_id, {"max_turns": "1"}, "ana", "x", no_enqueue)
    with pytest.raises(InvalidRequest, match="'\\+0' is not a raise"):
        raise_budgets(ctx, run_id, {"max_turns": "+0"}, "ana", "x", no_enqueue)
    with pytest.raises(InvalidRequest, match="'-3' is not a raise"):
        raise_budgets(ctx, run_id, {"max_turns": "-3"}, "ana", "x", no_enqueue)
    with pytest.raises(InvalidRequest, match="say why"):
        raise_budgets(ctx, run_id, {"max_turns": "+3"}, "ana", "  ", no_enqueue)
    with pytest.raises(InvalidRequest, match="`max_total_tokens` has no limit"):
        raise_budgets(
            ctx, run_id, {"max_turns": "+1", "max_total_tokens": "+9"}, "ana", "x", no_enqueue
        )
    # and every refusal left the run's events as they were
    assert list(ctx.runs.events(run_id, after_seq=0)) == before


def test_a_run_that_ended_another_way_is_refused(tmp_path: Path) -> None:
    ctx = memory_context()
    agent = write_agent(tmp_path, [turn("Which?", call("request_user_input", prompt="Which?"))])
    run_id = create_run(ctx, agent, "x", "cancelled").run_id
    drive(ctx, run_id)
    cancel(ctx, run_id, "no longer needed")
    with pytest.raises(RunRefused, match="run cancelled is cancelled: only a run that is live"):
        raise_budgets(ctx, run_id, {"max_turns": "+3"}, "ana", "x", no_enqueue)


def test_a_suspended_run_can_be_given_more_ahead_of_time(tmp_path: Path) -> None:
    ctx = memory_context()
    agent = write_agent(
        tmp_path,
        [turn("Which?", call("request_user_input", prompt="Which?"))],
        budgets={"timeout_seconds": 60},
    )
    run_id = create_run(ctx, agent, "x", "asking").run_id
    drive(ctx, run_id)
    enqueued: list[tuple[str, int]] = []
    state = raise_budgets(
        ctx,
        run_id,
        {"timeout_seconds": "+600"},
        "ana",
        "long weekend",
        lambda r, s: enqueued.append((r, s)),
    )
    # It stays suspended, with the longer deadline, and no turn is enqueued
    assert state.status == RunStatus.NEEDS_USER_INPUT and state.budgets.timeout_seconds == 660
    assert enqueued == []


def test_a_run_past_its_deadline_needs_a_limit_beyond_the_time_it_has_run(tmp_path: Path) -> None:
    clock = FakeClock(1_000_000)
    ctx = memory_context()
    ctx.runs = MemoryRunStore(clock=clock)
    agent = write_agent(tmp_path, [*LOOKUPS, turn("Done.")], budgets={"timeout_seconds": 60})
    run_id = create_run(ctx, agent, "look it up", "late").run_id
    # Given a run whose next turn came 500 s after it started: it fails on its deadline
    clock.now_ms += 500_000
    assert drive(ctx, run_id).outcome == "failed"
    assert "budget `timeout_seconds` exhausted: 500 used of 60" in str(state_of(ctx, run_id).error)
    # Then 100 s more is not enough, and 600 s more is
    with pytest.raises(
        InvalidRequest, match="the run has used 500; a limit of 160 leaves it nothing"
    ):
        raise_budgets(ctx, run_id, {"timeout_seconds": "+100"}, "ana", "x", no_enqueue)
    # and a limit of exactly the 500 s it has used leaves it nothing either
    with pytest.raises(InvalidRequest, match="a limit of 500 leaves it nothing"):
        raise_budgets(ctx, run_id, {"timeout_seconds": "500"}, "ana", "x", no_enqueue)
    state = raise_budgets(ctx, run_id, {"timeout_seconds": "+600"}, "ana", "x", no_enqueue)
    assert state.status.is_live
    assert drive(ctx, run_id).outcome == "completed"
