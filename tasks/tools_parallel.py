"""The tool calls of a turn: a model response's calls side by side, and calls cut short.

:func:`run_tools` carries out :class:`runtime.fsm.RunTool`: its calls (the first
pending call and the plain calls after it, at most the agent's
``max_parallel_tools``) are journaled ``tool.requested`` together — with the
model's response already when every one of them may run again
(:func:`runtime.fsm.requested_with_response`) — then each runs on a caller
thread of its own (tasks/threads.py). Each outcome is journaled
and checkpointed **as it finishes**, in whatever order they finish; the model
reads them in the order it asked (``runtime.actions.in_request_order``). A crash
in the middle leaves the finished calls recorded — never run again — and the
others requested with no outcome.

A call whose server could not be reached before it was sent (an MCP server down:
:class:`~runtime.errors.CallNotSent`) did not run: it is journaled ``tool.unsent``
— requested no more — and, once the batch's other calls are recorded, the run
stalls with one line naming the server. A resume sends it afresh.

With ``min_replicas`` on the run store's URL, a batch with a call that is not
idempotent starts only once the store's replicas acknowledged its ``tool.requested``
(:func:`runtime.fsm.journal_replicated`); if they do not in time, no call of it
starts: each is journaled ``tool.unsent`` and the run stalls saying why, for an
operator's resume once the replicas are back (store/replicas.py).

:func:`resolve` carries out :class:`runtime.fsm.Unresolved`, the calls a crash
or a timeout left with no outcome, each by its rule (runtime/probes.py): an
idempotent call runs again; a call whose tool has a probe is asked about
(``tool.probed``) — ``ran`` is its outcome, ``not_run`` runs it, anything else
parks; any other call parks the run, naming the call.

Every wait is bounded: a tool by ``tool_timeout_s`` (an idempotent one is tried
``TOOL_TIMEOUT_ATTEMPTS`` times; any other is left unknown, for its probe), a
probe by ``probe_timeout_s``. What follows a timeout, a probe's answer or a call
that stays unknown is runtime/actions.py's to say; this module carries it out.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.actions import (
    Park,
    Stall,
    after_probe,
    after_tool_timeout,
    park,
    probes_left,
    tool_attempts,
)
from runtime.errors import CallNotSent, NotReplicated
from runtime.fsm import (
    RunTool,
    Unresolved,
    journal_replicated,
    requested_event,
    tool_events,
    unknown_tool_outcome,
    unsent_event,
)
from runtime.models import ToolCall
from runtime.probes import Answer, Probed, Rule, ToolContext, idempotency_key, probed_event
from runtime.tools import ToolOutcome, ToolSpec, fitted
from runtime_io.tools import ask_probe, invoke
from tasks.threads import CallTimedOut, Started, bounded, start

if TYPE_CHECKING:
    from tasks.held_run import HeldRun


log = logging.getLogger("ratchet.turn")


def tool_context(held: HeldRun, call: ToolCall, attempt: int = 1) -> ToolContext:
    """The call's context: its key is the same on every attempt and every worker; its
    ``progress`` goes to the run's live stream, naming the call and this attempt."""
    run_id = held.state.run_id
    key = idempotency_key(run_id, held.state.usage.model_turns, call.id)
    live = held.ctx.live()
    if live is None:
        return ToolContext(run_id=run_id, call_id=call.id, idempotency_key=key)
    named: dict[str, Any] = {"kind": "tool.progress", "run": run_id, "call_id": call.id}
    named.update(name=call.name, at=held.state.seq, attempt=attempt)

    def report(message: str) -> None:
        live.put(run_id, {**named, "message": message})

    return ToolContext(run_id=run_id, call_id=call.id, idempotency_key=key, reporter=report)


@dataclass
class _Call:
    index: int
    call: ToolCall
    spec: ToolSpec
    attempt: int = 0
    started: Started[ToolOutcome] | None = None
    deadline: float = 0.0


@dataclass
class _Batch:
    held: HeldRun
    finished: queue.SimpleQueue[tuple[int, int]] = field(default_factory=queue.SimpleQueue)

    def launch(self, item: _Call) -> None:
        item.attempt += 1
        spec, call = item.spec, item.call
        context = tool_context(self.held, call, item.attempt)
        index, attempt, finished = item.index, item.attempt, self.finished

        def job() -> ToolOutcome:
            try:
                return invoke(spec, call.arguments, context)
            finally:
                finished.put((index, attempt))

        item.started = start(job, f"tool {call.name}")
        item.deadline = time.monotonic() + self.held.agent.spec.tool_timeout_s


