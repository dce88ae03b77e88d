"""May a stopped run be resumed? The classification, pure: data in, verdict out.

Resume (by an operator or the crash sweeper) classifies the run first and
refuses every class but the first, saying why and what to do instead:

==========================  ==================================================
``resume-eligible``         live, stalled or dead-lettered, checkpoint usable,
                            same binding, deadline and budgets not exhausted
``reconciliation-required`` parked: a non-idempotent tool's outcome is unknown
``restart-required``        checkpoint missing (no snapshot, events cannot
                            rebuild it), binding changed, deadline passed or a
                            budget exhausted
``complete``                completed, failed or cancelled
``suspended``               waits for a person's continuation
==========================  ==================================================

**Counting recoveries.** The sweeper resumes a run whose lease expired and
whose next step is overdue. A run can be overdue without having crashed: its
chained turn may simply wait in a long queue. So a recovery counts towards
``max_recovery_attempts`` only when it is the sweeper's, and only until the
run makes progress: the counter is the number of sweeper ``run.resumed``
events since the last event that moved the run forward (a model response, a
tool outcome, a reconciliation, a continuation) or an operator's resume. A
backlogged run makes progress between sweeps and never accumulates; a run
that crashes its worker at the same step every time does, and is
dead-lettered. (The sweeper also passes the seq it saw, and the resume is a
no-op if the run has moved since — so a resume queued behind the run's own
chained turn does not count at all.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from runtime.children import awaiting_delivery
from runtime.continuation import expires_at_ms, expiry_is_due
from runtime.errors import BindingChanged, BudgetError, RatchetError, RunRefused

# Budget rules live in the FSM; the classification asks the same questions.
from runtime.fsm import check_model_budgets, check_tool_budgets
from runtime.models import Event, RunState, RunStatus, Suspension
from runtime.timers import WAIT, due_at_ms

SWEEPER = "sweeper"
OPERATOR = "operator"

PROGRESS_EVENTS = frozenset(
    {"model.responded", "tool.completed", "tool.failed", "tool.reconciled", "run.continued"}
)
"""Events that move a run forward: after one, the sweeper's recovery count starts again."""


class Disposition(StrEnum):
    RESUME_ELIGIBLE = "resume-eligible"
    RECONCILIATION_REQUIRED = "reconciliation-required"
    RESTART_REQUIRED = "restart-required"
    COMPLETE = "complete"
    SUSPENDED = "suspended"


@dataclass(frozen=True)
class Verdict:
    disposition: Disposition
    refusal: RatchetError | None = None
    """Why resume is refused and the next step (None when eligible)."""

    @property
    def eligible(self) -> bool:
        return self.disposition == Disposition.RESUME_ELIGIBLE

    @property
    def reason(self) -> str:
        return str(self.refusal) if self.refusal is not None else "resume-eligible"


def _refused(disposition: Disposition, run_id: str, status: str, reason: str) -> Verdict:
    return Verdict(disposition, RunRefused(run_id, status, reason))


def classify(
    run_id: str,
    state: RunState | None,
    *,
    agent_binding: str | None,
    binding_change: str,
    now_ms: int,
    agent_problem: str | None = None,
) -> Verdict:
    """Classify a run for resume.

    ``state`` is the run rebuilt from its snapshot and events (``None``: neither
    can give it). ``agent_binding`` is the binding of the agent file as it is now
    (``None`` if it cannot be loaded, and ``agent_problem`` then says why and what to
    do); ``binding_change`` names what differs.
    """
    if state is None:
        return _refused(
            Disposition.RESTART_REQUIRED,
            run_id,
            "without a checkpoint",
            "it has no snapshot and its events cannot rebuild one; "
            "start the run again with `ratchet runs start`",
        )
    status = state.status.value
    if state.status.is_terminal:
        return _refused(
            Disposition.COMPLETE,
            run_id,
            status,
            f"there is nothing to resume; its events remain (`ratchet runs events {run_id}`) "
            "— start a new run to do it again",
        )
    if state.status.is_suspended:
        return _refused(
            Disposition.SUSPENDED,
            run_id,
            status,
            f"it waits for a person, not a worker; answer it with `ratchet runs continue {run_id}`",
        )
    if state.status == RunStatus.NEEDS_RECONCILIATION:
        return _refused(
            Disposition.RECONCILIATION_REQUIRED,
            run_id,
            status,
            "a tool that is not idempotent was in flight when it stopped "
            f"(`ratchet runs show {run_id}` shows the call); check the call's effect, then "
            f"`ratchet runs reconcile {run_id} {state.in_flight or 'CALL_ID'}` "
            "with --result JSON, --retry or --fail REASON",
        )
    if agent_binding is None:
        return _refused(
            Disposition.RESTART_REQUIRED,
            run_id,
            status,
            agent_problem
            or f"its agent file {state.agent_file} cannot be loaded; restore it and resume, "
            "or start the run again",
        )
    if agent_binding != state.binding:
        return Verdict(
            Disposition.RESTART_REQUIRED, BindingChanged(run_id, state.agent, binding_change)
        )
    problem = budget_problem(state, now_ms)
    if problem is not None:
        return _refused(Disposition.RESTART_REQUIRED, run_id, status, str(problem))
    return Verdict(Disposition.RESUME_ELIGIBLE)


