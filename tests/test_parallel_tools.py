"""Parallel tool calls: they overlap in time, and the model reads their results in order.

Also the pure rules of a batch (runtime/fsm.py): how many calls start together,
and what ends a batch (a call awaiting approval, a control tool, the budget).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.actions import RequestOrder, extend_request_order, in_request_order
from runtime.agent import Agent
from runtime.fsm import CallModel, RunTool, Suspend, apply, decide, rebuild, response_events
from runtime.models import Event, Message, RunState, RunStatus, ToolCall
from runtime.probes import idempotency_key
from runtime_io.agent_files import load_agent
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent

TOOLS = ["tests.probed_tools:timed_effect", "tests.probed_tools:effect", "request_user_input"]


@pytest.fixture
def times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "times"
    monkeypatch.setenv("RATCHET_TEST_TIMES", str(path))
    monkeypatch.setenv("RATCHET_TEST_EFFECTS", str(tmp_path / "effects"))
    return path


def test_three_calls_of_a_second_overlap_and_reach_the_model_in_request_order(
    tmp_path: Path, times: Path
) -> None:
    # Given a response that asks for three calls of about a second, the first the longest
    calls = [call("timed_effect", label=label, sleep_s=s) for label, s in
             (("a", 1.0), ("b", 0.8), ("c", 0.6))]  # fmt: skip
    agent = write_agent(tmp_path, [turn("all three", *calls), turn("Done.")], tools=TOOLS)
    ctx = memory_context()
    run_id = create_run(ctx, agent, "go").run_id
    # When the run is driven
    assert drive(ctx, run_id).outcome == "completed"
    # Then every call started before any finished: they ran at the same time
    spans = {label: (float(s), float(e)) for label, s, e in
             (line.split() for line in times.read_text().splitlines())}  # fmt: skip
    assert sorted(spans) == ["a", "b", "c"]
    assert max(s for s, _ in spans.values()) < min(e for _, e in spans.values()), spans
    # And each outcome was journaled as it finished (the shortest first) ...
    events = ctx.runs.events(run_id)
    finished = [e.data["call_id"] for e in events if e.type == "tool.completed"]
    assert finished == ["call_1_3", "call_1_2", "call_1_1"]
    # ... and checkpointed on its own: one event each, each folded in a seq of its own
    requested = [e.seq for e in events if e.type == "tool.requested"]
    assert len(requested) == 3 and requested == list(range(requested[0], requested[0] + 3))
    # And the model reads the results in the order it asked for the calls
    before_answer = [e for e in events if e.seq < events[-1].seq - 2]
    state = rebuild(before_answer)
    assert state is not None and not state.pending
    action = decide(state, load_agent(agent), state.created_at_ms)
    assert isinstance(action, CallModel)
    tool_messages = [m.tool_call_id for m in action.request().messages if m.role == "tool"]
    assert tool_messages == ["call_1_1", "call_1_2", "call_1_3"]
    assert [m.tool_call_id for m in state.transcript if m.role == "tool"] == finished


def _state_after_response(
    tmp_path: Path, *calls: dict[str, Any], **agent_options: Any
) -> tuple[RunState, Agent]:
    """The run's state once the model asked for ``calls``, before any of them ran."""
    agent_path = write_agent(
        tmp_path, [turn("go", *calls), turn("Done.")], tools=TOOLS, **agent_options
    )
    ctx = memory_context()
    run_id = create_run(ctx, agent_path, "go").run_id
    agent = load_agent(agent_path)
    state = rebuild(ctx.runs.events(run_id))
    assert state is not None
    first = decide(state, agent, state.created_at_ms)
    assert isinstance(first, CallModel)
    for kind, data in response_events(agent.provider.complete(first.request())):
        state = apply(state, Event(seq=state.seq + 1, type=kind, at_ms=0, data=data))
    return state, agent


def test_a_batch_is_at_most_max_parallel_tools_calls(tmp_path: Path) -> None:
    calls = [call("effect", label=str(i)) for i in range(5)]
    state, agent = _state_after_response(tmp_path, *calls, extra="max_parallel_tools = 3")
    action = decide(state, agent, state.created_at_ms)
    assert isinstance(action, RunTool)
    assert [c.id for c in action.calls] == ["call_1_1", "call_1_2", "call_1_3"]


def test_a_batch_stays_within_what_max_tool_calls_has_left(tmp_path: Path) -> None:
    calls = [call("effect", label=str(i)) for i in range(4)]
    state, agent = _state_after_response(tmp_path, *calls, budgets={"max_tool_calls": 2})
    action = decide(state, agent, state.created_at_ms)
    assert isinstance(action, RunTool) and len(action.calls) == 2


