"""The control queue's tasks: ``ratchet.continue``, ``ratchet.cancel``, and the expiry sweep.

Continuing a suspended run, in order:

1. Check the answer's form (:func:`runtime.continuation.make_continuation`).
2. Take the run's **lease**, so the answer cannot race a turn or another answer.
3. Read the run. An answer already recorded under this ``continuation_id`` is
   a **duplicate**: acknowledged, not applied again. A run that waited longer
   than its agent's ``max_suspended_s`` **expires** instead (``run.expired``).
4. Check the answer against the run (suspended, the right suspension, same
   binding, budgets and deadline allow a step), fold ``run.continued``,
   append it fenced by seq and lease, save the snapshot (CAS on seq).
5. Release the lease and **chain** the next turn.

Cancelling appends ``run.cancelled`` fenced by seq only: it must not wait for
a long turn's lease. The turn in progress then loses its next append
(StaleWrite), stops, and chains nothing.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from runtime.children import (
    CancelCascade,
    cancel_reaches,
    parent_cancelled_reason,
    possible_children,
)
from runtime.continuation import (
    Continuation,
    cancel_reason,
    cancelled_event_data,
    check_pinned,
    check_suspended,
    continued_event_data,
    expired_event_data,
    expiry_is_due,
    expiry_of,
    expiry_reason,
    find_applied,
    make_continuation,
    suspended_for_ms,
)
from runtime.errors import (
    RatchetError,
    RunBusy,
    RunMoving,
    RunNotFound,
    RunStateLost,
    SnapshotError,
    StaleWrite,
    StoreUnavailable,
    SuspensionExpired,
)
from runtime.models import RunState, validate_run_id
from store.runs import RunRecord
from tasks.context import Context, get_context
from tasks.lease import holding
from tasks.messages import Continue, chain_turn, tell_parent_soon
from tasks.persistence import (
    append_ending,
    append_events,
    load,
    max_suspended_s,
    save_snapshot,
)
from tasks.task_base import control_task

log = logging.getLogger("ratchet.control")

STALE_ATTEMPTS = 5
"""How often a control write re-reads the run after losing a seq race before giving up."""


def new_continuation_id() -> str:
    return uuid.uuid4().hex


# --- continue ---------------------------------------------------------------


def apply_continuation(
    ctx: Context,
    continuation: Continuation,
    enqueue: Callable[[str, int], None] = chain_turn,
) -> str:
    """Apply ``continuation`` and chain the next turn. Returns ``continued`` or ``duplicate``.

    Exactly once: a continuation whose id is already recorded returns ``duplicate``
    (and re-chains the turn if the run has not moved since, healing a crash
    between append and chain). Raises RunNotFound, RunRefused and its subclasses
    (SuspensionExpired after recording the expiry), BindingChanged,
    InvalidContinuation, RunBusy, StoreUnavailable.
    """
    run_id = continuation.run_id
    for _ in range(STALE_ATTEMPTS):
        record = ctx.runs.get(run_id)
        if record is None:
            raise RunNotFound(run_id)
        try:
            # A suspending turn lets its lease go just after its checkpoint, so an answer
            # sent at once may find it held for a moment: wait up to one lease period.
            with holding(ctx, run_id, patience_s=ctx.settings.lease_s) as held:
                outcome, seq = _continue_holding_lease(ctx, continuation, held.owner)
        except StaleWrite as exc:
            log.info("run %s: %s; reading the run again", run_id, exc)
            continue
        if seq is not None:
            enqueue(run_id, seq)
        return outcome
    raise RunMoving(run_id, STALE_ATTEMPTS)


def _continue_holding_lease(
    ctx: Context, continuation: Continuation, owner: str
) -> tuple[str, int | None]:
    """(outcome, seq to chain the next turn at, or None)."""
    loaded = load(ctx, continuation.run_id, whole_log=True)
    state, events = loaded.state, loaded.log()
    applied = find_applied(events, continuation)
    if applied is not None:
        log.info(
            "run %s: continuation %s was already applied at seq %s; duplicate acknowledged",
            state.run_id,
            continuation.continuation_id,
            applied.seq,
        )
        return "duplicate", (state.seq if state.seq == applied.seq else None)
    suspension = check_suspended(state, events, continuation)
    now = ctx.runs.clock()
    max_s = max_suspended_s(ctx, state, events)
    expired = expiry_reason(suspension, max_s, now)
    if expired is not None:
        _expire(ctx, state, expired, owner, now)
        raise SuspensionExpired(
            state.run_id, suspended_for_ms(suspension, now) / 1000, float(max_s or 0)
        )
    agent = ctx.agent(state.agent_file)
    data = continued_event_data(state, agent, events, continuation, now)
    state = append_events(ctx, state, [("run.continued", data)], owner)
    try:
        save_snapshot(ctx, state, loaded.snapshot_seq)
    except (StaleWrite, SnapshotError) as exc:
        # The event is recorded, so the turn must be chained whatever the snapshot's
        # fate: the turn's load rebuilds the state from the events.
        log.warning("run %s: snapshot not saved after the continuation: %s", state.run_id, exc)
    log.info(
        "run %s: continuation %s applied at seq %s after %.1fs suspended",
        state.run_id,
        continuation.continuation_id,
        state.seq,
        data["suspended_ms"] / 1000,
    )
    return "continued", state.seq


def _expire(ctx: Context, state: RunState, reason: str, owner: str, now: int) -> None:
    assert state.suspension is not None
    data = expired_event_data(state.suspension, reason, now)
    append_events(ctx, state, [("run.expired", data)], owner)
    ctx.snapshots.delete(state.run_id)
    log.warning("run %s: expired: %s", state.run_id, reason)


@control_task(name="ratchet.continue", bind=True)
def continue_run(self: Any, answer: Continue) -> str:
    """Apply one continuation. Returns continued | duplicate | refused (the reason is logged).

    An answer naming neither ``continuation_id`` nor ``suspension_seq`` is refused
    unless ``RATCHET_ALLOW_UNPINNED_CONTINUATIONS`` is set; then the task id stands
    in for the id, so a redelivery of this very message is still a duplicate.
    """
    try:
        ctx = get_context()
        check_pinned(
            answer.run_id,
            answer.continuation_id,
            answer.suspension_seq,
            allow_unpinned=ctx.settings.allow_unpinned_continuations,
        )
        continuation = make_continuation(
            answer.run_id,
            answer.continuation_id or self.request.id or new_continuation_id(),
            input=answer.input,
            approve=answer.approve,
            deny=answer.deny,
            suspension_seq=answer.suspension_seq,
        )
        return apply_continuation(ctx, continuation)
    except (RunBusy, StoreUnavailable):
        raise
    except RatchetError as exc:
        log.warning("%s", exc)
        return "refused"


# --- cancel -----------------------------------------------------------------


def cancel(ctx: Context, run_id: str, reason: str | None = None) -> RunRecord:
    """Make the run terminal (`run.cancelled`), delete its snapshot, and do the same to
    every live run of its subtree; return the run's new record.

    Fenced by seq only, never waiting for a lease: a turn in progress loses its
    next write and stops. Which runs of the subtree the cancel reaches is the core's
    (:class:`runtime.children.CancelCascade`, :func:`runtime.children.cancel_reaches`);
    a child its parent's turn creates after the cascade looked is cancelled by that turn
    at once (tasks/children.py reads the parent after creating a child). Raises
    RunNotFound, RunRefused for a run that had finished with nothing left to cancel under it.
    """
    run_id = validate_run_id(run_id)
    record, children, ended = _cancel_one(ctx, run_id, cancel_reason(reason))
    cascade = CancelCascade(run_id, children, ended)
    while (step := cascade.next()) is not None:
        child, parent = step
        try:
            _, more, now = _cancel_one(ctx, child, parent_cancelled_reason(parent), parent)
        except RunNotFound:
            continue  # its parent's call never made it
        cascade.reached(child, more, now)
    refusal = cascade.refusal(record.status)
    if refusal is not None:
        raise refusal
    return record


def _cancel_one(
    ctx: Context, run_id: str, reason: str, parent_ended: str | None = None
) -> tuple[RunRecord, list[str], bool]:
    """Cancel one run unless it ended already; (its record, the ids its children may have,
    whether this cancelled it). ``parent_ended``: its parent, already ended, so the child
    records that it is told with its ending (no delivery)."""
    for _ in range(STALE_ATTEMPTS):
        record, children = _children_of(ctx, run_id)
        if record.status.is_terminal:
            return record, children, False
        is_child = parent_ended is not None
        if not is_child:
            first = ctx.runs.events(run_id, after_seq=0, limit=1)
            is_child = bool(first and first[0].data.get("parent"))
        data = cancelled_event_data(record.status, record.suspension, reason, ctx.runs.clock())
        try:
            # A child stays due until its parent is told (runtime/children.py).
            cancelled = append_ending(
                ctx, record, "run.cancelled", data, None, is_child, parent_ended
            )
        except StaleWrite:
            continue  # a turn appended first; read the new tail and try again
        ctx.snapshots.delete(run_id)
        log.info("run %s: cancelled (%s) at seq %s", run_id, reason, cancelled.last_seq)
        if parent_ended is None and is_child:
            tell_parent_soon(run_id)
        return cancelled, children, True
    raise RunMoving(run_id, STALE_ATTEMPTS)


def _children_of(ctx: Context, run_id: str) -> tuple[RunRecord, list[str]]:
    """The run's record and the ids of the children that may be live under it."""
    record = ctx.runs.get(run_id)
    if record is None:
        raise RunNotFound(run_id)
    children = cancel_reaches(run_id, record.status, record.suspension)
    if children is not None:
        return record, children
    try:
        loaded = load(ctx, run_id, set_aside=False, record=record)
    except RunStateLost:
        return record, []  # no state to read; a turn cannot advance it to a child either
    return record, possible_children(loaded.state)


