"""The two I/O steps every task shares: load a run's state, append its next events.

A turn, a resume, a reconciliation and a continuation all read a run the same
way (snapshot, healed from the event log when stale) and write it the same way
(events and the record they produce, fenced by seq and, when owned, the lease).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any

from runtime.children import awaiting_delivery
from runtime.fsm import apply
from runtime.models import Event, RunState
from runtime.timers import due_at_ms
from store.runs import RunRecord
from tasks import tracing
from tasks.context import Context
from worker import metrics

log = logging.getLogger("ratchet.turn")

_HOST = socket.gethostname()


def new_owner() -> str:
    """A lease owner id unique to this attempt at this run, on this host and process."""
    return f"{_HOST}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def load_state(ctx: Context, run_id: str) -> tuple[RunState, int | None] | None:
    """The run's state and the seq of its stored snapshot; None if there is no such run.

    A stale or missing snapshot is healed here: the events are the truth, and the
    ones the snapshot lacks are folded onto it.
    """
    record = ctx.runs.get(run_id)
    if record is None:
        return None
    remembered = ctx.recall_checkpoint(run_id, record.last_seq)
    if remembered is not None:
        return remembered, remembered.seq
    state = ctx.snapshots.load(run_id)
    snapshot_seq = state.seq if state is not None else None
    if state is None or state.seq < record.last_seq:
        for event in ctx.runs.events(run_id, after_seq=snapshot_seq or 0):
            state = apply(state, event)
        if snapshot_seq is not None:
            log.info(
                "run %s: snapshot at seq %s was stale; rebuilt to %s from events",
                run_id,
                snapshot_seq,
                record.last_seq,
            )
    if state is None:
        raise ValueError(f"run {run_id} has a record but no events to rebuild its state from")
    return state, snapshot_seq


def append_events(
    ctx: Context, state: RunState, items: list[tuple[str, dict[str, Any]]], owner: str | None
) -> RunState:
    """Append events after ``state`` (fenced by ``owner``'s lease and the seq); the new state."""
    now = ctx.runs.clock()
    before = state.status
    events = []
    for kind, data in items:
        event = Event(seq=state.seq + 1, type=kind, at_ms=now, data=data)
        state = apply(state, event)
        events.append(event)
    # A live run is overdue for the sweeper if nothing happens within one lease; a
    # waiting one is due a sweep before it wakes, so the sweeper schedules its wake-up.
    due = due_at_ms(state, int(ctx.settings.sweep_interval_s * 1000))
    if due is None and awaiting_delivery(state):
        due = now  # a child that ended: its parent is told now, or by the sweeper
    if due is None:
        due = now + int(ctx.settings.lease_s * 1000)
    ctx.runs.append(RunRecord.from_state(state, now, due), events, owner)
    metrics.recorded(before, state.status, events)
    tracing.committed(ctx, state, events)  # only now: the events are committed
    return state
