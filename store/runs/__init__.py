"""The RunStore contract: run records, the event log, the tool journal, leases.

- **Records** are what ``runs list`` and ``runs show`` display; each is written
  in the same atomic step as the events that changed it.
- **Events** are append-only with a per-run ``seq`` 1, 2, 3, … that only
  increases. ``append`` is fenced twice: the first new event must follow the
  stored last seq (else :class:`~runtime.errors.StaleWrite`), and when an
  ``owner`` is given it must hold the run's unexpired lease (else
  :class:`~runtime.errors.LeaseLost`). A zombie worker therefore cannot add a
  transition to a run another worker has taken over.
- **The tool journal** (requested → completed / failed) is the projection of
  the ``tool.*`` events, computed here once for every backend.
- **Leases** say which worker advances a run; they expire unless renewed.
- **Liveness** says which worker processes are alive: each renews a short-lived record
  (``renew_liveness``) from a thread of its own. A lease owner id names its process
  (``<process>/<attempt>``, :func:`owner_process`), so ``claim_lease`` can take a run
  at once from a holder whose process stopped renewing (a compare-and-set on that dead
  owner) while a live holder keeps its lease until it really expires, and
  ``orphaned`` lists the runs dead processes still hold — through an index of the
  leases each process holds, so its cost grows with the dead processes' runs only.
- **Retention**: ``purge(before_ms)`` deletes finished runs (completed, failed,
  cancelled, dead-lettered) last updated before ``before_ms`` — record, events
  and lease — through an index of finished runs, never a scan of every run.
- **Due times**: a live run carries ``due_at_ms``, the time by which its next
  step should have started. The sweeper asks for runs past due whose lease has
  expired; backends index it so that cost grows with the overdue runs only.

Backends: ``memory://`` (tests), ``sqlite:///path`` (embedded default),
``redis://…``. The base class validates ids and retries transient errors; a
backend implements the ``_`` primitives.
"""

from __future__ import annotations

import builtins
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pydantic import Field

from runtime.errors import NotReplicated, StaleWrite
from runtime.models import FINISHED_STATUSES as FINISHED_STATUSES  # what retention purges
from runtime.models import (
    Event,
    RunState,
    RunStatus,
    Strict,
    Suspension,
    Usage,
    validate_run_id,
)
from store.clock import ClockReading, StoreClock
from store.clock import wall_ms as wall_ms  # re-exported: tasks and tests import it here
from store.live import LiveStream
from store.replicas import ReplicaWait
from store.retry import with_retries
from store.snapshots import Parts, Prefetched, SnapshotStore, TranscriptMoved, TranscriptTip


class RunRecord(Strict):
    """A run as operators list and show it; derived from its state at each append."""

    run_id: str
    agent: str
    agent_file: str
    status: RunStatus
    created_at_ms: int
    updated_at_ms: int
    last_seq: int
    input: str
    output: str | None = None
    error: str | None = None
    usage: Usage = Usage()
    budgets: dict[str, Any] = Field(default_factory=dict)
    suspended_ms: int = 0
    recovery_attempts: int = 0
    due_at_ms: int | None = None
    """When the sweeper next looks at the run (the due index); None: never.

    The caller decides (:func:`runtime.recovery.sweep_due_ms`): the store keeps it.
    """
    suspension: Suspension | None = None
    """Suspended runs only: what the run waits for, and since when."""

    @property
    def finished(self) -> bool:
        """The run will not move again: retention (:meth:`RunStore.purge`) may remove it."""
        return self.status in FINISHED_STATUSES

    @classmethod
    def from_state(cls, state: RunState, now_ms: int, due_at_ms: int | None) -> RunRecord:
        return cls(
            run_id=state.run_id,
            agent=state.agent,
            agent_file=state.agent_file,
            status=state.status,
            created_at_ms=state.created_at_ms,
            updated_at_ms=now_ms,
            last_seq=state.seq,
            input=state.input,
            output=state.output,
            error=state.error,
            usage=state.usage,
            budgets=state.budgets.model_dump(mode="json"),
            suspended_ms=state.suspended_ms,
            recovery_attempts=state.recovery_attempts,
            due_at_ms=due_at_ms,
            suspension=state.suspension if state.status.is_suspended else None,
        )