def test_a_call_awaiting_approval_ends_the_batch_and_is_decided_on_its_own(
    tmp_path: Path,
) -> None:
    calls = [call("effect", label="a"), call("timed_effect", label="b", sleep_s=0),
             call("effect", label="c")]  # fmt: skip
    state, agent = _state_after_response(tmp_path, *calls, require_approval=["timed_effect"])
    action = decide(state, agent, state.created_at_ms)
    assert isinstance(action, RunTool) and [c.id for c in action.calls] == ["call_1_1"]
    answered = state.model_copy(update={"pending": state.pending[1:]})
    waits = decide(answered, agent, state.created_at_ms)
    assert isinstance(waits, Suspend) and waits.reason == RunStatus.AWAITING_APPROVAL
    assert waits.call.id == "call_1_2"


def test_a_control_tool_ends_the_batch(tmp_path: Path) -> None:
    calls = [call("effect", label="a"), call("request_user_input", prompt="?"),
             call("effect", label="c")]  # fmt: skip
    state, agent = _state_after_response(tmp_path, *calls)
    action = decide(state, agent, state.created_at_ms)
    assert isinstance(action, RunTool) and [c.id for c in action.calls] == ["call_1_1"]


def test_the_idempotency_key_is_stable_and_differs_per_run_turn_and_call() -> None:
    key = idempotency_key("run-1", 1, "call_1_1")
    assert key == idempotency_key("run-1", 1, "call_1_1")
    assert key.startswith("ratchet-") and len(key) == len("ratchet-") + 40
    others = {idempotency_key("run-2", 1, "call_1_1"), idempotency_key("run-1", 2, "call_1_1"),
              idempotency_key("run-1", 1, "call_1_2")}  # fmt: skip
    assert key not in others and len(others) == 3


def _one_by_one(transcript: tuple[Message, ...]) -> tuple[Message, ...]:
    """The request order as the rule says it, message by message: each run of tool results
    sorted by the place of its call in the last response before it (the others after)."""
    ordered: list[Message] = []
    rank: dict[str, int] = {}
    results: list[Message] = []
    for message in (*transcript, None):
        if message is not None and message.role == "tool":
            results.append(message)
            continue
        ordered.extend(sorted(results, key=lambda m: rank.get(m.tool_call_id or "", len(rank))))
        results.clear()
        if message is not None:
            ordered.append(message)
            if message.role == "assistant":
                rank = {c.id: i for i, c in enumerate(message.tool_calls)}
    return tuple(ordered)


_IDS = st.sampled_from(["c1", "c2", "c3", "c4"])
_MESSAGES = st.one_of(
    st.builds(Message, role=st.sampled_from(["system", "user"]), content=st.text(max_size=3)),
    st.builds(
        Message,
        role=st.just("assistant"),
        tool_calls=st.lists(_IDS, unique=True, max_size=4).map(
            lambda ids: tuple(ToolCall(id=i, name="effect") for i in ids)
        ),
    ),
    st.builds(
        Message,
        role=st.just("tool"),
        tool_call_id=st.one_of(st.none(), _IDS, st.just("unasked")),
        content=st.text(max_size=3),
    ),
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(_MESSAGES, max_size=24).map(tuple))
def test_the_request_order_sorts_each_run_of_results_by_the_calls_that_asked_for_them(
    transcript: tuple[Message, ...],
) -> None:
    ordered = in_request_order(transcript)
    assert ordered == _one_by_one(transcript)
    assert sorted(map(id, ordered)) == sorted(map(id, transcript))


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(_MESSAGES, max_size=24).map(tuple), st.integers(0, 24), st.booleans())
def test_an_order_extended_from_an_earlier_model_calls_is_the_order_of_the_whole(
    transcript: tuple[Message, ...], cut: int, rebuilt: bool
) -> None:
    # Given the order of a prefix of the transcript, as an earlier model call made it
    # (or of equal messages that are other objects, as after a rebuild from events)
    prefix = transcript[:cut]
    if rebuilt:
        prefix = tuple(m.model_copy() for m in prefix)
    known = RequestOrder(prefix, in_request_order(prefix))
    # When the whole is ordered from it
    extended = extend_request_order(transcript, known)
    # Then it is the order of the whole, wherever the cut fell
    assert extended.transcript == transcript
    assert extended.messages == in_request_order(transcript)


def test_the_order_of_another_transcript_is_not_extended() -> None:
    # Given a transcript whose second message is a response, and another run's order
    asked = Message(role="assistant", tool_calls=(ToolCall(id="c1", name="effect"),
                                                  ToolCall(id="c2", name="effect")))  # fmt: skip
    results = (Message(role="tool", tool_call_id="c2"), Message(role="tool", tool_call_id="c1"))
    transcript = (Message(role="user", content="this run"), asked, *results)
    another = (Message(role="user", content="another run"),)
    # When the transcript is ordered from it, then none of it is taken
    ordered = extend_request_order(transcript, RequestOrder(another, another)).messages
    assert ordered == (transcript[0], asked, results[1], results[0])
