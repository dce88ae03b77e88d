"""The two I/O steps every task shares: load a run's state, append its next events.

A turn, a resume, a reconciliation, a continuation and ``ratchet runs show``
all read a run through :func:`load` (the snapshot, healed from the event log
when stale, and treated as missing when it cannot be used) and every task
writes it the same way (events and the record they produce, fenced by seq
and, when owned, the lease).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, NamedTuple

from runtime.continuation import max_suspended_s_of
from runtime.endings import ending
from runtime.errors import (
    EventsDoNotFold,
    NotReplicated,
    RatchetError,
    RunNotFound,
    RunStateLost,
    SnapshotError,
    SnapshotTooLarge,
    StaleWrite,
)
from runtime.fsm import apply, rebuild
from runtime.models import Event, RunState, RunStatus
from runtime.recovery import due_after_ms
from store.runs import Checkpoint, Dropped, Outbox, RunRecord
from store.snapshots import Prefetched
from tasks.context import Context
from tasks.liveness import process_id

log = logging.getLogger("ratchet.turn")


def new_owner() -> str:
    """A lease owner id unique to this attempt at this run: ``<process id>/<attempt>``.

    It names this process (:func:`tasks.liveness.process_id`), so that once the process
    stops renewing its liveness another worker may take the run at once.
    """
    return f"{process_id()}/{uuid.uuid4().hex[:12]}"


class Loaded(NamedTuple):
    """A run as :func:`load` found it."""

    record: RunRecord
    state: RunState
    snapshot_seq: int | None
    """Seq of the stored snapshot: the next save's expected value. None if there is none,
    or there was one that could not be used (moved aside)."""
    events: list[Event] | None
    """The whole event log when it was read (``whole_log=True``, or a rebuild); else None."""

    def log(self) -> list[Event]:
        """The whole event log; only after ``load(..., whole_log=True)``."""
        assert self.events is not None, "load(..., whole_log=True) reads the whole log"
        return self.events


def load(
    ctx: Context,
    run_id: str,
    *,
    whole_log: bool = False,
    set_aside: bool = True,
    record: RunRecord | None = None,
    snapshot: Prefetched | None = None,
) -> Loaded:
    """The run's state: its snapshot with the events it lacks folded on, else the fold of all.

    The one way every task and command reads a run. The events are the truth; a
    snapshot is a shortcut, and one that cannot be used is treated as missing:
    one the store refuses (malformed, another kind or version, too large, a
    symbolic link, another run's state), one of an earlier run that had this id,
    one ahead of the event log, or one the events after it do not fold onto. One
    WARNING names it and what is wrong; with ``set_aside`` (callers that hold the
    run's lease, so they never move a snapshot a worker is replacing) it is moved
    to the store's quarantine, never deleted; the state is rebuilt from the events.

    ``record``: the run's record, when the caller just read it (with its lease);
    ``snapshot``: the run's snapshot as read with it (:func:`tasks.lease.holding`'s
    ``reads_snapshot``), decoded and checked here as a snapshot read here would be.

    Raises RunNotFound (no record), RunStateLost (the events cannot give a state
    either), StoreUnavailable.
    """
    if record is None:
        record = ctx.runs.get(run_id)
    if record is None:
        raise RunNotFound(run_id)
    if not whole_log:
        remembered = ctx.recall_checkpoint(record)
        if remembered is not None:
            return Loaded(record, remembered, remembered.seq, None)
    events = ctx.runs.events(run_id) if whole_log else None
    try:
        # (No read with the lease: the call every snapshot store has always taken.)
        stored = (
            ctx.snapshots.load(run_id) if snapshot is None else ctx.snapshots.load(run_id, snapshot)
        )
    except SnapshotError as exc:
        _unusable(ctx, run_id, str(exc), set_aside)
        stored = None
    if stored is not None:
        record, events, problem = _check(ctx, record, events, stored)
        if problem is None:
            loaded = _healed(ctx, record, events, stored)
            if isinstance(loaded, Loaded):
                return loaded
            problem = loaded
        _unusable(ctx, run_id, problem, set_aside)
    if events is None:
        events = ctx.runs.events(run_id)
    try:
        rebuilt = rebuild(events)
    except EventsDoNotFold as exc:
        raise RunStateLost(run_id, exc.where) from exc
    if rebuilt is None:
        raise RunStateLost(run_id, "its event log is empty")
    return Loaded(record, rebuilt, None, events)


def _healed(
    ctx: Context, record: RunRecord, events: list[Event] | None, snapshot: RunState
) -> Loaded | str:
    """The snapshot with the events it lacks folded on; what is wrong if they do not fold."""
    if events is not None:
        tail = [e for e in events if e.seq > snapshot.seq]
    elif snapshot.seq == record.last_seq:
        # Nothing follows it: the record holds the log's last seq (one write keeps both),
        # as for a remembered state (Context.recall_checkpoint). An event appended since
        # the record was read fences this reader's next write by its seq.
        tail = []
    else:
        tail = ctx.runs.events(record.run_id, after_seq=snapshot.seq)
    state = snapshot
    try:
        for event in tail:
            state = apply(state, event)
    except EventsDoNotFold as exc:
        return (
            f"{ctx.snapshots.where(record.run_id)} is at seq {snapshot.seq}, and the run's "
            f"events after it do not fold onto it ({exc.where})"
        )
    if tail:
        log.info(
            "run %s: snapshot at seq %s was stale; rebuilt to %s from events",
            record.run_id,
            snapshot.seq,
            state.seq,
        )
    return Loaded(record, state, snapshot.seq, events)


def _check(
    ctx: Context, record: RunRecord, events: list[Event] | None, snapshot: RunState
) -> tuple[RunRecord, list[Event] | None, str | None]:
    """Whether a decoded snapshot is this run's; (record, events, problem or None)."""
    where = ctx.snapshots.where(record.run_id)
    if snapshot.created_at_ms != record.created_at_ms:
        # Run ids may be reused once a finished run is purged.
        problem = (
            f"{where} is of an earlier run with this id (created at {snapshot.created_at_ms} ms, "
            f"this one at {record.created_at_ms} ms)"
        )
        return record, events, problem
    last = events[-1].seq if events else record.last_seq
    if snapshot.seq > last:
        # Read after the log: a worker may have moved the run on in between. Look again.
        fresh = ctx.runs.get(record.run_id)
        if fresh is not None and fresh.last_seq >= snapshot.seq:
            return fresh, (ctx.runs.events(record.run_id) if events is not None else None), None
        problem = (
            f"{where} is at seq {snapshot.seq}, ahead of the run's event log, which ends at "
            f"seq {last}"
        )
        return record, events, problem
    return record, events, None


def save_snapshot(
    ctx: Context, state: RunState, expected_seq: int | None, owner: str | None = None
) -> None:
    """Save ``state`` as the run's snapshot (CAS on ``expected_seq``), for a lease holder.

    A stored snapshot that cannot even be read for its seq (damaged since it was
    loaded, or never loaded: this process remembered the state) is set aside as
    :func:`load` would, and the save expects none.

    With ``owner``: a snapshot found older than ``state`` where ``expected_seq``
    was expected is a *late checkpoint of a worker that lost the run* (a save the
    snapshot store cannot fence by lease: a frozen or partitioned worker's, which
    can land long after it was sent). If ``owner`` still holds the lease and the
    log ends at ``state.seq``, it is replaced; otherwise StaleWrite stands.
    Raises StaleWrite, SnapshotTooLarge, StoreUnavailable.
    """
    try:
        _save_or_replace_late(ctx, state, expected_seq, owner)
    except SnapshotTooLarge:
        raise
    except SnapshotError as exc:
        _unusable(ctx, state.run_id, str(exc), set_aside=True, then="the checkpoint is saved anew")
        ctx.snapshots.save(state, None)


def _save_or_replace_late(
    ctx: Context, state: RunState, expected_seq: int | None, owner: str | None
) -> None:
    try:
        ctx.snapshots.save(state, expected_seq)
    except StaleWrite as exc:
        late = exc.found_seq
        if owner is None or late is None or late >= state.seq or not _holds(ctx, state, owner):
            raise
        # Whatever is stored is behind the log this owner wrote last: a prefix of the
        # run, stale, never newer. The compare-and-set against it still refuses the
        # save if yet another writer got in meanwhile.
        log.warning(
            "run %s: the snapshot at seq %s is a late checkpoint of a worker that lost the "
            "run; replacing it with seq %s",
            state.run_id,
            late,
            state.seq,
        )
        ctx.snapshots.save(state, late)


def _holds(ctx: Context, state: RunState, owner: str) -> bool:
    """Whether ``owner`` holds the run's lease and its log ends at ``state.seq``."""
    lease = ctx.runs.lease(state.run_id)
    record = ctx.runs.get(state.run_id)
    return (
        lease is not None
        and lease.owner == owner
        and record is not None
        and record.last_seq == state.seq
    )


def _unusable(
    ctx: Context,
    run_id: str,
    problem: str,
    set_aside: bool,
    then: str = "the state is rebuilt from the run's events",
) -> None:
    if not set_aside:
        log.warning(
            "run %s: %s; rebuilding the state from the run's events (left in place: the worker "
            "that holds the run moves it aside)",
            run_id,
            problem,
        )
        return
    moved = ctx.snapshots.quarantine(run_id)
    log.warning(
        "run %s: %s; %s, and %s",
        run_id,
        problem,
        f"moved it to {moved} for inspection" if moved else "it was gone when moved aside",
        then,
    )


def append_events(
    ctx: Context, state: RunState, items: list[tuple[str, dict[str, Any]]], owner: str | None
) -> RunState:
    """Append events after ``state`` (fenced by ``owner``'s lease and the seq); the new state."""
    return append_transition(ctx, state, transition(ctx, state, items), owner)


def append_transition(
    ctx: Context, before: RunState, change: Transition, owner: str | None, replicated: bool = False
) -> RunState:
    """Append ``change``, made after ``before`` (fenced as :func:`append_events`); its state.

    ``replicated``: and return once the run store's replicas hold it too
    (:meth:`~store.runs.RunStore.append_replicated`); NotReplicated when they did not
    acknowledge it in time — it is written, and committed here, all the same.
    """
    if not replicated:
        ctx.runs.append(change.record, change.events, owner)
    else:
        try:
            ctx.runs.append_replicated(change.record, change.events, owner)
        except NotReplicated:
            if ctx.observers:
                ctx.observers.committed(
                    before.status, change.state.status, change.events, change.state
                )
            raise
    if ctx.observers:  # only now, when the events are committed
        ctx.observers.committed(before.status, change.state.status, change.events, change.state)
    return change.state


class Transition(NamedTuple):
    """Events after a state, the state they produce, and its record: one write to make."""

    record: RunRecord
    state: RunState
    events: list[Event]


def transition(
    ctx: Context, state: RunState, items: list[tuple[str, dict[str, Any]]]
) -> Transition:
    """The events ``items`` after ``state``, folded; nothing is written."""
    now = ctx.runs.clock()
    events = []
    for kind, data in items:
        event = Event(seq=state.seq + 1, type=kind, at_ms=now, data=data)
        state = apply(state, event)
        events.append(event)
    lease_ms = int(ctx.settings.lease_s * 1000)
    lead_ms = int(ctx.settings.sweep_interval_s * 1000)
    due = due_after_ms(state, events[-1], now, lease_ms, lead_ms, _max_suspended_s(ctx, state))
    return Transition(RunRecord.from_state(state, now, due), state, events)


def _max_suspended_s(ctx: Context, state: RunState) -> int | None:
    """The run's ``max_suspended_s`` when it waits for a person (else None: not needed).

    When its state does not hold it, from the agent this process has loaded if its binding
    is the run's (the turn that suspends the run has just loaded it): no read of the run's
    first event for a run with no limit.
    """
    suspension = state.suspension
    if (
        suspension is None
        or not state.status.is_suspended
        or suspension.reason == RunStatus.WAITING
    ):
        return None
    if state.max_suspended_s is None:
        try:
            agent = ctx.agent(state.agent_file)
            if agent.binding == state.binding:
                return agent.spec.max_suspended_s
        except (RatchetError, OSError):
            pass  # the agent file changed or went: the run's own first event still says
    return max_suspended_s(ctx, state)


def max_suspended_s(ctx: Context, state: RunState, log: list[Event] | None = None) -> int | None:
    """The run's own ``max_suspended_s``: the limit it started with, whatever its agent file
    says now.

    Its state holds it, for a run whose ``run.created`` recorded it. Otherwise (a run an
    earlier release started, or one with no limit: its state cannot tell them apart) the
    binding document of its first event says: ``log``'s when the caller has the log, else
    read from the store.
    """
    if state.max_suspended_s is not None:
        return state.max_suspended_s
    return max_suspended_s_of(log if log is not None else ctx.runs.events(state.run_id, 0, 1))


def extended(
    ctx: Context, change: Transition, items: list[tuple[str, dict[str, Any]]]
) -> Transition:
    """``change`` with the events ``items`` after it: still one write to make."""
    more = transition(ctx, change.state, items)
    return Transition(more.record, more.state, change.events + more.events)


def commit_checkpointed(
    ctx: Context,
    before: RunState,
    change: Transition,
    owner: str,
    snapshot_seq: int | None,
    release: bool = False,
    outbox: Outbox | None = None,
) -> bool:
    """Append ``change`` after ``before``, save its state as the run's snapshot (CAS on
    ``snapshot_seq``) and, with ``release``, let the lease go: one store call when the run
    store :meth:`~store.runs.RunStore.commits_with` the snapshot store (both in one Redis),
    all of it written or none; the separate calls otherwise.

    With ``outbox`` (a store that :meth:`~store.runs.RunStore.pushes_to` the broker), its
    message goes in that one call too. Whether it went: on the separate calls it did not,
    and the caller sends it.

    A stored snapshot that cannot be read for its seq makes it the separate calls too
    (:func:`save_snapshot` moves it aside). Raises StaleWrite, LeaseLost,
    SnapshotTooLarge, StoreUnavailable.
    """
    if ctx.runs.commits_with(ctx.snapshots):
        checkpoint = Checkpoint(ctx.snapshots, change.state, snapshot_seq)
        try:
            ctx.runs.commit(change.record, change.events, owner, checkpoint, release, outbox)
        except SnapshotError as exc:
            # Raised while planning the save, before anything was written: the separate
            # calls keep the events, and move an unreadable snapshot aside (a snapshot
            # too large is refused there again, once the events are in).
            log.info("run %s: %s; writing the events and the snapshot apart", before.run_id, exc)
        else:
            if ctx.observers:
                ctx.observers.committed(
                    before.status, change.state.status, change.events, change.state
                )
            return outbox is not None
    ctx.runs.append(change.record, change.events, owner)
    if ctx.observers:
        ctx.observers.committed(before.status, change.state.status, change.events, change.state)
    save_snapshot(ctx, change.state, snapshot_seq, owner)
    if release:
        ctx.runs.release_lease(before.run_id, owner)
    return False


def commit_finished(ctx: Context, before: RunState, change: Transition, owner: str) -> None:
    """Append ``change``, which finishes the run, delete its snapshot and let the lease go:
    one store call where the run store :meth:`~store.runs.RunStore.commits_with` the
    snapshot store, the separate calls otherwise. Raises StaleWrite, LeaseLost,
    StoreUnavailable."""
    ctx.runs.commit(change.record, change.events, owner, Dropped(ctx.snapshots), release=True)
    if ctx.observers:
        ctx.observers.committed(before.status, change.state.status, change.events, change.state)


def append_ending(
    ctx: Context,
    record: RunRecord,
    kind: str,
    data: dict[str, Any],
    owner: str | None,
    stays_due: bool = False,
    parent_ended: str | None = None,
) -> RunRecord:
    """End a run by one event of :data:`runtime.endings.ENDINGS` without reading its state:
    the events and the record are :func:`runtime.endings.ending`'s (the fold's rule), fenced
    like :func:`append_events`. For a run :func:`load` raises RunStateLost on, and a cancel,
    which must not wait for a snapshot. ``stays_due``: the run stays in the due index (a
    child whose parent is not told yet). ``parent_ended``: a child whose parent (that id)
    has ended, so waits for it no more: ``run.parent_told`` is recorded with the ending.
    """
    now = ctx.runs.clock()
    end = ending(
        kind,
        data,
        last_seq=record.last_seq,
        now_ms=now,
        suspended_ms=record.suspended_ms,
        suspension=record.suspension,
        is_child=stays_due,
        parent_ended=parent_ended,
    )
    ended = record.model_copy(update=end.record_changes)
    ctx.runs.append(ended, end.events, owner)
    if ctx.observers:
        ctx.observers.committed(record.status, ended.status, end.events, None)
    return ended