class JournalEntry(Strict):
    """One tool call as the journal knows it."""

    call_id: str
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    status: str
    """`requested` (outcome unknown), `completed`, `failed`, or `unsent` (it never reached its
    server; a resume requests it again)."""
    requested_seq: int
    requested_at_ms: int
    result: Any = None
    error: str | None = None


class Lease(Strict):
    owner: str
    expires_at_ms: int


PROCESS_SEPARATOR = "/"
"""Between a lease owner id's process and its attempt: ``host:pid:token/attempt``."""


def owner_process(owner: str) -> str | None:
    """The process a lease owner id names (``host:pid:token`` of ``host:pid:token/attempt``);
    None for an owner id that names none, whose leases only ever expire."""
    process, separator, attempt = owner.rpartition(PROCESS_SEPARATOR)
    return process if separator and process and attempt else None


class Claim(NamedTuple):
    """What :meth:`RunStore.claim_lease` did."""

    taken: bool
    holder: str | None = None
    """Refused: the owner that holds the lease."""
    holder_alive_until_ms: int | None = None
    """Refused: when the holder's process stops counting as alive, if it keeps a record."""
    took_from: str | None = None
    """Taken from a holder whose process was dead (its liveness lapsed): that owner."""

    @staticmethod
    def decide(
        held: Lease | None, owner: str, now_ms: int, alive_until: Callable[[str], int | None]
    ) -> Claim:
        """The rule of :meth:`RunStore.claim_lease`, for a backend that reads the lease
        ``held`` and then writes ``owner``'s in one atomic step if the claim is ``taken``.

        ``alive_until(process)``: when that process's liveness record expires (ms), or
        None if it keeps none (then its leases only ever expire).
        """
        if held is None or held.owner == owner or held.expires_at_ms <= now_ms:
            return Claim(True)
        holder = owner_process(held.owner)
        until = alive_until(holder) if holder is not None else None
        if until is None or until > now_ms:
            return Claim(False, held.owner, until)
        return Claim(True, took_from=held.owner)


class Orphan(NamedTuple):
    """A run whose unexpired lease is held by a process that is no longer alive."""

    run_id: str
    owner: str


class Checkpoint(NamedTuple):
    """A snapshot save that rides on a transition (:meth:`RunStore.commit`)."""

    store: SnapshotStore
    state: RunState
    expected_seq: int | None
    """The stored snapshot's seq (compare-and-set); None: none is stored."""


class Dropped(NamedTuple):
    """The run's snapshot deleted with a transition (:meth:`RunStore.commit`): the run
    finished, so its snapshot has served its purpose (the events stay)."""

    store: SnapshotStore


class Outbox(NamedTuple):
    """A message that rides on a transition (:meth:`RunStore.commit`): pushed onto a list
    of another database of the store's own server if, and only if, the transition is
    written. The store does not read it: the bytes are the broker's entry as they are."""

    db: int
    """The database the list is in."""
    key: str
    """The list (LPUSH): a broker queue's name, with its priority suffix."""
    payload: bytes


class Transition(NamedTuple):
    """One transition as :meth:`RunStore._commit` writes it, atomically: the events
    and record, the snapshot's parts, and with ``release`` the lease let go."""

    record: RunRecord
    events: builtins.list[Event]
    owner: str | None
    snapshots: SnapshotStore
    parts: Parts | None
    """None: the snapshot is deleted (:class:`Dropped`)."""
    expected_seq: int | None
    """The stored snapshot's seq (compare-and-set); None: none is stored."""
    release: bool
    outbox: Outbox | None = None


def checked_batch(record: RunRecord, events: Sequence[Event]) -> builtins.list[Event]:
    validate_run_id(record.run_id)
    return _contiguous(record, events)


