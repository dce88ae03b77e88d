"""The pure core at its edges: budgets at their exact limits, the deadline before each
kind of step, and the fold refusing an impossible sequence of events.

No stores, no worker: states are folded from events with :func:`runtime.fsm.apply`
and :func:`runtime.fsm.decide` is asked what happens next, at a time the test picks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.agent import Agent
from runtime.errors import EventsDoNotFold
from runtime.fsm import (
    CallModel,
    Fail,
    Idle,
    RunTool,
    Suspend,
    Unresolved,
    apply,
    created_event,
    decide,
    requested_event,
    requested_with_response,
)
from runtime.models import Event, RunState, RunStatus
from runtime.probes import Rule
from runtime_io.agent_files import load_agent
from tests.helpers import write_agent

T0_MS = 1_700_000_000_000


def agent(tmp_path: Path, **budgets: Any) -> Agent:
    return load_agent(
        write_agent(
            tmp_path,
            [],
            tools=["examples.refunds:lookup_order", "request_user_input"],
            budgets=budgets,
            require_approval=[],
        )
    )


def step(state: RunState | None, type_: str, at_ms: int = T0_MS, **data: Any) -> RunState:
    seq = 1 if state is None else state.seq + 1
    return apply(state, Event(seq=seq, type=type_, at_ms=at_ms, data=data))


def started(a: Agent) -> RunState:
    return step(None, "run.created", **created_event("run-1", a, "refund B2", T0_MS))


def answered(
    state: RunState, *calls: str, tokens: tuple[int, int] | None = (10, 5), retries: int = 0
) -> RunState:
    """One model turn that asked for ``calls`` (tool names), each given a fresh id."""
    turn = state.usage.model_turns + 1
    state = step(state, "model.requested", turn=turn)
    for _ in range(retries):
        state = step(state, "model.retrying", turn=turn)
    tool_calls = [
        {"id": f"call_{turn}_{i}", "name": name, "arguments": {"order_id": "B2"}}
        for i, name in enumerate(calls)
    ]
    usage = None if tokens is None else {"input_tokens": tokens[0], "output_tokens": tokens[1]}
    return step(state, "model.responded", content="", tool_calls=tool_calls, usage=usage)


def suspended_on(
    state: RunState, call: Any, reason: str = "needs_user_input", prompt: str = "which?"
) -> RunState:
    """``state`` with the run suspended on ``call`` (a tool call: a person's input or an
    approval it waits for)."""
    return step(
        state,
        "run.suspended",
        reason=reason,
        call_id=call.id,
        tool=call.name,
        arguments={},
        prompt=prompt,
    )


def tools_done(state: RunState) -> RunState:
    for pending in state.pending:
        state = step(state, "tool.requested", call_id=pending.id, name=pending.name)
        state = step(state, "tool.completed", call_id=pending.id, name=pending.name, result={})
    return state


def assert_refused(state: RunState, a: Agent, reason: str) -> None:
    """``decide`` fails the run, saying ``reason``."""
    refused = decide(state, a, T0_MS)
    assert isinstance(refused, Fail) and reason in refused.reason, refused


# --- budgets at their exact limits -------------------------------------------


def test_the_token_budget_allows_a_model_call_one_token_below_it_and_refuses_one_at_it(
    tmp_path: Path,
) -> None:
    a = agent(tmp_path, max_total_tokens=15)
    below = tools_done(answered(started(a), "lookup_order", tokens=(10, 4)))
    at = tools_done(answered(started(a), "lookup_order", tokens=(10, 5)))

    assert isinstance(decide(below, a, T0_MS), CallModel)
    assert_refused(at, a, "budget `max_total_tokens` exhausted: 15 used of 15")


def test_a_token_budget_the_provider_gives_no_usage_for_fails_rather_than_guessing(
    tmp_path: Path,
) -> None:
    a = agent(tmp_path, max_total_tokens=1_000_000)
    state = tools_done(answered(started(a), "lookup_order", tokens=None))

    assert_refused(state, a, "cannot be enforced")
    # Without a token budget the same run goes on.
    unbudgeted = agent(tmp_path / "u")
    plain = tools_done(answered(started(unbudgeted), "lookup_order", tokens=None))
    assert isinstance(decide(plain, unbudgeted, T0_MS), CallModel)


def test_the_turn_budget_allows_the_last_attempt_and_refuses_the_one_after(
    tmp_path: Path,
) -> None:
    a = agent(tmp_path, max_turns=3)
    two = tools_done(answered(tools_done(answered(started(a), "lookup_order")), "lookup_order"))
    three = tools_done(answered(two, "lookup_order"))

    assert isinstance(decide(two, a, T0_MS), CallModel)
    assert_refused(three, a, "`max_turns` exhausted: 3 used of 3")


def test_a_provider_retry_within_one_model_call_counts_against_the_turn_budget(
    tmp_path: Path,
) -> None:
    a = agent(tmp_path, max_turns=3)
    # One answered turn, but its call needed two retries: three attempts in all.
    state = tools_done(answered(started(a), "lookup_order", retries=2))

    assert state.usage.model_turns == 1 and state.usage.model_attempts == 3
    assert_refused(state, a, "3 used of 3")


def test_the_tool_call_budget_allows_the_last_call_and_refuses_the_one_after(
    tmp_path: Path,
) -> None:
    a = agent(tmp_path, max_tool_calls=2)
    state = answered(started(a), "lookup_order", "lookup_order", "lookup_order")
    first = state.pending[0]
    state = step(state, "tool.requested", call_id=first.id, name=first.name)
    state = step(state, "tool.completed", call_id=first.id, name=first.name, result={})

    second = decide(state, a, T0_MS)
    assert isinstance(second, RunTool) and second.call == state.pending[0]
    call = state.pending[0]
    state = step(state, "tool.requested", call_id=call.id, name=call.name)
    state = step(state, "tool.failed", call_id=call.id, name=call.name, error="no")

    assert state.usage.tool_calls == 2  # a failed call counts too
    assert_refused(state, a, "`max_tool_calls` exhausted: 2 used of 2")


def test_answers_no_tool_produced_do_not_count_as_tool_calls(tmp_path: Path) -> None:
    # The control tool's answer (a person's input) is not a tool call the budget counts.
    a = agent(tmp_path, max_tool_calls=1)
    state = answered(started(a), "request_user_input")
    ask = decide(state, a, T0_MS)
    assert isinstance(ask, Suspend) and ask.reason == RunStatus.NEEDS_USER_INPUT
    state = suspended_on(state, ask.call)
    state = step(state, "run.continued", continuation_id="c1", input="B2", suspended_ms=5)

    assert state.usage.tool_calls == 0
    state = answered(state, "lookup_order")
    assert isinstance(decide(state, a, T0_MS), RunTool)


# --- the deadline, before a model call and before a tool call -----------------


@pytest.mark.parametrize(
    ("tools_ran", "next_action", "refusal"),
    [
        (True, CallModel, "budget `timeout_seconds` exhausted"),
        (False, RunTool, "`timeout_seconds` exhausted: 10 used of 10"),
    ],
    ids=["before_a_model_call", "before_a_tool_call"],
)
def test_the_deadline_is_checked_before_a_model_call_and_before_a_tool_call(
    tmp_path: Path, tools_ran: bool, next_action: type, refusal: str
) -> None:
    a = agent(tmp_path, timeout_seconds=10)
    state = answered(started(a), "lookup_order")
    if tools_ran:
        state = tools_done(state)
    deadline = T0_MS + 10_000

    assert isinstance(decide(state, a, deadline), next_action)
    late = decide(state, a, deadline + 1)
    assert isinstance(late, Fail) and refusal in late.reason


def test_time_suspended_moves_the_deadline_by_exactly_that_long(tmp_path: Path) -> None:
    a = agent(tmp_path, timeout_seconds=10)
    state = answered(started(a), "request_user_input")
    ask = state.pending[0]
    state = suspended_on(state, ask)
    state = step(state, "run.continued", continuation_id="c1", input="B2", suspended_ms=60_000)
    deadline = T0_MS + 10_000 + 60_000

    assert isinstance(decide(state, a, deadline), CallModel)
    assert isinstance(decide(state, a, deadline + 1), Fail)


# --- what decide picks --------------------------------------------------------


def test_a_finished_or_suspended_run_has_nothing_to_do(tmp_path: Path) -> None:
    a = agent(tmp_path)
    state = answered(started(a), "request_user_input")
    ask = state.pending[0]
    suspended = suspended_on(state, ask)
    done = step(answered(started(a)), "run.completed", output="ok")

    assert isinstance(decide(suspended, a, T0_MS), Idle)
    assert isinstance(decide(done, a, T0_MS), Idle) and done.status == RunStatus.COMPLETED


def test_a_tool_that_needs_approval_suspends_until_approved_then_runs(tmp_path: Path) -> None:
    a = load_agent(
        write_agent(
            tmp_path, [], tools=["examples.refunds:issue_refund"], require_approval=["issue_refund"]
        )
    )
    state = answered(started(a), "issue_refund")
    wait = decide(state, a, T0_MS)
    assert isinstance(wait, Suspend) and wait.reason == RunStatus.AWAITING_APPROVAL
    state = suspended_on(state, wait.call, "awaiting_approval", wait.prompt)
    state = step(state, "run.continued", continuation_id="c1", approved=True, suspended_ms=1)

    assert state.status == RunStatus.TOOLS and state.pending and state.approved
    assert isinstance(decide(state, a, T0_MS), RunTool)


@pytest.mark.parametrize("outcome", ["tool.completed", "tool.failed"])
def test_a_call_is_in_flight_from_its_request_until_its_outcome(
    tmp_path: Path, outcome: str
) -> None:
    # What the snapshot says is in flight is what an operator would have to reconcile.
    state = answered(started(agent(tmp_path)), "lookup_order", "lookup_order")
    first = state.pending[0]
    assert state.in_flight is None

    state = step(state, "tool.requested", call_id=first.id, name=first.name)
    assert state.in_flight == first.id and state.status == RunStatus.TOOLS

    data: dict[str, Any] = {"result": {}} if outcome == "tool.completed" else {"error": "no"}
    state = step(state, outcome, call_id=first.id, name=first.name, **data)
    assert state.in_flight is None
    assert [c.id for c in state.pending] == ["call_1_1"]


@pytest.mark.parametrize(
    ("calls", "requested"),
    [
        (("lookup_order", "refund_policy"), ("call_1_0", "call_1_1")),  # both may run again
        (("lookup_order", "issue_refund"), None),  # the refund may not: journaled as it starts
        (("send_refund",), None),  # not idempotent, probed: its probe would be asked
        (("no_such_tool",), None),  # an unknown call parks once requested
        (("request_user_input",), None),  # the next decision is no RunTool
        ((), None),  # the answer
    ],
)
def test_only_calls_that_may_run_again_are_journaled_with_the_answer_that_asks_for_them(
    tmp_path: Path, calls: tuple[str, ...], requested: tuple[str, ...] | None
) -> None:
    a = load_agent(
        write_agent(
            tmp_path,
            [],
            tools=[
                "examples.refunds:lookup_order",
                "examples.refunds:refund_policy",
                "examples.refunds:issue_refund",
                "examples.refunds:send_refund",
                "request_user_input",
            ],
        )
    )
    state = answered(started(a), *calls)

    batch = requested_with_response(state, a, T0_MS)

    assert (None if batch is None else tuple(c.id for c in batch.calls)) == requested
    if batch is not None and requested is not None:
        # Requested with no outcome, those calls are run again: what the batch would get.
        for call in batch.calls:
            kind, data = requested_event(call)
            state = step(state, kind, **data)
        again = decide(state, a, T0_MS)
        assert isinstance(again, Unresolved)
        assert [(c.id, rule) for c, rule in again.calls] == [(i, Rule.RERUN) for i in requested]


# --- the fold refuses an impossible sequence ----------------------------------


@pytest.mark.parametrize("offset", [0, 2, -1], ids=["repeat", "gap", "backwards"])
def test_an_event_that_does_not_follow_the_last_seq_is_refused(tmp_path: Path, offset: int) -> None:
    state = answered(started(agent(tmp_path)), "lookup_order")

    with pytest.raises(ValueError, match=f"event seq {state.seq + offset} follows {state.seq}"):
        apply(state, Event(seq=state.seq + offset, type="run.resumed", at_ms=T0_MS, data={}))


def test_a_log_that_does_not_start_with_run_created_or_holds_an_unknown_type_is_refused(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="first event must be run.created"):
        apply(None, Event(seq=1, type="model.requested", at_ms=T0_MS, data={}))
    state = started(agent(tmp_path))
    with pytest.raises(ValueError, match="unknown event type 'run.teleported'"):
        step(state, "run.teleported")


def test_an_event_whose_data_does_not_fold_is_refused_naming_the_run_the_seq_and_what_to_do(
    tmp_path: Path,
) -> None:
    state = step(started(agent(tmp_path)), "model.requested", turn=1)
    # A response whose tool call has no name: pydantic refuses it inside the fold
    with pytest.raises(EventsDoNotFold) as refused:
        step(state, "model.responded", content="", tool_calls=[{"id": "c1"}])
    assert refused.value.run_id == "run-1" and refused.value.seq == state.seq + 1
    assert "model.responded" in refused.value.where
    assert "`ratchet runs events run-1`" in str(refused.value)
    # and the impossible sequences are the same typed error, still a ValueError
    with pytest.raises(EventsDoNotFold):
        step(state, "run.woken")