def run_tools(held: HeldRun, action: RunTool) -> Stall | None:
    """Run the action's calls side by side; journal and checkpoint each outcome as it comes.

    A call that is not idempotent and outlives ``tool_timeout_s`` is left requested
    with no outcome (recorded in ``held.timed_out``): the next decision is then
    :class:`Unresolved`, which asks its probe or parks the run. The Stall to carry out
    if a call could not be sent (its ``tool.unsent`` goes before the stall).
    """
    model_calls = held.state.usage.model_turns
    held_back = _journal_requested(held, action)
    if held_back is not None:
        return held_back
    observers = held.ctx.observers
    if observers:
        observers.reached("tool.requested", model_calls)
    batch = _Batch(held)
    unsent: list[tuple[ToolCall, CallNotSent]] = []
    waiting: dict[int, _Call] = {}
    for index, call in enumerate(action.calls):
        spec = held.agent.tools.get(call.name)
        if spec is None:
            _record(held, call, unknown_tool_outcome(call, held.agent))
            continue
        item = waiting[index] = _Call(index, call, spec)
        batch.launch(item)
    while waiting:
        soonest = min(item.deadline for item in waiting.values())
        try:
            index, attempt = batch.finished.get(timeout=max(0.0, soonest - time.monotonic()))
        except queue.Empty:
            index, attempt = -1, 0
        item_or_none = waiting.get(index)
        if item_or_none is not None and item_or_none.attempt == attempt:
            item = waiting.pop(index)
            assert item.started is not None
            outcome = _outcome(item.started, item.call)
            if isinstance(outcome, CallNotSent):
                unsent.append((item.call, outcome))
                continue
            if observers:
                observers.reached("tool.completed", model_calls)
            _record(held, item.call, outcome)
            continue
        now = time.monotonic()
        for item in [i for i in waiting.values() if i.deadline <= now and not _done(i)]:
            if not _timed_out(held, batch, item):
                del waiting[item.index]
    return _not_sent(held, unsent)


def _journal_requested(held: HeldRun, action: RunTool) -> Stall | None:
    """Journal the action's calls as requested, but those that are already (a call run again
    since its outcome was unknown, or journaled with the model's response). The Stall to
    carry out instead of starting them if the run store's replicas did not confirm it."""
    state = held.state
    fresh = [c for c in action.calls if c.id not in state.running]
    early, held.requested_early = held.requested_early, frozenset()
    for call in action.calls:
        if call.id in state.running and call.id not in early:
            log.info(
                "run %s: running tool %s (call %s) again: its outcome was unknown and it may run "
                "again",
                state.run_id,
                call.name,
                call.id,
            )
    return _journal(held, fresh)


def _not_sent(held: HeldRun, unsent: list[tuple[ToolCall, CallNotSent]]) -> Stall | None:
    """The stall for calls that never reached their server, naming the first one's."""
    if not unsent:
        return None
    call, error = unsent[0]
    more = f" (and {len(unsent) - 1} more call(s) not sent)" if len(unsent) > 1 else ""
    reason = (
        f"tool `{call.name}` (call {call.id}) was not sent: {error}{more}; nothing ran — "
        f"start the server, then `ratchet runs resume {held.state.run_id}` sends it"
    )
    log.warning("run %s: %s", held.state.run_id, reason)
    return Stall(reason, tuple(unsent_event(c, str(e)) for c, e in unsent))


def _journal(held: HeldRun, calls: list[ToolCall]) -> Stall | None:
    """Journal ``calls`` as requested, before any starts; with a call that is not
    idempotent among them, confirmed by the run store's replicas (``min_replicas``). The
    Stall to carry out instead of starting them if the replicas did not confirm it."""
    if not calls:
        return None
    journal = [requested_event(call) for call in calls]
    if not journal_replicated(calls, held.agent):
        held.record(journal)
        return None
    shortfall = held.record_replicated(journal)
    return None if shortfall is None else _not_replicated(held, calls, shortfall)


def _not_replicated(held: HeldRun, calls: list[ToolCall], error: NotReplicated) -> Stall:
    """The stall for a batch whose journal entry too few replicas acknowledged: none of its
    calls started, so each is journaled unsent, and a resume requests it afresh — and waits
    for the replicas again."""
    log.warning("%s", error)
    if held.ctx.observers:
        held.ctx.observers.unreplicated(len(calls))
    why = "the run store's replicas did not acknowledge its journal entry in time"
    return Stall(str(error), tuple(unsent_event(call, why) for call in calls))


