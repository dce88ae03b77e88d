"""One way to hold a run's lease: ``with holding(ctx, run_id, patience_s=…) as held:``.

Every path that writes to a run under its lease takes it here — a turn, a
resume, a continuation, an expiry, a budget raise, a wake-up, a parent told of
its child, a reconciliation, and the API's reads that may set a snapshot aside:

1. One store call on the fast path: the lease and the run's record together
   (``acquire_and_get``), and with ``reads_snapshot`` the run's snapshot too where the
   run store reads it in the same call (``acquire_and_read``: both stores one Redis).
2. Refused, it claims (:func:`tasks.liveness.claim`), which also takes the lease
   from a holder whose process is dead, and claims again (every 2 ms, backing
   off to every 50 ms) for ``patience_s``. ``until_dead_s`` waits up to that much
   longer while the holder keeps a liveness record, which lapses if it died.
3. Still refused: :class:`~runtime.errors.LeaseHeld` naming the holder, whether its
   process is alive, and how long this waited (or, with ``must=False``, a
   :class:`Held` that is not ``taken``, its ``busy`` saying why).

A lease taken from a dead holder whose run was mid-turn (live) needs recovering
before anything else is done to it. A caller that recovers it itself (a turn, a
resume: ``recovers=True``, both through :func:`tasks.resumption.recover`) gets it; for
any other the lease is let go at once, the sweeper's urgent resume is enqueued
(:func:`tasks.messages.urgent_sweeper_resume`) and :class:`~runtime.errors.HolderDied`
says so — a control message then retries.

On leaving the block the lease is released, unless the caller let it go with
its last write (``held.released = True``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.errors import HolderDied, LeaseHeld, RunBusy
from store.runs import Claim, RunRecord
from store.snapshots import Prefetched
from tasks import liveness
from tasks.context import Context
from tasks.messages import urgent_sweeper_resume
from tasks.persistence import new_owner

if TYPE_CHECKING:
    from tasks.held_run import Ahead

log = logging.getLogger("ratchet.lease")

FIRST_POLL_S = 0.002
LAST_POLL_S = 0.05
"""A refused claim is tried again after 2 ms, then twice as long each time, up to 50 ms."""


TURN_PATIENCE_S = 0.5
"""How long a turn waits for a lease another worker holds before calling itself a duplicate.

The holder may be a late duplicate of the *previous* turn's message, which only
reads the run, finds it moved on, and lets go within milliseconds; a turn that
gave up at once would leave the run to the sweeper. A redelivered message waits
longer: RabbitMQ redelivers a dead consumer's message within a fraction of a
second, before its liveness lapses, so the turn waits (at most one
``liveness_s``) for the holder to be known dead; a holder that keeps beating is
alive, and the delivery a duplicate."""


@dataclass
class Held:
    """What :func:`holding` got."""

    run_id: str
    owner: str
    taken: bool
    record: RunRecord | None = None
    """The run's record, read once the lease was taken (None: no such run, or not taken)."""
    took_from: str | None = None
    """Taken from a holder whose process was dead: that owner."""
    busy: RunBusy | None = None
    """Not taken: why (what :func:`holding` raises when ``must``)."""
    released: bool = False
    """Set by a caller whose last write let the lease go: leaving the block then does not."""
    snapshot: Prefetched | None = None
    """The run's snapshot as read with the lease (``reads_snapshot``), for
    :func:`tasks.persistence.load`; None: not read with it."""
    journaled: bool = False
    """The ``ahead`` journal was appended with the lease: the run is at its state."""


