"""Raise a run's budgets (see runtime/budget.py): an audited event, then the run goes on.

The change is appended under the run's lease, fenced by seq like any write. A
run that had stopped on a budget is live again afterwards, and its next turn is
enqueued; a crash before the enqueue is covered by the sweeper (the run is
live and due).
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.budget import plan_raise
from runtime.errors import RunNotFound
from runtime.models import RunState, validate_run_id
from tasks.context import Context
from tasks.lease import holding
from tasks.messages import chain_turn
from tasks.persistence import append_events, load


def raise_budgets(
    ctx: Context,
    run_id: str,
    changes: dict[str, str],
    by: str,
    reason: str,
    enqueue: Callable[[str, int], None] | None = None,
) -> RunState:
    """Record ``run.budget_raised`` for ``changes`` (budget → ``+N`` or ``N``); the new state.

    Raises RunNotFound, RunRefused (the run cannot be given more), InvalidRequest (a
    change that is not a raise), RunBusy (a worker holds the lease past one lease).
    """
    run_id = validate_run_id(run_id)
    record = ctx.runs.get(run_id)
    if record is None:
        raise RunNotFound(run_id)
    with holding(ctx, run_id, patience_s=ctx.settings.lease_s) as held:
        owner = held.owner
        state = load(ctx, run_id).state
        last = ctx.runs.events(run_id, after_seq=state.seq - 1, limit=1)[0]
        data = plan_raise(state, last, changes, by, reason, ctx.runs.clock())
        revived = not (state.status.is_live or state.status.is_suspended)
        state = append_events(ctx, state, [("run.budget_raised", data)], owner)
    if revived and state.status.is_live:
        (enqueue or chain_turn)(run_id, state.seq)
    return state
