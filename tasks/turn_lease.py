"""How a turn takes its run's lease, and hands a run taken from a dead holder to recovery."""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime.actions import Advanced
from store.runs import Claim, RunRecord
from tasks import liveness
from tasks.context import Context

LEASE_PATIENCE_S = 0.5
"""How long a turn waits for a lease another worker holds before calling itself a duplicate.

The holder may be a late duplicate of the *previous* turn's message, which only
reads the run, finds it moved on, and lets go within milliseconds; a chained
turn that gave up at once would leave the run to the sweeper."""


def take_lease(
    ctx: Context, run_id: str, owner: str, redelivered: bool = False
) -> tuple[Claim, RunRecord | None]:
    """The lease — taken or renewed, or taken from a holder whose process is dead — and,
    unless taken from a dead holder (its recovery reads the run itself), the run's record.

    The fast path is one store call: the lease and the record together
    (``acquire_and_get``). Refused, the turn claims (``liveness.claim``), which also
    takes a dead holder's lease, and keeps claiming for ``LEASE_PATIENCE_S``. A
    redelivered message waits longer: RabbitMQ redelivers a dead consumer's message
    within a fraction of a second, before its liveness lapses, so the turn waits (at
    most one ``liveness_s``) for the holder to be known dead rather than leave the run
    to the sweeper; a holder that keeps beating is alive, and the delivery a duplicate.
    """
    # A lease is never taken by a process that does not look alive, or another worker
    # could take it straight back.
    liveness.beats().keep_alive(ctx)
    taken, record = ctx.runs.acquire_and_get(run_id, owner, ctx.settings.lease_s)
    if taken:
        return Claim(True), record
    started = time.monotonic()
    patience_s = LEASE_PATIENCE_S + (ctx.settings.liveness_s if redelivered else 0.0)
    while True:
        claim = liveness.claim(ctx, run_id, owner)
        if claim.taken:
            # From a dead holder, or the lease came free since the fast path refused it.
            return claim, None if claim.took_from is not None else ctx.runs.get(run_id)
        waited_s = time.monotonic() - started
        if waited_s >= patience_s:
            return claim, None
        pause_s = 0.01
        if waited_s >= LEASE_PATIENCE_S:
            if claim.holder_alive_until_ms is None:
                return claim, None  # nothing will say the holder died: only its lease ends it
            lapse_s = (claim.holder_alive_until_ms - ctx.runs.clock()) / 1000
            pause_s = min(max(lapse_s, 0.01), patience_s - waited_s, 0.5)
        time.sleep(pause_s)


Takeover = Callable[[Context, str, str], Advanced]
"""Recovers a run whose lease a turn took from a dead holder: ``(ctx, run_id, owner)``."""

_takeover: Takeover | None = None


def recover_takeovers_with(recover: Takeover) -> None:
    """Set how a turn recovers a run it took from a dead holder (tasks.recovery's resume).

    Handed in rather than imported: tasks.recovery imports this module, and importing
    ``tasks`` imports tasks.recovery, so it is set before any turn runs.
    """
    global _takeover
    _takeover = recover


def recover_takeover(ctx: Context, run_id: str, owner: str) -> Advanced:
    if _takeover is None:
        ctx.runs.release_lease(run_id, owner)
        raise RuntimeError("tasks.recovery is not imported: a taken-over run cannot recover")
    return _takeover(ctx, run_id, owner)
