"""Fork a run: record a new run at another run's state at a chosen seq (see runtime/fork.py).

The original is only read, never written. The fork is created in one write
(its ``run.created`` carries its history), then its first snapshot is saved
and, unless it is suspended, its next turn is enqueued — a crash before the
enqueue is covered by the sweeper, like any new run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from runtime.errors import InvalidRequest, RunNotFound, StaleWrite
from runtime.fork import plan_fork
from runtime.fsm import apply, rebuild
from runtime.models import RunState, validate_run_id
from store.runs import RunRecord
from tasks.context import Context
from tasks.messages import chain_turn
from tasks.start import check_new_run_id


@dataclass(frozen=True)
class Forked:
    state: RunState
    """The fork's state after its first event."""
    notes: tuple[str, ...]
    """Calls the fork will run again although the original already ran them."""


def fork(
    ctx: Context,
    run_id: str,
    at_seq: int | None = None,
    new_run_id: str | None = None,
    *,
    rebind: bool = False,
    enqueue: Callable[[str, int], None] | None = None,
) -> Forked:
    """Fork ``run_id`` at ``at_seq`` (default: its last seq) into ``new_run_id`` (default: new).

    Raises RunNotFound, RunRefused (a seq that cannot be forked), BindingChanged
    (the agent changed and ``rebind`` is not set), InvalidRequest (``new_run_id`` taken or
    reserved for children).
    """
    run_id = validate_run_id(run_id)
    new_run_id = check_new_run_id(new_run_id or uuid.uuid4().hex)
    events = list(ctx.runs.events(run_id, after_seq=0))
    if not events:
        raise RunNotFound(run_id)
    agent = ctx.agent(events[0].data["agent_file"])
    now = ctx.runs.clock()
    plan = plan_fork(events, at_seq, new_run_id, agent, now, rebuild, rebind=rebind)
    state = apply(None, plan.first)
    due = now + int(ctx.settings.lease_s * 1000)
    try:
        ctx.runs.create(RunRecord.from_state(state, now, due), plan.first)
    except StaleWrite:
        raise InvalidRequest(
            f"run id {new_run_id} is taken by another run; fork with another --run-id, or "
            "without one for a new id"
        ) from None
    ctx.snapshots.save(state, None)
    if state.status.is_live:
        (enqueue or chain_turn)(state.run_id, state.seq)
    return Forked(state, plan.notes)