@contextmanager
def holding(
    ctx: Context,
    run_id: str,
    owner: str | None = None,
    *,
    patience_s: float = 0.0,
    until_dead_s: float = 0.0,
    must: bool = True,
    recovers: bool = False,
    reads_snapshot: bool = False,
    ahead: Ahead | None = None,
) -> Iterator[Held]:
    """Hold ``run_id``'s lease for the block (see the module docstring).

    ``owner``: a caller that already holds the lease (a resume handing on to its
    turn) passes its owner id; the lease is renewed. Raises LeaseHeld (``must``)
    and HolderDied (``must`` and not ``recovers``), both RunBusy. ``reads_snapshot``: the
    caller loads the run next (:attr:`Held.snapshot`); ``ahead``: and appends that journal
    with the lease if the run is still at its state (tasks/ahead.py, :attr:`Held.journaled`).
    """
    held = _take(
        ctx, run_id, owner or new_owner(), patience_s, until_dead_s, reads_snapshot, ahead
    )
    if held.taken and held.took_from is not None and not recovers:
        record = held.record
        if record is not None and record.status.is_live:
            ctx.runs.release_lease(run_id, held.owner)
            _enqueue_resume(run_id, record.last_seq, held.took_from or "")
            held = Held(run_id, held.owner, False, None, held.took_from)
            held.busy = HolderDied(run_id, held.took_from or "", record.status.value)
    if not held.taken:
        assert held.busy is not None
        if must:
            raise held.busy
    try:
        yield held
    finally:
        if held.taken and not held.released:
            ctx.runs.release_lease(run_id, held.owner)


def _enqueue_resume(run_id: str, seq: int, dead: str) -> None:
    log.warning(
        "run %s: took the lease from %s, which died mid-turn; enqueueing its resume", run_id, dead
    )
    try:
        urgent_sweeper_resume(run_id, seq)
    except Exception as exc:  # a broker away: the sweeper finds the run once it is overdue
        log.warning("run %s: resume not enqueued (%s); the sweeper will resume it", run_id, exc)


def _take(
    ctx: Context,
    run_id: str,
    owner: str,
    patience_s: float,
    until_dead_s: float,
    reads_snapshot: bool = False,
    ahead: Ahead | None = None,
) -> Held:
    # A lease is never taken by a process that does not look alive, or another worker
    # could take it straight back.
    liveness.beats().keep_alive(ctx)
    snapshot: Prefetched | None = None
    journaled = False
    if reads_snapshot and ahead is not None:
        change = ahead.change
        taken, record, snapshot, journaled = ctx.runs.acquire_and_append(
            run_id, owner, ctx.settings.lease_s, ctx.snapshots, ahead.was, change.record,
            change.events,
        )  # fmt: skip
    elif reads_snapshot:
        # Not read where the log ends at the state this process remembers: load uses that.
        remembered = ctx.remembered_seq(run_id)
        taken, record, snapshot = ctx.runs.acquire_and_read(
            run_id, owner, ctx.settings.lease_s, ctx.snapshots, remembered
        )
    else:
        taken, record = ctx.runs.acquire_and_get(run_id, owner, ctx.settings.lease_s)
    if taken:
        return Held(run_id, owner, True, record, snapshot=snapshot, journaled=journaled)
    started = time.monotonic()
    pause_s = FIRST_POLL_S
    while True:
        claim = liveness.claim(ctx, run_id, owner)
        if claim.taken:
            # From a dead holder, or the lease came free since the fast path refused it.
            return Held(run_id, owner, True, ctx.runs.get(run_id), claim.took_from)
        waited_s = time.monotonic() - started
        # Past its patience, a caller waits on only for a holder that may yet be known dead.
        limit_s = patience_s + (until_dead_s if claim.holder_alive_until_ms is not None else 0.0)
        if waited_s >= limit_s:
            return Held(run_id, owner, False, busy=_busy(ctx, run_id, claim, waited_s))
        time.sleep(min(pause_s, limit_s - waited_s))
        pause_s = min(pause_s * 2, LAST_POLL_S)


def _busy(ctx: Context, run_id: str, claim: Claim, waited_s: float) -> LeaseHeld:
    now_ms = ctx.runs.clock()
    alive_until = claim.holder_alive_until_ms
    lease = ctx.runs.lease(run_id)
    return LeaseHeld(
        run_id,
        claim.holder or (lease.owner if lease is not None else "another worker"),
        round(waited_s, 2),
        None if alive_until is None else alive_until > now_ms,
        None if lease is None else (lease.expires_at_ms - now_ms) / 1000,
    )