def _timed_out(held: HeldRun, batch: _Batch, item: _Call) -> bool:
    """``item`` outlived ``tool_timeout_s``: abandon it; True if it was started again."""
    assert item.started is not None
    timeout_s = held.agent.spec.tool_timeout_s
    try:
        item.started.result(0)  # abandons it: its thread is written off
    except CallTimedOut:
        pass
    log.warning(
        "run %s: %s (attempt %s of %s)",
        held.state.run_id,
        CallTimedOut(item.started.what, timeout_s),
        item.attempt,
        tool_attempts(item.spec.idempotent),
    )
    then = after_tool_timeout(item.call, item.spec.idempotent, item.attempt, timeout_s)
    if then == Rule.RERUN:
        batch.launch(item)
        return True
    if isinstance(then, ToolOutcome):
        _record(held, item.call, then)
    else:  # unknown: the next decision asks its probe, or parks
        held.timed_out[item.call.id] = held.timed_out.get(item.call.id, 0) + 1
    return False


def _done(item: _Call) -> bool:
    return item.started is not None and item.started.done()


def _outcome(started: Started[ToolOutcome], call: ToolCall) -> ToolOutcome | CallNotSent:
    try:
        return started.result(60.0)  # it has finished: its value is a moment away
    except CallNotSent as exc:
        return exc
    except Exception as exc:  # invoke turns a tool's own failures into outcomes already
        return ToolOutcome(False, f"`{call.name}` failed in the runtime: {type(exc).__name__}")


def _record(held: HeldRun, call: ToolCall, outcome: ToolOutcome) -> None:
    """Journal one call's outcome and checkpoint it: from here on it never runs again."""
    with held.recording:
        outcome = fitted(outcome, call.name, held.snapshot_room)
        held.checkpointed(tool_events(call, outcome))


def resolve(held: HeldRun, action: Unresolved) -> Park | Stall | None:
    """Probe or run again the calls cut short; the Park to carry out if one stays unknown
    (the Stall if a call run again could not be sent)."""
    again: list[ToolCall] = []
    stuck: list[tuple[ToolCall, Probed | None]] = []
    asked = False
    for call, rule in action.calls:
        spec = held.agent.tools.get(call.name)
        if rule == Rule.RERUN:
            again.append(call)
            continue
        if rule == Rule.PARK or spec is None:
            stuck.append((call, None))
            continue
        if not probes_left(held.timed_out.get(call.id, 0)):
            stuck.append((call, held.last_probed.get(call.id)))
            continue
        probed = _fitted(_probe(held, spec, call), call, held.snapshot_room)
        held.record([probed_event(call.id, call.name, probed)])
        asked = True
        held.last_probed[call.id] = probed
        log.info(
            "run %s: the probe of tool %s (call %s) answered %s",
            held.state.run_id,
            call.name,
            call.id,
            probed.answer.value,
        )
        then = after_probe(probed.answer)
        if then == Rule.RERUN:
            again.append(call)
        elif then == Rule.PARK:
            stuck.append((call, probed))
    if asked:
        held.checkpoint()
    if stuck:
        first = stuck[0][0]
        timed_out_s = held.agent.spec.tool_timeout_s if first.id in held.timed_out else None
        spec = held.agent.tools.get(first.name)
        server = spec.mcp.get("server") if spec is not None and spec.mcp else None
        return park(held.state.run_id, stuck, timed_out_s, server)
    if again:
        return run_tools(held, RunTool(again[0], tuple(again[1:])))
    return None


def _fitted(probed: Probed, call: ToolCall, room: Callable[[int], int]) -> Probed:
    """A probe's ``ran``, with its result as an error result if it does not fit the snapshot."""
    if probed.answer != Answer.RAN or probed.detail:
        return probed
    outcome = fitted(ToolOutcome(True, probed.result), call.name, room)
    return probed if outcome.ok else Probed(Answer.RAN, detail=str(outcome.result))


def _probe(held: HeldRun, spec: ToolSpec, call: ToolCall) -> Probed:
    timeout_s = held.agent.spec.probe_timeout_s
    context = tool_context(held, call)
    try:
        return bounded(
            lambda: ask_probe(spec, call.arguments, context), timeout_s, f"probe of {call.name}"
        )
    except CallTimedOut:
        return Probed(Answer.TIMED_OUT, detail=f"no answer within {timeout_s:g} s")
    except Exception as exc:  # ask_probe catches the probe's own; this is the runtime's
        return Probed(Answer.FAILED, detail=type(exc).__name__)
