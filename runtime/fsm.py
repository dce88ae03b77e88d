"""The run as a finite-state machine: pure, no Celery, no I/O.

Two functions are the whole machine:

- :func:`apply` folds one event into a :class:`RunState`. The state is exactly
  the fold of the run's events, so the snapshot is a cache the event log can
  always rebuild (tests/test_recovery_rebuild.py holds it).
- :func:`decide` looks at a state and says what happens next
  (runtime/actions.py): call the model, run a tool, suspend, complete, fail on
  a budget, stall on a changed agent, or nothing. Budgets and the deadline are
  checked here, before every model call and every tool call.

``tasks/turn.py`` does the I/O around them: it records the events a step
produces, checkpoints, and chains the next turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from runtime.actions import (
    Action,
    CallModel,
    CheckBinding,
    Fail,
    Idle,
    Park,
    RefuseCall,
    RunTool,
    Stall,
    StartChild,
    Suspend,
    Unresolved,
)
from runtime.agent import Agent
from runtime.budget import fold_raise
from runtime.children import (
    RUN_CHILD,
    child_problem,
    child_result,
    child_run_id,
    tree_problem,
    with_child_runs,
    with_child_usage,
)
from runtime.endings import ENDINGS, ended
from runtime.errors import BudgetExhausted, BudgetUnenforceable, EventsDoNotFold
from runtime.fork import FORK_KEY, fold_fork
from runtime.models import (
    Event,
    Message,
    RunState,
    RunStatus,
    Suspension,
    ToolCall,
    Usage,
)
from runtime.probes import Answer, Rule, unknown_outcome_rule
from runtime.provider import ModelResponse
from runtime.timers import WAIT, wait_problem, woken_content
from runtime.timers import prompt as timer_prompt
from runtime.tools import BLOCKED, REQUEST_USER_INPUT, ToolOutcome

# --- events -----------------------------------------------------------------


def created_event(
    run_id: str,
    agent: Agent,
    user_input: str,
    now_ms: int,
    priority: int | None = None,
    concurrency_key: str | None = None,
    tree: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The data of a run's first event, `run.created` (a start's priority and key if given,
    its place in its run tree: runtime/children.py, and its agent's max_suspended_s if set)."""
    extra: dict[str, Any] = {}
    if tree is not None:
        extra["tree"] = tree
    if priority is not None:
        extra["priority"] = priority
    if concurrency_key is not None:
        extra["concurrency_key"] = concurrency_key
    if agent.spec.max_suspended_s is not None:
        # Also in the binding document; here the fold reads it (runtime/models.py RunState).
        extra["max_suspended_s"] = agent.spec.max_suspended_s
    return {
        **extra,
        "run_id": run_id,
        "agent": agent.name,
        "agent_file": str(agent.path),
        "binding": agent.binding,
        "input": user_input,
        "system": agent.spec.system,
        "budgets": agent.spec.budgets.model_dump(mode="json"),
        "created_at_ms": now_ms,
        "binding_document": agent.binding_document,
    }


def _live_status(state: RunState) -> RunStatus:
    if state.suspension is not None:
        return state.suspension.reason
    if state.pending:
        return RunStatus.TOOLS
    if state.usage.model_attempts == 0:
        return RunStatus.QUEUED
    return RunStatus.MODEL


def _tool_result(
    state: RunState, call_id: str, ok: bool, result: Any, counts: bool = True
) -> RunState:
    """Answer a pending call; ``counts`` is False for answers no tool produced (control, denial)."""
    call = next(c for c in state.pending if c.id == call_id)
    content = result if isinstance(result, str) else _json(result)
    message = Message(
        role="tool", content=content, tool_call_id=call_id, name=call.name, is_error=not ok
    )
    usage = state.usage.model_copy(update={"tool_calls": state.usage.tool_calls + int(counts)})
    rest = tuple(c for c in state.pending if c.id != call_id)
    state = state.model_copy(
        update={
            "transcript": state.transcript + (message,),
            "pending": rest,
            "running": tuple(c for c in state.running if c != call_id),
            "usage": usage,
            "approved": tuple(a for a in state.approved if a != call_id),
        }
    )
    return state.model_copy(update={"status": _live_status(state)})


