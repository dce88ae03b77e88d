"""Continuations: a person's answer to a suspended run, checked before it is applied. Pure.

A continuation answers exactly one suspension of one run:

- ``input`` — 1–8192 bytes of UTF-8, not blank — answers ``needs_user_input``
  and ``blocked``; the model reads it as the control tool's result;
- ``approve`` or ``deny`` (with a reason) answers ``awaiting_approval``; a
  denied tool never runs, the model is told it was denied.

Every continuation carries a ``continuation_id``. The same continuation
delivered twice is applied once (:func:`find_applied` finds it among the
run's ``run.continued`` events); a different answer to a suspension already
answered, an answer to a run that is not suspended, or one naming another
suspension (``suspension_seq``) is refused. An answer must name its suspension
(``suspension_seq``) or itself (``continuation_id``): one that names neither is
refused (:func:`check_pinned`) unless a setting allows it. Nothing here does I/O:
``tasks/control.py`` reads the run, calls these checks, and records the event.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.agent import Agent, describe_binding_change
from runtime.errors import (
    BindingChanged,
    InvalidContinuation,
    MalformedContinuation,
    RunRefused,
    SuspensionAlreadyAnswered,
    SuspensionMismatch,
)
from runtime.fsm import Fail, apply, decide
from runtime.models import Event, RunState, RunStatus, Strict, Suspension

MAX_INPUT_BYTES = 8192
"""The most a continuation's input (or a denial's reason) may hold, in UTF-8 bytes."""

CONTINUATION_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")

MESSAGE_KEYS = frozenset(
    {"run_id", "continuation_id", "input", "approve", "deny", "suspension_seq"}
)
"""The keys a plain-JSON continuation message may have; any other key is refused."""


class Continuation(Strict):
    """One answer to one suspension; build it with :func:`make_continuation`."""

    run_id: str
    continuation_id: str
    """Names this answer: a second delivery with the same id is a duplicate, applied once."""
    input: str | None = None
    """The answer to `request_user_input` or `blocked`."""
    approve: bool = False
    """Let the tool awaiting approval run."""
    deny: str | None = None
    """Refuse the tool awaiting approval, with the reason the model is told."""
    suspension_seq: int | None = None
    """The suspension this answers (seq of its `run.suspended`); ``None``: the current one."""

    @property
    def answer(self) -> dict[str, Any]:
        """What the `run.continued` event records besides its id and the time suspended."""
        if self.input is not None:
            return {"input": self.input}
        if self.approve:
            return {"approved": True}
        return {"approved": False, "reason": self.deny}


def check_pinned(
    run_id: str,
    continuation_id: object,
    suspension_seq: object,
    *,
    allow_unpinned: bool = False,
) -> None:
    """Refuse an answer that says neither which suspension it answers nor its own id.

    Such an answer applies to whichever suspension is current when it arrives: a
    client retrying an approval after the run has moved on to its next approval
    would approve that one too. ``allow_unpinned`` (the setting
    ``RATCHET_ALLOW_UNPINNED_CONTINUATIONS``) accepts it anyway.
    """
    if allow_unpinned or continuation_id is not None or suspension_seq is not None:
        return
    raise InvalidContinuation(
        run_id,
        "the answer names neither a continuation_id nor a suspension_seq, so a late retry "
        "could answer a later question; send suspension_seq (the seq `ratchet runs show` "
        "prints for the suspension) or a continuation_id of your own "
        "(or set RATCHET_ALLOW_UNPINNED_CONTINUATIONS=1 to accept such answers)",
    )


def check_text(run_id: str, what: str, value: object) -> str:
    """``value`` as text if it is 1–8192 bytes of valid UTF-8 and not blank."""
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidContinuation(run_id, f"{what} is not valid UTF-8 ({exc.reason})") from exc
    if not isinstance(value, str):
        raise InvalidContinuation(run_id, f"{what} must be text, not {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidContinuation(run_id, f"{what} is not valid UTF-8 ({exc.reason})") from exc
    if size == 0:
        raise InvalidContinuation(run_id, f"{what} is empty; send 1–{MAX_INPUT_BYTES} bytes")
    if size > MAX_INPUT_BYTES:
        raise InvalidContinuation(
            run_id, f"{what} is {size} bytes, over the {MAX_INPUT_BYTES}-byte limit"
        )
    if not value.strip():
        raise InvalidContinuation(run_id, f"{what} is blank; say something the agent can use")
    return value


def make_continuation(
    run_id: str,
    continuation_id: str,
    *,
    input: object = None,
    approve: object = None,
    deny: object = None,
    suspension_seq: object = None,
) -> Continuation:
    """Check the form of an answer: exactly one of input, approve, deny; valid text and id.

    Raises InvalidContinuation naming the run and the problem.
    """
    answers = (("input", input), ("approve", approve), ("deny", deny))
    given = [name for name, value in answers if value is not None]
    if len(given) != 1:
        problem = "nothing was given" if not given else "both " + " and ".join(given) + " given"
        raise InvalidContinuation(
            run_id,
            f"{problem}; send exactly one of --input TEXT (a question or blocker), "
            "--approve or --deny REASON (a tool awaiting approval)",
        )
    if approve is not None and approve is not True:
        raise InvalidContinuation(run_id, "approve must be true; to refuse the tool, deny it")
    if not isinstance(continuation_id, str) or not CONTINUATION_ID_PATTERN.fullmatch(
        continuation_id
    ):
        raise InvalidContinuation(
            run_id,
            f"continuation id {str(continuation_id)[:80]!r} is not valid: use 1-128 letters, "
            "digits, `-`, `_`, `.` or `:`",
        )
    if suspension_seq is not None and (
        not isinstance(suspension_seq, int) or isinstance(suspension_seq, bool)
    ):
        raise InvalidContinuation(run_id, "suspension_seq must be an integer")
    return Continuation(
        run_id=run_id,
        continuation_id=continuation_id,
        input=check_text(run_id, "input", input) if given == ["input"] else None,
        approve=approve is True,
        deny=check_text(run_id, "the denial's reason", deny) if given == ["deny"] else None,
        suspension_seq=suspension_seq,
    )


def parse_message(body: object) -> dict[str, Any]:
    """The fields of a plain-JSON continuation message, shape-checked.

    The contents (text sizes, the run's status) are checked when it is applied;
    here only what makes a message unusable: not an object, a missing ``run_id``,
    an unknown key, a value of the wrong type. Raises MalformedContinuation.
    """
    if not isinstance(body, dict):
        raise MalformedContinuation(f"the body is a JSON {_json_kind(body)}, not an object")
    unknown = sorted(str(k) for k in body if k not in MESSAGE_KEYS)
    if unknown:
        # repr, cut short: a key is the sender's text, and it ends up in a log line.
        shown = ", ".join(repr(k)[:40] for k in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise MalformedContinuation(f"unknown key(s) {shown}{more}")
    if "run_id" not in body:
        raise MalformedContinuation("`run_id` is missing")
    expected: dict[str, tuple[type, ...]] = {
        "run_id": (str,),
        "continuation_id": (str,),
        "input": (str,),
        "approve": (bool,),
        "deny": (str,),
        "suspension_seq": (int,),
    }
    for key, value in body.items():
        if value is None and key != "run_id":
            continue
        bad_int = key == "suspension_seq" and isinstance(value, bool)
        if not isinstance(value, expected[key]) or bad_int:
            want = expected[key][0].__name__
            raise MalformedContinuation(f"`{key}` must be {want}, not {_json_kind(value)}")
    return {k: v for k, v in body.items() if v is not None}


def _json_kind(value: object) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def find_applied(events: list[Event], continuation: Continuation) -> Event | None:
    """The `run.continued` event this continuation already produced, if any.

    The same id with a different answer is not a duplicate but a conflict:
    refused, because applying either would silently drop the other.
    """
    for event in events:
        if event.type != "run.continued":
            continue
        if event.data.get("continuation_id") != continuation.continuation_id:
            continue
        recorded = {k: event.data.get(k) for k in continuation.answer}
        if recorded != continuation.answer:
            raise InvalidContinuation(
                continuation.run_id,
                f"continuation id {continuation.continuation_id} was already used at seq "
                f"{event.seq} with a different answer; send a new answer with a new id",
            )
        return event
    return None


def _answered_by(events: list[Event], suspension_seq: int) -> str | None:
    """The continuation id that answered the suspension recorded at ``suspension_seq``."""
    after = False
    for event in events:
        if event.seq == suspension_seq:
            after = event.type == "run.suspended"
        elif after and event.type == "run.continued":
            return str(event.data.get("continuation_id"))
        elif after and event.type == "run.suspended":
            return None
    return None


def _last_suspension_seq(events: list[Event]) -> int | None:
    return next((e.seq for e in reversed(events) if e.type == "run.suspended"), None)


def check_suspended(state: RunState, events: list[Event], continuation: Continuation) -> Suspension:
    """The suspension this continuation answers; refused if it is not the current one."""
    asked = continuation.suspension_seq
    suspension = state.suspension
    if suspension is None or not state.status.is_suspended:
        seq = asked if asked is not None else _last_suspension_seq(events)
        by = _answered_by(events, seq) if seq is not None else None
        if by is not None and not state.status.is_terminal:
            raise SuspensionAlreadyAnswered(state.run_id, state.status.value, seq or 0, by)
        raise RunRefused(
            state.run_id,
            state.status.value,
            "only a suspended run (needs_user_input, blocked, awaiting_approval, waiting) can be "
            f"continued; see `ratchet runs show {state.run_id}`",
        )
    if asked is not None and asked != suspension.seq:
        by = _answered_by(events, asked)
        if by is not None:
            raise SuspensionAlreadyAnswered(state.run_id, state.status.value, asked, by)
        raise SuspensionMismatch(state.run_id, state.status.value, asked, suspension.seq)
    approval = suspension.reason == RunStatus.AWAITING_APPROVAL
    if approval and continuation.input is not None:
        raise RunRefused(
            state.run_id,
            state.status.value,
            f"tool `{suspension.tool}` awaits approval, not an input; "
            f"answer with --approve or --deny REASON",
        )
    if not approval and continuation.input is None:
        raise RunRefused(
            state.run_id,
            state.status.value,
            f"the run asks {suspension.prompt!r}; answer with --input TEXT, "
            "approve and deny are for tools awaiting approval",
        )
    return suspension


def check_binding(state: RunState, agent: Agent, created_document: dict[str, Any] | None) -> None:
    """Refuse to continue against an agent that changed since the run started."""
    if agent.binding != state.binding:
        changed = (
            describe_binding_change(created_document, agent.binding_document)
            if created_document
            else "binding"
        )
        raise BindingChanged(state.run_id, agent.name, changed)


def suspended_for_ms(suspension: Suspension, now_ms: int) -> int:
    return max(0, now_ms - suspension.since_ms)


MAX_CANCEL_REASON_CHARS = 2000


def cancel_reason(reason: str | None) -> str:
    """A cancel's reason as recorded: whitespace runs made one space, cut to
    :data:`MAX_CANCEL_REASON_CHARS`, and a default when none is left."""
    return " ".join((reason or "").split())[:MAX_CANCEL_REASON_CHARS] or "cancelled by an operator"


def cancelled_event_data(
    status_before: RunStatus, suspension: Suspension | None, reason: str, now_ms: int
) -> dict[str, Any]:
    """``run.cancelled``'s data: the reason, the status it ended, and, for a suspended run,
    how long this suspension lasted (counted as suspended, not running: the fold, :mod:`runtime.fsm`, adds it)."""
    data: dict[str, Any] = {"reason": reason, "status_before": status_before.value}
    if suspension is not None and status_before.is_suspended:
        data["suspended_ms"] = max(0, now_ms - suspension.since_ms)
    return data


def max_suspended_s_of(first_events: list[Event]) -> int | None:
    """The run's own ``max_suspended_s``, from the binding its ``run.created`` recorded
    (immune to later edits of the agent file); ``first_events`` starts with that event."""
    document = (first_events[0].data.get("binding_document") or {}) if first_events else {}
    value = document.get("max_suspended_s")
    return int(value) if value is not None else None


def expires_at_ms(suspension: Suspension, max_suspended_s: int | None) -> int | None:
    """The first instant the run has waited longer than ``max_suspended_s``; None: never.

    The sweeper finds the run at this time through the due index
    (:func:`runtime.recovery.sweep_due_ms`), and :func:`expiry_reason` agrees with it.
    """
    if max_suspended_s is None or suspension.reason == RunStatus.WAITING:
        # max_suspended_s bounds a wait for a person; a timer's length is its own.
        return None
    return suspension.since_ms + max_suspended_s * 1000 + 1


def expiry_is_due(status: RunStatus, due_at_ms: int | None, now_ms: int) -> bool:
    """A run in ``status``, due at ``due_at_ms`` in the run store's due index, waits for a
    person and its expiry (:func:`expires_at_ms`, its due time then) has come.

    The sweeper's cheap look, from the run's record alone; the expiry itself checks again
    against the state (:func:`expiry_reason`) under the run's lease.
    """
    return (
        status.is_suspended
        and status != RunStatus.WAITING
        and due_at_ms is not None
        and due_at_ms <= now_ms
    )


def expiry_of(state: RunState, max_suspended_s: int | None, now_ms: int) -> str | None:
    """Why ``state`` expires now (:func:`expiry_reason`), or None: it is not waiting for an
    answer, or may go on waiting."""
    if state.suspension is None or not state.status.is_suspended:
        return None
    return expiry_reason(state.suspension, max_suspended_s, now_ms)


def expired_event_data(suspension: Suspension, reason: str, now_ms: int) -> dict[str, Any]:
    """``run.expired``'s data: why, the suspension it ends, and how long that lasted."""
    return {
        "reason": reason,
        "suspension_seq": suspension.seq,
        "suspended_ms": suspended_for_ms(suspension, now_ms),
    }


def expiry_reason(suspension: Suspension, max_suspended_s: int | None, now_ms: int) -> str | None:
    """Why the run expires instead of continuing, or None while it may still wait."""
    expires_at = expires_at_ms(suspension, max_suspended_s)
    if expires_at is None or now_ms < expires_at:
        return None
    waited_ms = suspended_for_ms(suspension, now_ms)
    return (
        f"suspended ({suspension.reason.value}) for {waited_ms / 1000:g}s waiting for an "
        f"answer, over the agent's max_suspended_s of {max_suspended_s}; start a new run"
    )


def continued_event_data(
    state: RunState,
    agent: Agent,
    events: list[Event],
    continuation: Continuation,
    now_ms: int,
) -> dict[str, Any]:
    """Check a continuation against the run and return its `run.continued` event data.

    The caller has already looked for a duplicate (:func:`find_applied`) and for
    expiry (:func:`expiry_reason`). Raises RunRefused (and its subclasses) when
    the run is not waiting for this answer, BindingChanged when the agent
    changed, RunRefused when a budget or the deadline would not allow the next
    step — the deadline counted without the time suspended.
    """
    suspension = check_suspended(state, events, continuation)
    if suspension.reason == RunStatus.WAITING and not agent.spec.wake_on_input:
        raise RunRefused(
            state.run_id,
            state.status.value,
            f"it is in a {suspension.prompt!r}, and its agent does not take answers during a "
            "wait (`wake_on_input = true` in the agent file lets it); cancel it, or let it wake",
        )
    created = events[0].data.get("binding_document") if events else None
    check_binding(state, agent, created)
    data = {
        "continuation_id": continuation.continuation_id,
        **continuation.answer,
        "suspended_ms": suspended_for_ms(suspension, now_ms),
    }
    # The next step after this answer must be affordable, else the answer is wasted.
    after = apply(state, Event(seq=state.seq + 1, type="run.continued", at_ms=now_ms, data=data))
    action = decide(after, agent, now_ms)
    if isinstance(action, Fail):
        raise RunRefused(
            state.run_id,
            state.status.value,
            f"continuing would not allow another step: {action.reason}",
        )
    return data