@control_task(name="ratchet.cancel")
def cancel_run(*, run_id: str, reason: str | None = None) -> str:
    """Cancel a run. Returns cancelled | refused (the reason is logged)."""
    try:
        cancel(get_context(), run_id, reason)
    except (RunBusy, StoreUnavailable):
        raise
    except RatchetError as exc:
        log.warning("%s", exc)
        return "refused"
    return "cancelled"


# --- expiry -----------------------------------------------------------------


def expire_if_due(ctx: Context, run_id: str) -> bool:
    """Expire ``run_id`` if it still waits for a person longer than its ``max_suspended_s``.

    For the sweeper, which finds such runs in the due index at the time they expire
    (:func:`runtime.recovery.sweep_due_ms`). Under the run's lease and fenced by seq
    like an answer, so an answer racing the expiry and the expiry resolve exactly once:
    whichever takes the lease first wins, and the other finds the run moved. Whether
    it expired the run; a run whose lease is held (an answer being applied) is left for
    the next sweep.
    """
    with holding(ctx, run_id, must=False) as held:
        if not held.taken:
            log.info("run %s: not expired this sweep: its lease is held", run_id)
            return False
        state = load(ctx, run_id).state
        now = ctx.runs.clock()
        reason = expiry_of(state, max_suspended_s(ctx, state), now)
        if reason is None:
            return False
        _expire(ctx, state, reason, held.owner, now)
        return True


def expires_now(record: RunRecord | None, now_ms: int) -> bool:
    """The record is of a run waiting for a person whose due time (its expiry) has come."""
    return record is not None and expiry_is_due(record.status, record.due_at_ms, now_ms)


def expire_suspended(ctx: Context, limit: int = 1000) -> list[str]:
    """Expire every run the due index shows past its ``max_suspended_s`` (and any such
    run whose lease a dead process still holds); their ids.

    What one sweep does for expiry (:func:`tasks.recovery.sweep_orphans` does it along
    with the rest), for callers that want only this.
    """
    expired = []
    now = ctx.runs.clock()
    candidates = [*ctx.runs.overdue(limit), *(o.run_id for o in ctx.runs.orphaned(limit))]
    for run_id in dict.fromkeys(candidates):
        if not expires_now(ctx.runs.get(run_id), now):
            continue
        try:
            if expire_if_due(ctx, run_id):
                expired.append(run_id)
        except StaleWrite as exc:
            log.info("run %s: not expired this sweep: %s", run_id, exc)
    return expired


__all__ = [
    "apply_continuation",
    "cancel",
    "cancel_run",
    "continue_run",
    "expire_if_due",
    "expires_now",
    "expire_suspended",
    "new_continuation_id",
]
