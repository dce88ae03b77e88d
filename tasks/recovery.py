"""Getting stopped runs going again: ``ratchet.sweep``, ``ratchet.resume``, ``ratchet.reconcile``.

- **Sweep** (control queue, every ``sweep_interval_s`` from ``celery -A worker
  beat`` or ``ratchet sweep``): ask the run store for live runs past due whose
  lease expired — an index, so the cost grows with the overdue runs only — and
  enqueue a resume for each, carrying the seq it saw. It re-enqueues, it never
  executes (DBOS-style): two sweepers at once only enqueue duplicates, and the
  lease and the seq make a duplicate a no-op.
- **Resume** (turns queue): take the lease, rebuild the run, classify it
  (:mod:`runtime.recovery`), refuse all but ``resume-eligible`` with the reason,
  record ``run.resumed`` {by, attempt} (all of it :mod:`tasks.resumption`, the path a
  turn that took a dead holder's lease takes too) and take a turn from the state after
  the last checkpoint. A sweeper resume of a run that recovered
  ``max_recovery_attempts`` times in a row without progress, or that can never
  resume, records ``run.dead_lettered`` instead, so it does not loop.
- **Reconcile**: an operator decides the outcome of the call a parked run has
  open (``tool.reconciled`` {call_id, decision, result | reason}), and the run
  continues with a turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runtime.actions import Advanced, TurnOutcome
from runtime.errors import InvalidOption, RunRefused, StaleWrite
from runtime.models import RunState, RunStatus, validate_run_id
from runtime.recovery import OPERATOR, SweepKind, SweepStep, dead_holder_step, sweep_step
from runtime.timers import wake_at_ms
from store.runs import RunRecord, wall_ms
from tasks import lease, resumption
from tasks.context import Context, get_context
from tasks.control import expire_if_due
from tasks.messages import (
    chain_turn,
    sweeper_resume,
    tell_parent_soon,
    urgent_sweeper_resume,
)
from tasks.persistence import append_events, load
from tasks.task_base import control_task, ratchet_task
from tasks.timers import wake_at
from tasks.turn import advance, enqueue_next

log = logging.getLogger("ratchet.recovery")

DECISIONS = ("result", "retry", "fail")


# --- resume -----------------------------------------------------------------


@ratchet_task(name="ratchet.resume")
def resume_run(*, run_id: str, by: str = OPERATOR, seen_seq: int | None = None) -> str:
    """Resume ``run_id`` if it is resume-eligible (and, from the sweeper, still at ``seen_seq``).

    Idempotent: a duplicate finds the lease taken or the run moved on, and does nothing.
    """
    done = resume(get_context(), validate_run_id(run_id), by, seen_seq)
    if done.outcome == TurnOutcome.NEXT:
        enqueue_next(get_context(), run_id, done)
    return done.outcome.value


def resume(
    ctx: Context, run_id: str, by: str, seen_seq: int | None = None, owner: str | None = None
) -> Advanced:
    """Classify, record ``run.resumed`` and take a turn; or refuse, or dead-letter. Does not enqueue.

    The lease is taken also from a holder whose process is dead (:mod:`tasks.lease`);
    ``owner``: a turn that already took it so passes its owner id.
    """
    resumed = resumption.recover(ctx, run_id, by, seen_seq, owner)
    if isinstance(resumed, Advanced):
        return resumed
    # Still holding the lease, take the turn from the state after the last checkpoint.
    return advance(ctx, run_id, resumed.seq, owner=resumed.owner)


# --- sweep ------------------------------------------------------------------

Enqueue = Callable[[str, int], None]


def wake_when_due(run_id: str, record: RunRecord) -> None:
    assert record.suspension is not None
    wake_at(run_id, record.last_seq, wake_at_ms(record.suspension), wall_ms())


Wake = Callable[[str, RunRecord], None]


def sweep_orphans(
    ctx: Context,
    enqueue: Enqueue = sweeper_resume,
    limit: int = 1000,
    wake: Wake = wake_when_due,
    tell: Callable[[str], None] = tell_parent_soon,
    enqueue_orphan: Enqueue | None = None,
) -> list[str]:
    """Enqueue a resume for every live run past due whose lease expired, or whose lease
    holder's process is dead (:meth:`~store.runs.RunStore.orphaned`); their ids.

    A dead process's run is enqueued with ``enqueue_orphan`` (by default the control
    queue when ``enqueue`` is the default, else ``enqueue``).

    A waiting run (a ``wait`` timer) is due one sweep before it wakes: its
    wake-up is enqueued with an ETA instead (``wake``), and its id is returned too.
    A run waiting for a person is due when it has waited past its agent's
    ``max_suspended_s``: it is expired (``run.expired``, :func:`tasks.control.expire_if_due`)
    and its id returned too.

    Reads the run store's due index (cost grows with the overdue runs, not with
    every run) plus one record per overdue run, for the seq the resume must find.
    The clock is the run store's, so a test can inject one.
    """
    found: list[str] = []
    expired: list[str] = []
    # Live runs whose lease holder's process died first: they need not wait for the lease.
    if enqueue_orphan is None:
        enqueue_orphan = urgent_sweeper_resume if enqueue is sweeper_resume else enqueue
    lease_ms = int(ctx.settings.lease_s * 1000)
    found.extend(_enqueue_dead_holders(ctx, enqueue_orphan, limit))
    for run_id in ctx.runs.overdue(limit):
        if run_id in found:
            continue
        record = ctx.runs.get(run_id)
        if record is None:
            continue
        step = sweep_step(record.status, record.suspension, lease_ms)
        if step.kind == SweepKind.EXPIRE:
            if _expire(ctx, run_id):
                expired.append(run_id)
        elif _send(ctx, step, record, enqueue, wake, tell):
            found.append(run_id)
    if found:
        log.info("sweep: %s overdue run(s) with no lease; resume enqueued", len(found))
    if expired:
        log.info("sweep: %s run(s) waited past their max_suspended_s; expired", len(expired))
    return found + expired


def _send(
    ctx: Context,
    step: SweepStep,
    record: RunRecord,
    enqueue: Enqueue,
    wake: Wake,
    tell: Callable[[str], None],
) -> bool:
    """Send the message ``step`` asks for; whether it asked for one."""
    run_id = record.run_id
    if step.kind == SweepKind.WAKE:
        wake(run_id, record)
    elif step.kind == SweepKind.TELL_PARENT:
        tell(run_id)
    elif step.kind == SweepKind.RESUME:
        enqueue(run_id, record.last_seq)
        if step.postpone_ms is not None:
            ctx.runs.postpone(run_id, record.last_seq, ctx.runs.clock() + step.postpone_ms)
    else:
        return False
    return True


def _enqueue_dead_holders(ctx: Context, enqueue: Enqueue, limit: int) -> list[str]:
    found = []
    now = ctx.runs.clock()
    for orphan in ctx.runs.orphaned(limit):
        record = ctx.runs.get(orphan.run_id)
        if record is None:
            continue
        step = dead_holder_step(record.status, record.due_at_ms, now)
        if step.kind == SweepKind.RESUME:
            enqueue(orphan.run_id, record.last_seq)
            found.append(orphan.run_id)
        elif step.kind == SweepKind.EXPIRE and _expire(ctx, orphan.run_id):
            found.append(orphan.run_id)
    return found


def _expire(ctx: Context, run_id: str) -> bool:
    try:
        return expire_if_due(ctx, run_id)
    except StaleWrite as exc:
        log.info("run %s: not expired this sweep: %s", run_id, exc)
        return False


PURGE_BATCH = 1000
"""Finished runs one sweep purges at most: a backlog drains over several sweeps."""


def purge_finished(ctx: Context, before_ms: int | None = None, limit: int = PURGE_BATCH) -> int:
    """Delete finished runs last updated before ``before_ms`` (default: now − ``retention_s``).

    Destructive: records and events go, and a dead-lettered run's snapshot with them.
    Returns how many runs were purged.
    """
    if before_ms is None:
        before_ms = ctx.runs.clock() - ctx.settings.retention_s * 1000
    purged = ctx.runs.purge(before_ms, limit, forget=ctx.snapshots.delete)
    if ctx.observers:
        ctx.observers.purged(purged)
    if purged:
        log.info(
            "retention: purged %s finished run(s) last updated before %s ms", purged, before_ms
        )
    return purged


@control_task(name="ratchet.sweep")
def sweep() -> int:
    """One sweep (``celery -A worker beat`` sends it every ``sweep_interval_s``), then retention."""
    ctx = get_context()
    found = len(sweep_orphans(ctx))
    purge_finished(ctx)
    return found


# --- reconcile --------------------------------------------------------------


def reconcile(
    ctx: Context,
    run_id: str,
    call_id: str,
    decision: str,
    result: Any = None,
    reason: str | None = None,
    enqueue: Enqueue | None = None,
) -> RunState:
    """Record an operator's outcome for the parked run's open call and enqueue its next turn.

    Refused (RunRefused) unless the run is needs_reconciliation and ``call_id`` is its open call.
    """
    run_id = validate_run_id(run_id)
    if decision not in DECISIONS:
        raise InvalidOption(
            f"decision must be one of {', '.join(DECISIONS)}, not {decision!r}", run_id
        )
    if decision == "fail" and not (reason or "").strip():
        raise InvalidOption(
            "--fail needs a reason: what the model will read as the call's error", run_id
        )
    # A run that just parked may still be held by its worker, finishing the turn: wait
    # for it as a continuation does, rather than refuse the operator.
    with lease.holding(ctx, run_id, patience_s=ctx.settings.lease_s) as held:
        owner = held.owner
        state = load(ctx, run_id).state
        if state.status != RunStatus.NEEDS_RECONCILIATION:
            raise RunRefused(
                run_id,
                state.status.value,
                "only a run parked as needs_reconciliation has a call to reconcile; "
                f"see `ratchet runs show {run_id}`",
            )
        if call_id not in state.running:
            # Parallel calls may leave several open: each is reconciled on its own.
            open_calls = (
                f"the open call is {state.running[0]}"
                if len(state.running) == 1
                else f"the open calls are {', '.join(state.running) or 'none'}"
            )
            raise RunRefused(
                run_id,
                state.status.value,
                f"call {call_id!r} is not open; {open_calls} (`ratchet runs show {run_id}`)",
            )
        data: dict[str, Any] = {"call_id": call_id, "decision": decision, "by": OPERATOR}
        if decision == "result":
            data["result"] = result
        elif decision == "fail":
            data["reason"] = reason
        state = append_events(ctx, state, [("tool.reconciled", data)], owner)
    (enqueue or chain_turn)(run_id, state.seq)
    return state


@control_task(name="ratchet.reconcile")
def reconcile_run(
    *, run_id: str, call_id: str, decision: str, result: Any = None, reason: str | None = None
) -> int:
    """:func:`reconcile` for clients that only speak Celery; returns the run's new seq."""
    return reconcile(get_context(), run_id, call_id, decision, result, reason).seq