def _json(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _responded(state: RunState, data: dict[str, Any]) -> RunState:
    calls = tuple(ToolCall.model_validate(c) for c in data.get("tool_calls", ()))
    message = Message(role="assistant", content=data.get("content", ""), tool_calls=calls)
    usage_data = data.get("usage")
    u = state.usage
    if usage_data is None:
        usage = u.model_copy(
            update={
                "model_turns": u.model_turns + 1,
                "responses_without_usage": u.responses_without_usage + 1,
            }
        )
    else:
        i, o = int(usage_data.get("input_tokens", 0)), int(usage_data.get("output_tokens", 0))
        usage = u.model_copy(
            update={
                "model_turns": u.model_turns + 1,
                "input_tokens": u.input_tokens + i,
                "output_tokens": u.output_tokens + o,
                "total_tokens": u.total_tokens + i + o,
            }
        )
    state = state.model_copy(
        update={
            "transcript": state.transcript + (message,),
            "pending": calls,
            "usage": usage,
            "throttled_since_ms": None,
        }
    )
    return state.model_copy(update={"status": _live_status(state)})


def _initial(event: Event) -> RunState:
    d = event.data
    if FORK_KEY in d:
        return fold_fork(event, rebuild)
    transcript = []
    if d.get("system"):
        transcript.append(Message(role="system", content=d["system"]))
    transcript.append(Message(role="user", content=d["input"]))
    return RunState.model_validate(
        {
            "run_id": d["run_id"],
            "seq": event.seq,
            "agent": d["agent"],
            "agent_file": d["agent_file"],
            "binding": d["binding"],
            "input": d["input"],
            "status": RunStatus.QUEUED,
            "budgets": d["budgets"],
            "created_at_ms": d["created_at_ms"],
            "transcript": tuple(transcript),
            "parent": (d.get("parent") or {}).get("run_id"),
            "priority": d.get("priority"),
            "concurrency_key": d.get("concurrency_key"),
            "tree": d.get("tree"),
            "max_suspended_s": d.get("max_suspended_s"),
        }
    )


INFORMATIONAL_EVENTS = frozenset({"model.failed", "run.resume_refused"})
"""Events that record what happened without changing what happens next."""

Fold = Callable[[RunState, Event], RunState]


def _model_retrying(state: RunState, event: Event) -> RunState:
    """A provider retried within one model call: the failed request was an attempt too."""
    usage = state.usage.model_copy(update={"model_attempts": state.usage.model_attempts + 1})
    return state.model_copy(update={"usage": usage})


def _model_requested(state: RunState, event: Event) -> RunState:
    usage = state.usage.model_copy(update={"model_attempts": state.usage.model_attempts + 1})
    return state.model_copy(update={"usage": usage, "status": RunStatus.MODEL})


def _tool_requested(state: RunState, event: Event) -> RunState:
    call_id = event.data["call_id"]
    if call_id in state.running:
        return state
    return state.model_copy(update={"running": state.running + (call_id,)})


def _tool_unsent(state: RunState, event: Event) -> RunState:
    """The call never reached its server: it did not run, and is requested no more."""
    call_id = event.data["call_id"]
    return state.model_copy(update={"running": tuple(c for c in state.running if c != call_id)})


def _tool_probed(state: RunState, event: Event) -> RunState:
    """A probe answered for a call cut short: ``ran`` is its outcome; any other answer is not."""
    d = event.data
    if d["answer"] == Answer.RAN.value and "error" in d:
        return _tool_result(state, d["call_id"], False, d["error"])
    if d["answer"] == Answer.RAN.value:
        return _tool_result(state, d["call_id"], True, d.get("result"))
    return state


def _tool_done(state: RunState, event: Event) -> RunState:
    d = event.data
    if event.type == "tool.completed":
        return _tool_result(state, d["call_id"], True, d["result"])
    return _tool_result(state, d["call_id"], False, d["error"])


def _suspended(state: RunState, event: Event) -> RunState:
    suspension = Suspension.model_validate(
        {**event.data, "seq": event.seq, "since_ms": event.at_ms}
    )
    return state.model_copy(update={"suspension": suspension, "status": suspension.reason})


def continuation_content(suspension: Suspension, data: dict[str, Any]) -> str:
    """What the model reads as the control tool's result: the person's answer, structured."""
    return _json(
        {
            "type": "run_continuation",
            "outcome": suspension.reason.value,
            "prompt": suspension.prompt,
            "input": data.get("input"),
            "continuation_id": data.get("continuation_id"),
        }
    )


def _continued(state: RunState, event: Event) -> RunState:
    """A person answered the suspension: `input` for a question or blocker, `approved` for a tool."""
    d, suspension = event.data, state.suspension
    if suspension is None:
        raise EventsDoNotFold(
            state.run_id, event.seq, "run.continued, but the run is not suspended"
        )
    state = state.model_copy(
        update={
            "suspension": None,
            "suspended_ms": state.suspended_ms + int(d.get("suspended_ms", 0)),
        }
    )
    if suspension.reason != RunStatus.AWAITING_APPROVAL:
        # The control tool is the runtime's, not a tool call the budget counts.
        content = continuation_content(suspension, d)
        return _tool_result(state, suspension.call_id, True, content, counts=False)
    if d.get("approved"):
        state = state.model_copy(update={"approved": state.approved + (suspension.call_id,)})
        return state.model_copy(update={"status": _live_status(state)})
    denied = f"a person denied `{suspension.tool}`: {d.get('reason') or 'no reason given'}"
    return _tool_result(state, suspension.call_id, False, denied, counts=False)


def _woken(state: RunState, event: Event) -> RunState:
    """A wait is over: its call is answered with how long it waited."""
    suspension = state.suspension
    if suspension is None:
        raise EventsDoNotFold(state.run_id, event.seq, "run.woken, but the run is not waiting")
    waited = max(0, event.at_ms - suspension.since_ms)
    state = state.model_copy(
        update={"suspension": None, "suspended_ms": state.suspended_ms + waited}
    )
    if event.data.get("by") == "child":
        ok, content = child_result(suspension, event.data)
        usage, tree = (
            with_child_usage(state.usage, event.data),
            with_child_runs(state.tree, event.data),
        )
        state = state.model_copy(update={"usage": usage, "tree": tree})
        return _tool_result(state, suspension.call_id, ok, content, counts=False)
    content = woken_content(suspension, event.at_ms)
    return _tool_result(state, suspension.call_id, True, content, counts=False)


def _reconciled(state: RunState, event: Event) -> RunState:
    """An operator decided the outcome of a call cut short by a crash."""
    d = event.data
    decision = d["decision"]
    if decision == "result":
        state = _tool_result(state, d["call_id"], True, d["result"])
    elif decision == "fail":
        state = _tool_result(state, d["call_id"], False, d["reason"])
    elif decision == "retry":
        state = state.model_copy(
            update={"running": tuple(c for c in state.running if c != d["call_id"])}
        )
    else:
        raise EventsDoNotFold(
            state.run_id, event.seq, f"unknown reconciliation decision {decision!r}"
        )
    state = state.model_copy(update={"error": None})
    return state.model_copy(update={"status": _live_status(state)})


def _throttled(state: RunState, event: Event) -> RunState:
    """The turn waits on a rate limit, a 429 or a concurrency cap, back on the queue.

    ``refused``: the provider answered 429 to the call ``model.requested`` counted, so
    that request is given back — it did no work. ``since_ms`` (rate limits and 429s
    only) is when the wait began, for the stall after ``max_wait_s``.
    """
    d = event.data
    usage = state.usage
    if d.get("refused") and usage.model_attempts > 0:
        usage = usage.model_copy(update={"model_attempts": usage.model_attempts - 1})
    since = d.get("since_ms")
    state = state.model_copy(
        update={
            "usage": usage,
            "throttled_since_ms": int(since) if since is not None else state.throttled_since_ms,
        }
    )
    return state.model_copy(update={"status": _live_status(state)})


def _resumed(state: RunState, event: Event) -> RunState:
    state = state.model_copy(
        update={
            "recovery_attempts": state.recovery_attempts + 1,
            "error": None,
            "throttled_since_ms": None,
        }
    )
    return state.model_copy(update={"status": _live_status(state)})


def _ending(state: RunState, event: Event) -> RunState:
    """An event of :data:`ENDINGS`: what it changes is :func:`runtime.endings.ended`'s, the
    rule a run ended without its state (a cancel) follows too."""
    return state.model_copy(
        update=ended(event.type, event.data, state.suspended_ms, state.suspension)
    )


FOLDS: dict[str, Fold] = {
    "model.requested": _model_requested,
    "model.retrying": _model_retrying,
    "model.responded": lambda state, event: _responded(state, event.data),
    "tool.requested": _tool_requested,
    "tool.completed": _tool_done,
    "tool.failed": _tool_done,
    "tool.reconciled": _reconciled,
    "tool.probed": _tool_probed,
    "tool.unsent": _tool_unsent,
    "run.suspended": _suspended,
    "run.continued": _continued,
    "run.woken": _woken,
    "run.parent_told": lambda state, event: state.model_copy(update={"parent_told": True}),
    "run.resumed": _resumed,
    **dict.fromkeys(ENDINGS, _ending),
    "run.budget_raised": lambda state, event: fold_raise(state, event.data, _live_status(state)),
    "run.throttled": _throttled,
}
"""How each event type changes the state. Every type ever written must stay here."""


def apply(state: RunState | None, event: Event) -> RunState:
    """Fold one event into the state. Pure; raises EventsDoNotFold on an impossible sequence.

    EventsDoNotFold is a ValueError too; a ValueError a fold raises on malformed data
    (a pydantic ValidationError) is raised as one, naming the run and the seq.
    """
    if state is None:
        run_id = event.data.get("run_id") if isinstance(event.data, dict) else None
        if event.type != "run.created":
            raise EventsDoNotFold(
                run_id, event.seq, f"a run's first event must be run.created, not {event.type}"
            )
        return _folded(run_id, event, lambda: _initial(event))
    if event.seq != state.seq + 1:
        raise EventsDoNotFold(state.run_id, event.seq, f"event seq {event.seq} follows {state.seq}")
    if event.type not in INFORMATIONAL_EVENTS:
        fold = FOLDS.get(event.type)
        if fold is None:
            raise EventsDoNotFold(
                state.run_id, event.seq, f"unknown event type {event.type!r} at seq {event.seq}"
            )
        before = state
        state = _folded(state.run_id, event, lambda: fold(before, event))
    return state.model_copy(update={"seq": event.seq})


def _folded(run_id: str | None, event: Event, fold: Callable[[], RunState]) -> RunState:
    try:
        return fold()
    except EventsDoNotFold:
        raise
    except ValueError as exc:
        raise EventsDoNotFold(run_id, event.seq, f"{event.type}: {exc}") from exc


def rebuild(events: list[Event]) -> RunState | None:
    """Fold a run's whole event log; ``None`` for an empty log."""
    state: RunState | None = None
    for event in events:
        state = apply(state, event)
    return state


# --- decisions --------------------------------------------------------------


def _check_deadline(state: RunState, now_ms: int) -> None:
    if now_ms > state.deadline_ms:
        running_s = (now_ms - state.created_at_ms - state.suspended_ms) / 1000
        raise BudgetExhausted(
            state.run_id, "timeout_seconds", round(running_s, 1), state.budgets.timeout_seconds
        )


def check_model_budgets(state: RunState, now_ms: int) -> None:
    b, u = state.budgets, state.usage
    if u.model_attempts >= b.max_turns:
        raise BudgetExhausted(state.run_id, "max_turns", u.model_attempts, b.max_turns)
    if b.max_total_tokens is not None:
        if u.responses_without_usage:
            raise BudgetUnenforceable(state.run_id, "max_total_tokens", u.responses_without_usage)
        if u.total_tokens >= b.max_total_tokens:
            raise BudgetExhausted(
                state.run_id, "max_total_tokens", u.total_tokens, b.max_total_tokens
            )
    _check_deadline(state, now_ms)


def check_tool_budgets(state: RunState, now_ms: int) -> None:
    if state.usage.tool_calls >= state.budgets.max_tool_calls:
        raise BudgetExhausted(
            state.run_id, "max_tool_calls", state.usage.tool_calls, state.budgets.max_tool_calls
        )
    _check_deadline(state, now_ms)


def decide(state: RunState, agent: Agent, now_ms: int) -> Action:
    """What the run does next. Pure: the caller performs and records it."""
    if not state.status.is_live:
        return Idle(f"run is {state.status.value}")
    if agent.binding != state.binding:
        return CheckBinding()
    try:
        if state.running:
            _check_deadline(state, now_ms)
            return _unresolved(state, agent)
        if state.pending:
            return _next_call(state, agent, now_ms)
        check_model_budgets(state, now_ms)
    except BudgetUnenforceable as exc:
        return Fail(str(exc))
    except BudgetExhausted as exc:
        return Fail(str(exc), exc.budget)
    return CallModel(state.transcript, agent.declarations(), state.usage.model_turns)


def _next_call(state: RunState, agent: Agent, now_ms: int) -> Action:
    """The first pending call's action; raises BudgetExhausted when it cannot be afforded."""
    call = state.pending[0]
    spec = agent.tools.get(call.name)
    if spec is not None and spec.control and call.name == RUN_CHILD:
        problem = child_problem(call.arguments, agent.spec.children) or tree_problem(state)
        if problem is not None:
            return RefuseCall(call, problem)
        return StartChild(call, child_run_id(state.run_id, call.id))
    if spec is not None and spec.control and call.name == WAIT:
        problem = wait_problem(call.arguments, now_ms)
        if problem is not None:
            return RefuseCall(call, problem)
        return Suspend(RunStatus.WAITING, call, timer_prompt(call.arguments, now_ms))
    if spec is not None and spec.control:
        reason = (
            RunStatus.NEEDS_USER_INPUT if call.name == REQUEST_USER_INPUT else RunStatus.BLOCKED
        )
        key = "prompt" if call.name == REQUEST_USER_INPUT else "reason"
        return Suspend(reason, call, str(call.arguments.get(key, "")))
    if call.name in agent.spec.policy.require_approval and call.id not in state.approved:
        return Suspend(RunStatus.AWAITING_APPROVAL, call, f"approve `{call.name}`?")
    check_tool_budgets(state, now_ms)
    return RunTool(call, _alongside(state, agent))


def _runs_alongside(call: ToolCall, state: RunState, agent: Agent) -> bool:
    """A plain tool call that needs no one's approval: it may start with the calls before it."""
    spec = agent.tools.get(call.name)
    if spec is not None and spec.control:
        return False
    return call.name not in agent.spec.policy.require_approval or call.id in state.approved


def _alongside(state: RunState, agent: Agent) -> tuple[ToolCall, ...]:
    """The calls after the first that run with it: the plain calls that follow it, in order,
    up to ``max_parallel_tools`` in all and within what ``max_tool_calls`` has left.

    A control tool or a call awaiting approval ends the batch: it waits for the calls
    before it, and the calls after it wait for it, so each is decided on its own turn."""
    room = min(
        agent.spec.max_parallel_tools,
        state.budgets.max_tool_calls - state.usage.tool_calls,
    )
    batch: list[ToolCall] = []
    for call in state.pending[1:room]:
        if not _runs_alongside(call, state, agent):
            break
        batch.append(call)
    return tuple(batch)


def _unresolved(state: RunState, agent: Agent) -> Unresolved:
    calls = []
    for call in state.pending:
        if call.id in state.running:
            spec = agent.tools.get(call.name)
            rule = (
                Rule.PARK
                if spec is None
                else unknown_outcome_rule(spec.idempotent, spec.probe is not None)
            )
            calls.append((call, rule))
    return Unresolved(tuple(calls))


def response_events(response: ModelResponse) -> list[tuple[str, dict[str, Any]]]:
    """The events a model response produces: `model.responded`, and `run.completed`
    when it asked for no tools (recorded together, so a completed answer is one checkpoint)."""
    data = response.model_dump(mode="json")
    events: list[tuple[str, dict[str, Any]]] = [("model.responded", data)]
    if not response.tool_calls:
        events.append(("run.completed", {"output": response.content}))
    return events


def model_requested(model_calls: int) -> tuple[str, dict[str, Any]]:
    """The journal entry that counts the run's ``model_calls``-th model call before it is
    made: with no response after it, the attempt counts all the same."""
    return ("model.requested", {"turn": model_calls})


def requested_event(call: ToolCall) -> tuple[str, dict[str, Any]]:
    """The journal entry a call gets before it runs: with no outcome after it, the call was
    cut short, and its rule (runtime/probes.py) says what happens to it."""
    return ("tool.requested", {"call_id": call.id, "name": call.name, "arguments": call.arguments})


def unsent_event(call: ToolCall, reason: str) -> tuple[str, dict[str, Any]]:
    """A requested call that never reached its server (runtime/errors.py ``CallNotSent``):
    nothing ran, so it is requested no more, and the next decision sends it afresh."""
    return ("tool.unsent", {"call_id": call.id, "name": call.name, "reason": reason})


def ends_turn(action: Action, asked_model: bool) -> bool:
    """Whether a turn that has ``asked_model`` ends before ``action``: a turn calls the model
    at most once, so after its model call the next one is the next turn's."""
    return asked_model and isinstance(action, CallModel)


def requested_with_response(state: RunState, agent: Agent, now_ms: int) -> RunTool | None:
    """The calls to journal as requested in the same transition as the model response that
    asked for them (``state``: the state that response leaves), or None.

    They are the next decision's batch, when every call in it is one whose rule is to run
    again: a crash after that transition and before the calls start leaves them requested
    with no outcome, and such a call is then run again — which is what a call not yet
    journaled gets. For any other call requested-with-no-outcome means "it may have run":
    journaled before it provably started, a crash there would park the run (or ask its
    probe) for a call that never started, so it is journaled when it starts.
    """
    return requested_early(decide(state, agent, now_ms), agent)


def requested_early(action: Action, agent: Agent) -> RunTool | None:
    """:func:`requested_with_response` of the state ``action`` was decided on."""
    if not isinstance(action, RunTool):
        return None
    for call in action.calls:
        spec = agent.tools.get(call.name)
        if spec is None or unknown_outcome_rule(spec.idempotent, spec.probe is not None) != (
            Rule.RERUN
        ):
            return None
    return action


def journal_replicated(calls: Sequence[ToolCall], agent: Agent) -> bool:
    """Whether the ``tool.requested`` of ``calls`` must reach the run store's replicas
    before any of them starts (``min_replicas``, store/replicas.py).

    True when one of them is a call whose rule is not to run again (runtime/probes.py):
    should a failover lose its entry, the call would look as if it never started, and
    run again. A call whose rule is to run again may lose it: it would run again anyway.
    """
    for call in calls:
        spec = agent.tools.get(call.name)
        if spec is not None and (
            unknown_outcome_rule(spec.idempotent, spec.probe is not None) != Rule.RERUN
        ):
            return True
    return False


def tool_events(call: ToolCall, outcome: ToolOutcome) -> list[tuple[str, dict[str, Any]]]:
    if outcome.ok:
        return [
            ("tool.completed", {"call_id": call.id, "name": call.name, "result": outcome.result})
        ]
    return [("tool.failed", {"call_id": call.id, "name": call.name, "error": str(outcome.result)})]


def unknown_tool_outcome(call: ToolCall, agent: Agent) -> ToolOutcome:
    """The model asked for a tool the agent does not have: tell it, do not crash."""
    known = ", ".join(sorted(agent.tools)) or "none"
    return ToolOutcome(False, f"no tool named `{call.name}`; available tools: {known}")


def suspension_event(action: Suspend) -> tuple[str, dict[str, Any]]:
    return (
        "run.suspended",
        {
            "reason": action.reason.value,
            "call_id": action.call.id,
            "tool": action.call.name,
            "arguments": action.call.arguments,
            "prompt": action.prompt,
        },
    )


__all__ = [
    "ENDINGS",
    "Action",
    "BLOCKED",
    "CallModel",
    "CheckBinding",
    "Fail",
    "Idle",
    "Park",
    "RefuseCall",
    "StartChild",
    "Stall",
    "Unresolved",
    "RunTool",
    "Suspend",
    "Usage",
    "apply",
    "created_event",
    "decide",
    "ends_turn",
    "rebuild",
    "journal_replicated",
    "requested_event",
    "unsent_event",
    "requested_early",
    "requested_with_response",
    "response_events",
    "suspension_event",
    "tool_events",
    "unknown_tool_outcome",
]