def _contiguous(record: RunRecord, events: Sequence[Event]) -> builtins.list[Event]:
    """:func:`checked_batch` for a call that has checked ``record.run_id`` already."""
    if not events:
        raise ValueError("append needs at least one event")
    for before, after in zip(events, events[1:], strict=False):
        if after.seq != before.seq + 1:
            raise ValueError(f"events must be contiguous: {before.seq} then {after.seq}")
    if record.last_seq != events[-1].seq:
        raise ValueError("the record's last_seq must be the last event's seq")
    return list(events)


class RunStore(ABC):
    """Contract every run-store backend passes (see tests/contract/)."""

    name: str = "run store"

    clock_source = "this host's clock"
    """Whose clock the store's is; a backend with a clock of its own names it."""

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        """``clock``: milliseconds now, for leases, liveness and deadlines (default: the
        store's clock, :class:`store.clock.StoreClock`; a test may inject its own)."""
        self.clock: Callable[[], int] = clock or StoreClock(self._server_ms, self.clock_source)

    def measure_clock(self) -> ClockReading | None:
        """Measure the store's clock against this host's now, and decide on it from now on.

        None when the clock was injected (a test's). StoreUnavailable if the store
        cannot be reached.
        """
        if not isinstance(self.clock, StoreClock):
            return None
        return self.clock.measure()

    def _server_ms(self) -> int | None:
        """The store's own clock in ms; None: it has none (it lives on this host)."""
        return None

    # --- records and events -------------------------------------------------

    def create(self, record: RunRecord, first: Event) -> None:
        """Insert a new run with its first event; StaleWrite if the id exists."""
        validate_run_id(record.run_id)
        if first.seq != 1 or first.type != "run.created" or record.last_seq != 1:
            raise ValueError("a run is created with its run.created event at seq 1")
        try:
            with_retries(lambda: self._create(record, first), record.run_id)
        except StaleWrite:
            if self._events(record.run_id, 0, 1) != [first]:
                raise

    def append(self, record: RunRecord, events: Sequence[Event], owner: str | None) -> None:
        """Append ``events`` and replace the record, atomically.

        Refused with StaleWrite unless ``events[0].seq`` follows the stored last
        seq, and with LeaseLost if ``owner`` is given and does not hold the lease.
        """
        mine = checked_batch(record, events)
        try:
            with_retries(lambda: self._append(record, mine, owner, self.clock()), record.run_id)
        except StaleWrite as exc:
            if not self._landed(exc, mine):
                raise

    replica_wait = ReplicaWait()
    """What :meth:`append_replicated` waits for: nothing, unless the store's URL asks
    (``min_replicas`` on a Redis URL, store/replicas.py)."""

    def append_replicated(
        self, record: RunRecord, events: Sequence[Event], owner: str | None
    ) -> None:
        """:meth:`append`, returning once as many replicas as the store requires hold the
        events too: the journal a call that is not idempotent starts after, so that no
        failover can lose it and run the call again. A store that requires none — every
        backend, unless a Redis URL says ``min_replicas`` — just appends: no extra command.

        Raises what :meth:`append` does, and NotReplicated when fewer replicas
        acknowledged within the bound (or the attempt that wrote it lost its reply, and
        with it the count): the events are written all the same, on the primary alone —
        start nothing they journal.
        """
        wait = self.replica_wait
        if wait.min_replicas == 0:
            self.append(record, events, owner)
            return
        mine = checked_batch(record, events)
        acked: int | None
        try:
            acked = with_retries(
                lambda: self._append_waiting(record, mine, owner, self.clock()), record.run_id
            )
        except StaleWrite as exc:
            if not self._landed(exc, mine):
                raise
            acked = None
        if acked is None or acked < wait.min_replicas:
            raise NotReplicated(
                record.run_id, self.shown(), acked, wait.min_replicas, wait.timeout_ms
            )

    def _append_waiting(
        self,
        record: RunRecord,
        events: builtins.list[Event],
        owner: str | None,
        now_ms: int,
    ) -> int:
        """Backends with replicas: :meth:`_append`, then wait up to ``replica_wait.timeout_ms``
        for ``replica_wait.min_replicas`` replicas to acknowledge it (and every write before
        it); how many did."""
        raise NotImplementedError(f"{self.name} has no replicas to wait for")

    def shown(self) -> str:
        """The store as a message names it (never with a password)."""
        return self.name

    def _landed(self, exc: StaleWrite, mine: builtins.list[Event]) -> bool:
        """A retry whose first attempt landed (reply lost) finds its own events."""
        return exc.found_seq == mine[-1].seq and (
            self._events(exc.run_id, mine[0].seq - 1, len(mine)) == mine
        )

    # --- a transition in one call: events, snapshot, lease ------------------

    def commits_with(self, snapshots: SnapshotStore) -> bool:
        """Whether :meth:`commit` writes ``snapshots``' snapshot in the same atomic call.

        A capability: a backend that keeps events and snapshots in one place (the
        Redis run store with a Redis snapshot store on the same server and prefix)
        overrides this and :meth:`_commit`. Otherwise ``commit`` makes the separate
        calls each contract already promises.
        """
        del snapshots
        return False

    def pushes_to(self, server: dict[str, Any]) -> bool:
        """Whether :meth:`commit` can push an :class:`Outbox` message to ``server`` (a
        redis-py client's connection kwargs): a capability of a store on that very server.
        """
        del server
        return False

    def commit(
        self,
        record: RunRecord,
        events: Sequence[Event],
        owner: str | None,
        checkpoint: Checkpoint | Dropped | None = None,
        release: bool = False,
        outbox: Outbox | None = None,
    ) -> None:
        """One transition: :meth:`append` the events, save ``checkpoint`` (or, for a run
        that finished, delete its snapshot: :class:`Dropped`), and with ``release`` let
        ``owner``'s lease go; with ``outbox``, push its message as well, in
        the same atomic call (only where :meth:`pushes_to` and :meth:`commits_with` the
        checkpoint's store: ValueError otherwise, before anything is written).

        The fences are those of the separate calls: the events' seq and the lease
        (StaleWrite, LeaseLost), the snapshot's compare-and-set on seq (StaleWrite).
        When :meth:`commits_with` the checkpoint's store, it is one atomic call,
        all written or nothing; else the calls in that order (the events first:
        they are the truth, a snapshot only a shortcut).
        """
        run_id = validate_run_id(record.run_id)
        if outbox is not None and (
            checkpoint is None
            or not self.commits_with(checkpoint.store)
            or type(self).pushes_to is RunStore.pushes_to
        ):
            raise ValueError(f"{self.name} cannot push an outbox message with this transition")
        if isinstance(checkpoint, Dropped):
            if outbox is not None:
                raise ValueError("a finished run's transition chains no turn")
            self._commit_dropped(record, events, owner, checkpoint.store, release)
            return
        if checkpoint is None or not self.commits_with(checkpoint.store):
            self.append(record, events, owner)
            if checkpoint is not None:
                checkpoint.store.save(checkpoint.state, checkpoint.expected_seq)
            if release and owner is not None:
                self.release_lease(run_id, owner)
            return
        mine = _contiguous(record, events)
        snapshots, state, expected_seq = checkpoint
        if state.run_id != run_id or state.seq != record.last_seq:
            raise ValueError("a transition's checkpoint is the state its last event produced")
        for _ in range(2):
            parts = snapshots.plan_save(state, expected_seq)
            whole = Transition(record, mine, owner, snapshots, parts, expected_seq, release, outbox)
            try:
                with_retries(functools.partial(self._commit_now, whole), run_id)
            except TranscriptMoved:
                snapshots.forget_transcript(run_id)
                continue
            except StaleWrite as exc:
                snapshots.forget_transcript(run_id)
                # Our own transition, landed by an attempt whose reply was lost, is
                # written whole: the snapshot and the release with the events.
                if not self._landed(exc, mine):
                    raise
            snapshots.planned_save_written(state, parts)
            return
        raise StaleWrite(run_id, expected_seq, expected_seq)

    def _commit_dropped(
        self,
        record: RunRecord,
        events: Sequence[Event],
        owner: str | None,
        snapshots: SnapshotStore,
        release: bool,
    ) -> None:
        """:meth:`commit` with :class:`Dropped`: the events, the snapshot's deletion and the
        release, in one atomic call where :meth:`commits_with` ``snapshots``."""
        run_id = record.run_id
        if not self.commits_with(snapshots):
            self.append(record, events, owner)
            snapshots.delete(run_id)
            if release and owner is not None:
                self.release_lease(run_id, owner)
            return
        mine = _contiguous(record, events)  # (commit checked the run id)
        snapshots.forget_transcript(run_id)
        whole = Transition(record, mine, owner, snapshots, None, None, release)
        try:
            with_retries(functools.partial(self._commit_now, whole), run_id)
        except StaleWrite as exc:
            # Our own transition, landed by an attempt whose reply was lost: written whole.
            if not self._landed(exc, mine):
                raise

    def _commit_now(self, whole: Transition) -> None:
        self._commit(whole, self.clock())

    def _commit(self, whole: Transition, now_ms: int) -> None:
        """Backends that :meth:`commits_with` a snapshot store: the whole transition, atomically.

        Refuse it all with StaleWrite (the events' seq, or the snapshot's seq:
        ``StaleWrite(run_id, expected_seq, found)``), LeaseLost, or TranscriptMoved
        (as :meth:`SnapshotStore._put_parts`).
        """
        raise NotImplementedError(f"{self.name} does not commit snapshots")

    def get(self, run_id: str) -> RunRecord | None:
        run_id = validate_run_id(run_id)
        return with_retries(lambda: self._get(run_id), run_id)

    def list(self, status: RunStatus | None = None, limit: int = 100) -> builtins.list[RunRecord]:
        """Runs, newest first, optionally of one status."""
        if limit < 0:
            raise ValueError(f"limit must be 0 or more, not {limit}")
        return with_retries(lambda: self._list(status, limit))

    def events(
        self, run_id: str, after_seq: int = 0, limit: int | None = None
    ) -> builtins.list[Event]:
        """The run's events with seq > ``after_seq``, in seq order."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be 0 or more, not {limit}")
        run_id = validate_run_id(run_id)
        return with_retries(lambda: self._events(run_id, after_seq, limit), run_id)

    def journal(self, run_id: str) -> builtins.list[JournalEntry]:
        """The run's tool calls, in the order they were requested."""
        entries: dict[str, JournalEntry] = {}
        for event in self.events(run_id):
            data = event.data
            if event.type == "tool.requested":
                entries[data["call_id"]] = JournalEntry(
                    call_id=data["call_id"],
                    tool=data["name"],
                    arguments=data.get("arguments", {}),
                    status="requested",
                    requested_seq=event.seq,
                    requested_at_ms=event.at_ms,
                )
            elif (
                event.type == "tool.probed"
                and data.get("answer") == "ran"
                and data["call_id"] in entries
            ):
                # The call's probe found its effect: that is its outcome (runtime/probes.py).
                entries[data["call_id"]] = entries[data["call_id"]].model_copy(
                    update={"status": "completed", "result": data.get("result")}
                )
            elif event.type == "tool.unsent" and data["call_id"] in entries:
                entries[data["call_id"]] = entries[data["call_id"]].model_copy(
                    update={"status": "unsent", "error": data.get("reason")}
                )
            elif event.type in ("tool.completed", "tool.failed") and data["call_id"] in entries:
                done = event.type == "tool.completed"
                entries[data["call_id"]] = entries[data["call_id"]].model_copy(
                    update={
                        "status": "completed" if done else "failed",
                        "result": data.get("result") if done else None,
                        "error": None if done else data.get("error"),
                    }
                )
        return list(entries.values())

    # --- leases -------------------------------------------------------------

    def acquire_lease(self, run_id: str, owner: str, lease_s: float) -> bool:
        """Take (or renew) the run's lease for ``lease_s``; False if another owner holds it."""
        run_id = validate_run_id(run_id)
        return with_retries(
            lambda: self._acquire(run_id, owner, int(lease_s * 1000), self.clock()), run_id
        )

    def renew_leases(self, leases: Sequence[tuple[str, str]], lease_s: float) -> builtins.list[str]:
        """Extend many ``(run_id, owner)`` leases to ``lease_s`` from now, at once; the runs
        whose lease the owner no longer holds (lost: that turn must stop).

        A lease is extended only while its owner still holds it — even past its
        expiry, as long as nobody took it since — and never taken afresh: a renewal
        that arrives after the turn released its lease must not hold the run
        against the next turn. One heartbeat round of a worker with a thousand
        turns in flight is one call: a backend that can renews them in one round
        trip (Redis: one pipeline; SQLite: one transaction). Idempotent, so a retry
        after a lost reply renews again, harmlessly.
        """
        checked = [(validate_run_id(run_id), owner) for run_id, owner in leases]
        if not checked:
            return []
        lease_ms = int(lease_s * 1000)
        taken = with_retries(lambda: self._renew(checked, lease_ms, self.clock()))
        return [run_id for (run_id, _), held in zip(checked, taken, strict=True) if not held]

    def acquire_and_get(
        self, run_id: str, owner: str, lease_s: float
    ) -> tuple[bool, RunRecord | None]:
        """:meth:`acquire_lease`, and when taken the run's record: one call where the backend can.

        ``(False, None)`` if another owner holds the lease; ``(True, None)`` if the
        lease is taken but the run has no record.
        """
        run_id = validate_run_id(run_id)
        lease_ms = int(lease_s * 1000)
        return with_retries(
            lambda: self._acquire_and_get(run_id, owner, lease_ms, self.clock()), run_id
        )

    def _acquire_and_get(
        self, run_id: str, owner: str, lease_ms: int, now_ms: int
    ) -> tuple[bool, RunRecord | None]:
        if not self._acquire(run_id, owner, lease_ms, now_ms):
            return False, None
        return True, self._get(run_id)

    def reads_with(self, snapshots: SnapshotStore) -> bool:
        """Whether :meth:`acquire_and_read` reads ``snapshots``' snapshot in the same call.

        A capability, like :meth:`commits_with`: a backend that keeps the snapshot beside
        the lease (the Redis run store with a Redis snapshot store on the same server and
        prefix) overrides this and :meth:`_acquire_and_read`.
        """
        del snapshots
        return False

    def acquire_and_read(
        self,
        run_id: str,
        owner: str,
        lease_s: float,
        snapshots: SnapshotStore,
        unless_at: int | None = None,
    ) -> tuple[bool, RunRecord | None, Prefetched | None]:
        """:meth:`acquire_and_get`, and when taken the run's snapshot as ``snapshots`` would
        read it first (:meth:`SnapshotStore.read_base`): one round trip when
        :meth:`reads_with` it, for :meth:`SnapshotStore.load` to decode. Else, or when
        not taken, or when the run's log ends at seq ``unless_at`` (the caller remembers
        its state there), the read is ``None`` and ``load`` reads the snapshot itself if
        it needs it.
        """
        if not self.reads_with(snapshots):
            return (*self.acquire_and_get(run_id, owner, lease_s), None)
        run_id = validate_run_id(run_id)
        lease_ms = int(lease_s * 1000)
        base = snapshots.read_base(run_id)
        return with_retries(
            lambda: self._acquire_and_read(
                run_id, owner, lease_ms, self.clock(), snapshots, base, unless_at
            ),
            run_id,
        )

    def acquire_and_append(
        self,
        run_id: str,
        owner: str,
        lease_s: float,
        snapshots: SnapshotStore,
        was: RunRecord,
        record: RunRecord,
        events: Sequence[Event],
    ) -> tuple[bool, RunRecord | None, Prefetched | None, bool]:
        """:meth:`acquire_and_read` (its ``unless_at`` is ``was``'s last seq), and when the
        lease is taken and the run's record is still exactly ``was`` — the record a caller
        remembers writing, so no other run has had this id since — :meth:`append`
        ``events`` and ``record`` under that lease: a turn whose first write it already
        knows (tasks/ahead.py). One round trip where the backend sends both at once (Redis).

        Returns ``(taken, record, snapshot, appended)``: appended, the record is ``record``
        and there is no snapshot read; else as :meth:`acquire_and_read` returns, the record
        as found.
        """
        taken, found, snapshot = self.acquire_and_read(
            run_id, owner, lease_s, snapshots, was.last_seq
        )
        if not taken or found != was:
            return taken, found, snapshot, False
        try:
            self.append(record, events, owner)
        except StaleWrite:
            return True, self.get(run_id), None, False  # ended meanwhile (a cancel)
        return True, record, None, True

    def _acquire_and_read(
        self,
        run_id: str,
        owner: str,
        lease_ms: int,
        now_ms: int,
        snapshots: SnapshotStore,
        base: TranscriptTip | None,
        unless_at: int | None,
    ) -> tuple[bool, RunRecord | None, Prefetched | None]:
        """Backends that :meth:`reads_with` a snapshot store: :meth:`_acquire_and_get` and,
        when taken and the record's last seq is not ``unless_at``, the stored snapshot (the
        fragments after ``base``; None: all), atomically."""
        raise NotImplementedError(f"{self.name} does not read snapshots")

    def release_lease(self, run_id: str, owner: str) -> None:
        """Give the lease up if ``owner`` holds it, so another worker need not wait."""
        run_id = validate_run_id(run_id)
        with_retries(lambda: self._release(run_id, owner), run_id)

    def lease(self, run_id: str) -> Lease | None:
        """The run's unexpired lease, if any."""
        run_id = validate_run_id(run_id)
        return with_retries(lambda: self._lease(run_id, self.clock()), run_id)

    def claim_lease(self, run_id: str, owner: str, lease_s: float) -> Claim:
        """Take (or renew) the run's lease as :meth:`acquire_lease` does, and also take it
        from a holder whose process is dead; record it under ``owner``'s process.

        A holder is dead when its process (:func:`owner_process`) keeps a liveness
        record and that record has expired: the take-over is a compare-and-set on
        that dead owner, in the same atomic step as the check. A holder whose process
        is alive, or keeps no record (an owner id naming no process, a process that
        never beat), keeps the lease until it expires. The zombie's writes are fenced
        like any lease holder's that lost its lease.
        """
        run_id = validate_run_id(run_id)
        process = owner_process(owner)
        return with_retries(
            lambda: self._claim(run_id, owner, process, int(lease_s * 1000), self.clock()), run_id
        )

    def renew_liveness(self, process: str, alive_s: float) -> bool:
        """Record ``process`` alive for ``alive_s`` from now; whether it still was (False on
        its first beat, and when its record had lapsed: it may have been declared dead)."""
        if not process or PROCESS_SEPARATOR in process:
            raise ValueError(f"a process id is not empty and has no {PROCESS_SEPARATOR!r}")
        now_ms = self.clock()
        return with_retries(lambda: self._beat(process, now_ms + int(alive_s * 1000), now_ms))

    def liveness(self, process: str) -> int | None:
        """When ``process``'s liveness record expires (ms), or None if it keeps none."""
        return with_retries(lambda: self._liveness(process))

    def orphaned(self, limit: int = 1000) -> builtins.list[Orphan]:
        """Runs whose unexpired lease is held by a dead process (its liveness lapsed).

        Reads the dead processes and the leases each one recorded (claim_lease), so the
        cost grows with the dead processes and their runs, never with every run or the
        suspended ones. Housekeeping on the way: a dead process that holds no unexpired
        lease any more is forgotten (its record deleted; nothing refers to it).
        """
        if limit < 1:
            raise ValueError(f"limit must be 1 or more, not {limit}")
        return with_retries(lambda: self._orphaned(self.clock(), limit))

    def postpone(self, run_id: str, seen_seq: int, due_at_ms: int) -> bool:
        """Move a live run's due time to ``due_at_ms`` if it is still at ``seen_seq``; whether
        it did. The sweeper calls it for each run it enqueued a resume for, so the next
        sweeps do not enqueue the same resume again while that one waits in a queue.

        Only the due index moves (and what ``overdue`` reads); a run that moved on since
        ``seen_seq``, or is not in the due index, is left as it is.
        """
        run_id = validate_run_id(run_id)
        return with_retries(lambda: self._postpone(run_id, seen_seq, due_at_ms), run_id)

    def overdue(self, limit: int = 1000) -> builtins.list[str]:
        """Live runs past their due time whose lease has expired, most overdue first."""
        return with_retries(lambda: self._overdue(self.clock(), limit))

    def purge(
        self,
        before_ms: int,
        limit: int = 1000,
        forget: Callable[[str], None] | None = None,
    ) -> int:
        """Delete up to ``limit`` finished runs last updated before ``before_ms``; how many.

        Destructive: the record, events and lease of each go together, and the run
        leaves every index (list, by status, overdue). Live, suspended and parked
        runs are never touched. ``forget`` is called with each purged run id (the
        sweeper deletes a dead-lettered run's snapshot with it).
        """
        if isinstance(before_ms, bool) or not isinstance(before_ms, int) or before_ms < 0:
            raise ValueError(f"before_ms must be a time in ms since the epoch, not {before_ms!r}")
        if limit < 1:
            raise ValueError(f"limit must be 1 or more, not {limit}")
        purged = with_retries(lambda: self._purge(before_ms, limit))
        for run_id in purged:
            if forget is not None:
                forget(run_id)
        return len(purged)

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections; the store is not used afterwards."""

    def live(self) -> LiveStream | None:
        """Where the runs' live streams go (store/live): deltas and tool progress, beside
        the event log; None when this backend keeps none (observers see events only)."""
        return None

    # --- primitives ---------------------------------------------------------

    @abstractmethod
    def _create(self, record: RunRecord, first: Event) -> None: ...

    @abstractmethod
    def _append(
        self, record: RunRecord, events: builtins.list[Event], owner: str | None, now_ms: int
    ) -> None: ...

    @abstractmethod
    def _get(self, run_id: str) -> RunRecord | None: ...

    @abstractmethod
    def _list(self, status: RunStatus | None, limit: int) -> builtins.list[RunRecord]: ...

    @abstractmethod
    def _events(self, run_id: str, after_seq: int, limit: int | None) -> builtins.list[Event]: ...

    @abstractmethod
    def _acquire(self, run_id: str, owner: str, lease_ms: int, now_ms: int) -> bool: ...

    def _renew(
        self, leases: builtins.list[tuple[str, str]], lease_ms: int, now_ms: int
    ) -> builtins.list[bool]:
        """One extend per lease, in order; a backend with round trips to save overrides it."""
        return [self._extend(run_id, owner, lease_ms, now_ms) for run_id, owner in leases]

    @abstractmethod
    def _extend(self, run_id: str, owner: str, lease_ms: int, now_ms: int) -> bool:
        """Set the lease to expire at ``now_ms + lease_ms`` if ``owner`` holds it; whether it did."""

    @abstractmethod
    def _release(self, run_id: str, owner: str) -> None: ...

    @abstractmethod
    def _lease(self, run_id: str, now_ms: int) -> Lease | None: ...

    @abstractmethod
    def _overdue(self, now_ms: int, limit: int) -> builtins.list[str]: ...

    @abstractmethod
    def _postpone(self, run_id: str, seen_seq: int, due_at_ms: int) -> bool: ...

    @abstractmethod
    def _claim(
        self, run_id: str, owner: str, process: str | None, lease_ms: int, now_ms: int
    ) -> Claim:
        """Atomically: take the lease if free, expired, ``owner``'s, or held by an owner
        whose process's record expired (``took_from``); index it under ``process``."""

    @abstractmethod
    def _beat(self, process: str, expires_at_ms: int, now_ms: int) -> bool:
        """Set the process's liveness expiry; whether the old one was after ``now_ms``."""

    @abstractmethod
    def _liveness(self, process: str) -> int | None: ...

    @abstractmethod
    def _orphaned(self, now_ms: int, limit: int) -> builtins.list[Orphan]: ...

    @abstractmethod
    def _purge(self, before_ms: int, limit: int) -> builtins.list[str]:
        """Delete finished runs with updated_at_ms < before_ms, oldest first; their ids."""
