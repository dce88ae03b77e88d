"""``ratchet.wake``: end a run's ``wait`` on time (see runtime/timers.py).

Two paths enqueue it, each with an ETA at the wake-up time: the turn that
suspended the run (the fast path), and the sweeper, which finds a waiting run
one sweep before it is due (the path that survives the first one's worker
dying with the message). Either may run it twice or late; the wake is fenced
like any write — it acts only on a run still waiting at the seq it names, and
only once the time has come — so a duplicate does nothing.

The turn sends its ETA only for a wake-up due within half the broker's redelivery
horizon (:func:`eta_horizon_s`). A worker holds an ETA message unacknowledged until
its time: on Redis, past the visibility timeout kombu gives it to a worker again and
the first keeps its copy (three runs waiting 3,000 s held 12 copies after 210 s);
on RabbitMQ, past the server's ``consumer_timeout`` the worker's channel is closed,
with every turn it was running. A longer wait holds nothing: the due index brings
the run to the sweeper one sweep before its time, and the sweeper's ETA is one
sweep long.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from runtime.errors import RunBusy
from runtime.models import RunState, RunStatus, validate_run_id
from runtime.timers import is_timer, wake_at_ms
from tasks.context import Context, get_context
from tasks.lease import holding
from tasks.messages import chain_turn, enqueue_wake
from tasks.persistence import append_events, load
from tasks.settings import Settings
from tasks.task_base import control_task

log = logging.getLogger("ratchet.timers")


ETA_SHARE = 0.5
"""The share of the broker's redelivery horizon an ETA may last (the rest: the wait
in the queue before a worker takes it, and kombu's restore running late or early)."""


def eta_horizon_s(settings: Settings) -> float | None:
    """The longest wait a suspending turn hands the broker as an ETA; None: any."""
    horizon = settings.redelivery_horizon_s
    return None if horizon is None else horizon * ETA_SHARE


def schedule_wake(ctx: Context, state: RunState) -> None:
    """Enqueue the wake-up of waiting ``state`` with an ETA at its time, if it is due
    within :func:`eta_horizon_s`; a later one is the sweeper's (the due index)."""
    assert state.suspension is not None
    at_ms, now_ms = wake_at_ms(state.suspension), ctx.runs.clock()
    horizon_s = eta_horizon_s(ctx.settings)
    if horizon_s is not None and at_ms - now_ms > horizon_s * 1000:
        log.info(
            "run %s: waits %.0f s, beyond the %.0f s a broker message may be held: the "
            "sweeper enqueues its wake-up one sweep before its time",
            state.run_id,
            (at_ms - now_ms) / 1000,
            horizon_s,
        )
        return
    wake_at(state.run_id, state.seq, at_ms, now_ms)


def wake_at(run_id: str, seq: int, at_ms: int, now_ms: int) -> None:
    """Enqueue ``ratchet.wake`` for ``run_id`` at ``seq``, with an ETA at ``at_ms``."""
    countdown_s = max(0.0, (at_ms - now_ms) / 1000)
    enqueue_wake(run_id=run_id, seq=seq, countdown_s=countdown_s)


@control_task(name="ratchet.wake")
def wake_run(*, run_id: str, seq: int) -> str:
    """Wake ``run_id`` if it is still waiting at ``seq`` and its time has come.

    Returns woken | early | busy | stale; for all but the first the sweeper
    enqueues the wake again while the run is still waiting.
    """
    return wake(get_context(), validate_run_id(run_id), seq)


def wake(
    ctx: Context, run_id: str, seq: int, enqueue: Callable[[str, int], None] | None = None
) -> str:
    """:func:`wake_run`'s work; ``enqueue`` chains the next turn (default: the broker)."""
    record = ctx.runs.get(run_id)
    if record is None or record.last_seq != seq or record.status != RunStatus.WAITING:
        return "stale"
    try:
        with holding(ctx, run_id, patience_s=1.0) as held:
            owner = held.owner
            state = load(ctx, run_id).state
            if state.seq != seq or not is_timer(state):
                return "stale"
            assert state.suspension is not None
            now = ctx.runs.clock()
            if now < wake_at_ms(state.suspension):
                # An ETA that came early (clock skew between hosts): the sweeper
                # enqueues it again before its time.
                return "early"
            data = {"call_id": state.suspension.call_id, "by": "timer"}
            state = append_events(ctx, state, [("run.woken", data)], owner)
    except RunBusy:
        log.info("run %s: a worker holds the lease; the sweeper will wake it", run_id)
        return "busy"
    log.info("run %s: woken at seq %s", run_id, state.seq)
    (enqueue or chain_turn)(run_id, state.seq)
    return "woken"