def budget_problem(state: RunState, now_ms: int) -> BudgetError | None:
    """The budget or deadline that forbids the run's next step, if one does."""
    try:
        if state.pending and state.suspension is None:
            check_tool_budgets(state, now_ms)
        else:
            check_model_budgets(state, now_ms)
    except BudgetError as exc:
        return exc
    return None


def consecutive_recoveries(events: Sequence[Event]) -> list[Event]:
    """The sweeper's ``run.resumed`` events since the run last made progress, oldest first."""
    found: list[Event] = []
    for event in reversed(events):
        if event.type in PROGRESS_EVENTS or _probe_found_it(event):
            break
        if event.type == "run.resumed":
            if event.data.get("by") != SWEEPER:
                break
            found.append(event)
    found.reverse()
    return found


def _probe_found_it(event: Event) -> bool:
    """A probe's ``ran`` is the call's outcome: progress. Its other answers are not — a worker
    that dies running a call its probe says did not run must still be dead-lettered."""
    return event.type == "tool.probed" and event.data.get("answer") == "ran"


def dead_letter_data(run_id: str, history: Sequence[Event], limit: int) -> dict[str, Any]:
    """The data of a `run.dead_lettered` event: why, and every recovery that did not help."""
    return {
        "reason": (
            f"run {run_id} was recovered {len(history)} times in a row without making "
            f"progress (limit RATCHET_MAX_RECOVERY_ATTEMPTS={limit}): a worker probably dies "
            f"at the same step each time; read `ratchet runs events {run_id}` and the worker "
            f"logs, fix the cause, then `ratchet runs resume {run_id}`"
        ),
        "attempts": [
            {
                "seq": e.seq,
                "at_ms": e.at_ms,
                "by": e.data.get("by"),
                "attempt": e.data.get("attempt"),
            }
            for e in history
        ],
    }


@dataclass(frozen=True)
class DeadLetter:
    """The sweeper gives up on a run: left live, every sweep would find it again."""

    data: dict[str, Any]
    """The ``run.dead_lettered`` event's data."""


def dead_letter(
    run_id: str, by: str, verdict: Verdict, history: Sequence[Event], max_attempts: int
) -> DeadLetter | None:
    """Whether a resume dead-letters the run instead of resuming it: a sweeper's resume of a
    run it can never resume, or that was recovered ``max_attempts`` times in a row without
    progress (``history``, :func:`consecutive_recoveries`). An operator's resume never does."""
    if by != SWEEPER or (verdict.eligible and len(history) < max_attempts):
        return None
    data = dead_letter_data(run_id, history, max_attempts)
    if not verdict.eligible:
        data["reason"] = f"the sweeper cannot resume it: {verdict.reason}"
    return DeadLetter(data)


