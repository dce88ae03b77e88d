"""What a run does next, and the rules that end a step that went wrong: pure, no I/O.

:func:`runtime.fsm.decide` returns one :data:`Action`; ``tasks/turn.py`` carries
it out and records what happened. A step that fails on the way (the provider is
down, a tool hangs, a probe cannot tell) asks a function here what follows, so
every rule that decides a run's fate is in ``runtime/`` and the tasks only do
what they are told:

- :func:`model_failed` — a provider error stalls the run (retryable: an
  operator resumes it once the provider is back) or fails it;
- :func:`after_model_timeout` — a model call that outlives its timeout is a counted
  attempt, and the next decision asks again (within ``max_turns``);
- :func:`after_store_failure` — a checkpoint the stores refuse ends the turn and
  stalls the run for a resume;
- :func:`binding_stall` — the agent file no longer has the binding the run
  started with: the run stalls, naming what changed;
- :func:`after_tool_timeout` — an idempotent tool is tried again
  (:data:`TOOL_TIMEOUT_ATTEMPTS` in all) then fails; any other is left unknown;
- :func:`after_probe` and :func:`park` — a call cut short is run again,
  settled, or parks the run for an operator;
- :class:`TurnOutcome` — how a turn ended, the label of ``ratchet_turns_total``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import repeat
from operator import attrgetter
from typing import Any, NamedTuple

from runtime.agent import Agent, describe_binding_change
from runtime.errors import BindingChanged, SnapshotFailed
from runtime.models import Message, RunState, RunStatus, ToolCall
from runtime.probes import Answer, Probed, Rule, park_cause
from runtime.provider import ModelRequest
from runtime.tools import ToolOutcome, error_text

Items = tuple[tuple[str, dict[str, Any]], ...]
"""Events to record, as (type, data)."""


# --- actions ----------------------------------------------------------------


@dataclass(frozen=True)
class CallModel:
    """Call the model on the run's transcript, as the state holds it.

    A turn decides several times (and again at each checkpoint, to see whether it is
    the turn's last) but calls the model at most once, so deciding must not cost the
    transcript's length: the :meth:`request` the provider reads is built only when the
    model is called."""

    transcript: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]
    """The agent's tool declarations."""
    model_call: int
    """Index of this model call among the run's responses, 0-based: 0 for the first."""

    def request(self, known: RequestOrder | None = None) -> ModelRequest:
        """What the provider is asked: the messages :func:`in_request_order`, ordering only
        what follows ``known`` (an earlier model call's order, :func:`extend_request_order`)."""
        order = extend_request_order(self.transcript, known)
        return ModelRequest(messages=order.messages, tools=self.tools, model_call=self.model_call)


@dataclass(frozen=True)
class RequestOrder:
    """A transcript and its messages :func:`in_request_order`, for a later model call of the
    run to extend (:func:`extend_request_order`) instead of ordering it all again."""

    transcript: tuple[Message, ...]
    messages: tuple[Message, ...]


def extend_request_order(
    transcript: tuple[Message, ...], known: RequestOrder | None
) -> RequestOrder:
    """``transcript`` in request order: when it is ``known.transcript`` followed by a response
    (an assistant message), the results before that response are all in, so their order
    stands and only the messages from the response on are ordered. Anything else (no
    ``known``, another transcript) is ordered whole: the same order, at the full cost."""
    if known is not None:
        n = len(known.transcript)
        # Tuples compare items by identity first: a transcript grown by the fold
        # (`transcript + (message,)`) shares its messages, so this is a pointer walk in C.
        if len(transcript) > n and transcript[n].role == "assistant":
            if transcript[:n] == known.transcript:
                return RequestOrder(transcript, known.messages + in_request_order(transcript[n:]))
        elif transcript == known.transcript:
            return known
    return RequestOrder(transcript, in_request_order(transcript))


def in_request_order(transcript: tuple[Message, ...]) -> tuple[Message, ...]:
    """The transcript as the model reads it: each response's tool results in the order it
    asked for the calls. Parallel calls are journaled (and folded) as they finish.

    Asked at every model call of a transcript that only grows, so its cost in the
    transcript's length is kept to one pass in C over the roles: only runs of two or
    more results can be out of order, and only those are sorted."""
    roles = "".join(map(_ROLE_LETTERS.get, map(_role, transcript), repeat("-")))
    ordered = list(transcript)
    for results in _RESULTS.finditer(roles):
        start, end = results.span()
        # The response that asked for them: the last assistant message before them.
        asked = roles.rfind("a", 0, start)
        calls = transcript[asked].tool_calls if asked >= 0 else ()
        rank = {c.id: i for i, c in enumerate(calls)}
        ordered[start:end] = sorted(
            ordered[start:end], key=lambda m: rank.get(m.tool_call_id or "", len(rank))
        )
    return tuple(ordered)


_ROLE_LETTERS = {"tool": "t", "assistant": "a"}
"""A transcript's roles spelt one letter each (``-`` for any other) for :data:`_RESULTS`."""
_RESULTS = re.compile("t{2,}")
_role = attrgetter("role")


@dataclass(frozen=True)
class RunTool:
    """Run ``call``, and ``also`` at the same time: later calls of the same model response."""

    call: ToolCall
    also: tuple[ToolCall, ...] = ()

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return (self.call, *self.also)


@dataclass(frozen=True)
class Unresolved:
    """Calls journaled as requested with no outcome (a crash or a timeout cut them short),
    each with its rule (runtime/probes.py): probe them, park on the first that stays unknown,
    run again the ones that may run again."""

    calls: tuple[tuple[ToolCall, Rule], ...]


@dataclass(frozen=True)
class Suspend:
    reason: RunStatus
    call: ToolCall
    prompt: str


@dataclass(frozen=True)
class StartChild:
    """Start (or find) the child run of a `run_child` call, then wait for it."""

    call: ToolCall
    child_id: str


@dataclass(frozen=True)
class RefuseCall:
    """A call the runtime answers with an error without running anything (bad `wait`)."""

    call: ToolCall
    error: str


@dataclass(frozen=True)
class Fail:
    reason: str
    budget: str | None = None
    """The budget that ran out, when one did: an operator may raise it (`runs budget`)."""
    preceded_by: Items = ()
    """Events recorded with ``run.failed``, before it (the ``model.failed`` that caused it)."""


@dataclass(frozen=True)
class Stall:
    """Stop the run as ``stalled``: nothing about it is wrong, an operator resumes it."""

    reason: str
    preceded_by: Items = ()
    """Events recorded with ``run.stalled``, before it."""


@dataclass(frozen=True)
class CheckBinding:
    """The agent file's binding differs from the run's: the run stalls (:func:`binding_stall`),
    once the turn has read the binding the run was created with."""


@dataclass(frozen=True)
class Park:
    """Park the run as ``needs_reconciliation``: a call's outcome stays unknown."""

    data: dict[str, Any]
    """The ``run.parked`` event's data (:func:`park`)."""


@dataclass(frozen=True)
class Idle:
    """Nothing for a worker to do: the run is suspended, parked or finished."""

    why: str


Action = (
    CallModel
    | RunTool
    | Unresolved
    | StartChild
    | RefuseCall
    | Suspend
    | Fail
    | Stall
    | CheckBinding
    | Park
    | Idle
)


# --- how a turn ends ---------------------------------------------------------


class TurnOutcome(StrEnum):
    """How a turn task ended: its return value and the ``outcome`` label of
    ``ratchet_turns_total``."""

    NEXT = "next"
    """The next model call is due: the next turn is chained."""
    SUSPENDED = "suspended"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PARKED = "parked"
    STALLED = "stalled"
    DEAD_LETTERED = "dead_lettered"
    IDLE = "idle"
    """The run needed no worker when the turn read it (suspended, parked, finished)."""
    LEASED = "leased"
    """Another worker holds the lease: this delivery is a duplicate."""
    STALE = "stale"
    """The run is not at the seq the message expects: a late or duplicate message."""
    MISSING = "missing"
    FENCED = "fenced"
    """The lease was lost mid-turn: another worker moved the run on."""
    REFUSED = "refused"
    """A resume was refused (runtime/recovery.py says why)."""

    @classmethod
    def of(cls, status: RunStatus) -> TurnOutcome:
        """The outcome of a turn that left the run in ``status``."""
        if status.is_live:
            return cls.NEXT
        if status.is_suspended:
            return cls.SUSPENDED
        if status == RunStatus.NEEDS_RECONCILIATION:
            return cls.PARKED
        return cls(status.value)


class Advanced(NamedTuple):
    """How one turn left the run (``tasks.turn.advance``): what the task does next."""

    outcome: TurnOutcome
    seq: int
    """The run's seq afterwards (-1 when the run was not read)."""
    turns: int
    """Model turns the run has had."""
    countdown_s: float = 0.0
    """``next`` after waiting on a limit (tasks/limits.py): chain the turn this much later."""
    priority: int | None = None
    """The broker priority of the next turn (runs under way before new ones)."""
    queued: bool = False
    """``next``, and the next turn is already on the broker: it went with the checkpoint."""


# --- rules for steps that went wrong -------------------------------------------


def model_failed(run_id: str, model_calls: int, error: str, retryable: bool) -> Stall | Fail:
    """A provider error after its own retries: a retryable one (the provider is down for
    longer than they cover) stalls the run for a resume, since nothing about the run is
    wrong; any other fails it. ``model_calls``: the run's model calls, this one included."""
    error = error_text(error)  # a provider's error may quote anything its server sent
    what = f"model call for turn {model_calls} failed: {error}"
    failed: Items = (("model.failed", {"turn": model_calls, "error": error}),)
    if retryable:
        reason = f"{what}; once the provider is back, `ratchet runs resume {run_id}`"
        return Stall(reason, failed)
    return Fail(what, preceded_by=failed)


def after_model_timeout(model_calls: int, error: str) -> Items:
    """What a model call that outlived ``model_timeout_s`` leaves: a failed attempt, counted
    (``model.failed`` with ``timeout``), and nothing worse. The run neither stalls nor fails
    on it: the next decision calls the model again, as a new ``model.requested``, and the
    turn budget (``max_turns``) ends a run whose calls keep timing out."""
    return (("model.failed", {"turn": model_calls, "error": error, "timeout": True}),)


def after_store_failure(run_id: str, seq: int, problem: str) -> tuple[SnapshotFailed, Stall]:
    """A checkpoint at ``seq`` the stores refused during a turn (fail-stop): the turn ends
    raising the SnapshotFailed, and the run stalls saying so, for a resume once the stores
    take writes again, since nothing about the run itself is wrong."""
    error = SnapshotFailed(run_id, seq, problem)
    return error, Stall(str(error))


def binding_stall(state: RunState, agent: Agent, created: dict[str, Any] | None) -> Stall:
    """The run stalls on an agent file whose binding changed since ``created`` (the binding
    document the run was created with), naming what changed."""
    changed = describe_binding_change(created, agent.binding_document) if created else "binding"
    return Stall(str(BindingChanged(state.run_id, agent.name, changed)))


TOOL_TIMEOUT_ATTEMPTS = 3
"""Tries in all for an idempotent tool that times out, before its call fails.

A tool that is not idempotent gets one try per turn; when its probe says it did
not run, it is tried again, as many times in all."""


def tool_attempts(idempotent: bool) -> int:
    """Tries a tool gets within one turn when it times out."""
    return TOOL_TIMEOUT_ATTEMPTS if idempotent else 1


def after_tool_timeout(
    call: ToolCall, idempotent: bool, attempt: int, timeout_s: float
) -> Rule | ToolOutcome | None:
    """What follows the ``attempt``-th try of ``call`` outliving ``timeout_s``: RERUN (try
    again now), the call's failure (an idempotent tool out of tries), or None: its outcome
    is unknown, and the next decision asks its probe or parks the run."""
    if attempt < tool_attempts(idempotent):
        return Rule.RERUN
    if idempotent:
        text = f"`{call.name}` did not return within {timeout_s:g} s, {attempt} times"
        return ToolOutcome(False, text)
    return None


def after_probe(answer: Answer) -> Rule | None:
    """What a probe's answer leaves for its call: None when ``ran`` settled it, RERUN when it
    did not run, PARK when it cannot tell."""
    if answer == Answer.RAN:
        return None
    return Rule.RERUN if answer == Answer.NOT_RUN else Rule.PARK


def probes_left(timed_out: int) -> bool:
    """Whether a call that timed out ``timed_out`` times this turn may be probed again."""
    return timed_out < TOOL_TIMEOUT_ATTEMPTS


def park(
    run_id: str,
    stuck: Sequence[tuple[ToolCall, Probed | None]],
    timed_out_s: float | None,
    server: str | None = None,
) -> Park:
    """Park on the first call whose outcome stays unknown, naming it and the rest.

    ``timed_out_s``: the tool timeout, when that first call timed out this turn;
    ``server``: the MCP server whose tool it is, if it is one's."""
    call, probed = stuck[0]
    of = f" of MCP server `{server}`" if server else ""
    reason = (
        f"tool `{call.name}`{of} (call {call.id}) {park_cause(probed, timed_out_s)}; check its "
        f"effect, then `ratchet runs reconcile {run_id} {call.id}` with --result, --retry or --fail"
    )
    others = [c.id for c, _ in stuck[1:]]
    if others:
        reason += f"; calls {', '.join(others)} are unknown too: reconcile each"
    data: dict[str, Any] = {
        "reason": reason,
        "call_id": call.id,
        "tool": call.name,
        "arguments": call.arguments,
    }
    if probed is not None:
        data["probe"] = probed.answer.value
    if others:
        data["also_unknown"] = others
    if server:
        data["server"] = server
    return Park(data)
