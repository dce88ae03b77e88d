"""``ratchet.wake``: end a run's ``wait`` on time (see runtime/timers.py).

Two paths enqueue it, each with an ETA at the wake-up time: the turn that
suspended the run (the fast path), and the sweeper, which finds a waiting run
one sweep before it is due (the path that survives the first one's worker
dying with the message). Either may run it twice or late; the wake is fenced
like any write — it acts only on a run still waiting at the seq it names, and
only once the time has come — so a duplicate does nothing.
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
from tasks.task_base import control_task

log = logging.getLogger("ratchet.timers")


def schedule_wake(ctx: Context, state: RunState) -> None:
    """Enqueue the wake-up of waiting ``state`` with an ETA at its time."""
    assert state.suspension is not None
    wake_at(state.run_id, state.seq, wake_at_ms(state.suspension), ctx.runs.clock())


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