def sweep_due_ms(
    state: RunState, now_ms: int, lease_ms: int, lead_ms: int, max_suspended_s: int | None = None
) -> int | None:
    """When the sweeper next looks at the run (its place in the due index); None: never.

    A live run is overdue if nothing happens within one lease (``lease_ms``); a run
    waiting for a time is due ``lead_ms`` before it wakes, so the sweeper schedules its
    wake-up; a run waiting for a person under its agent's ``max_suspended_s`` is due when
    it expires (:func:`runtime.continuation.expires_at_ms`), so the sweeper expires it; a
    child that ended is due now (its parent is told now, or by the sweeper). Any other
    run (finished, or suspended on a person with no limit) is not swept.
    """
    due = due_at_ms(state, lead_ms)
    if due is not None:
        return due
    if state.status.is_suspended and state.suspension is not None:
        expires = expires_at_ms(state.suspension, max_suspended_s)
        if expires is not None:
            return expires
    if awaiting_delivery(state):
        return now_ms
    if state.status.is_live:
        return now_ms + lease_ms
    return None


def due_after_ms(
    state: RunState,
    last: Event,
    now_ms: int,
    lease_ms: int,
    lead_ms: int,
    max_suspended_s: int | None = None,
) -> int | None:
    """When the sweeper next looks at the run a write left in ``state``, ``last`` its last
    event: :func:`sweep_due_ms`, except for a run that went back on the queue with a
    countdown (``run.throttled``): overdue only once that countdown has run out, one lease
    after its ``until_ms``, so the sweeper does not resume a run that is merely waiting."""
    if last.type == "run.throttled":
        return int(last.data["until_ms"]) + lease_ms
    return sweep_due_ms(state, now_ms, lease_ms, lead_ms, max_suspended_s)


class SweepKind(StrEnum):
    """What the sweeper does with a run it found due."""

    WAKE = "wake"
    """A timer one sweep from its time: send its wake-up with an ETA."""
    EXPIRE = "expire"
    """It waited for a person past its agent's ``max_suspended_s``: expire it (under its
    lease, which checks again)."""
    TELL_PARENT = "tell-parent"
    """A child that ended and whose parent was not told: tell the parent now."""
    RESUME = "resume"
    """A live run nobody advances: send a resume carrying the seq the sweeper saw."""
    LEAVE = "leave"
    """Nothing the sweeper can do (parked or dead-lettered: a person acts)."""


@dataclass(frozen=True)
class SweepStep:
    """The sweeper's decision for one run; the shell carries it out."""

    kind: SweepKind
    postpone_ms: int | None = None
    """``RESUME`` only: how long after the resume is sent the run is next due, or ``None``
    to leave its due time as it is."""


LEAVE = SweepStep(SweepKind.LEAVE)


def sweep_step(status: RunStatus, suspension: Suspension | None, lease_ms: int) -> SweepStep:
    """What the sweeper does with a run the due index says is overdue (its lease expired),
    from its record: its ``status`` and ``suspension``.

    A live run is resumed and not looked at again for a lease (``lease_ms``): a run merely
    waiting in a long queue is overdue too, and a resume per sweep for each would grow the
    backlog it waits in (a chaos run reached 20,000 queued messages and lost 64 runs at a
    1 s sweep interval). Only a child whose parent was not told yet is terminal and due
    (:func:`sweep_due_ms`).
    """
    if suspension is not None and suspension.tool == WAIT:
        # Not an orphan: a timer one sweep from its time.
        return SweepStep(SweepKind.WAKE)
    if status.is_suspended:
        return SweepStep(SweepKind.EXPIRE)
    if status.is_terminal:
        return SweepStep(SweepKind.TELL_PARENT)
    if status.is_live:
        return SweepStep(SweepKind.RESUME, postpone_ms=lease_ms)
    return LEAVE


def dead_holder_step(status: RunStatus, due_at_ms: int | None, now_ms: int) -> SweepStep:
    """What the sweeper does with a run whose lease holder's process is dead, from its
    record: a live run is resumed at once (it need not wait for the lease, nor is it
    postponed); one past its ``max_suspended_s`` is expired from here, since the due index
    leaves out a run whose lease has not expired. A suspended or finished run such a
    process held needs no worker: its lease lapses.
    """
    if status.is_live:
        return SweepStep(SweepKind.RESUME)
    if expiry_is_due(status, due_at_ms, now_ms):
        return SweepStep(SweepKind.EXPIRE)
    return LEAVE
