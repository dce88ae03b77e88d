"""The SnapshotStore contract: one snapshot per run, overwritten on each save.

The base class does the work once — run id validation, encoding, the 16 MiB
limit, retries of transient errors, decoding with kind/version checks — and a
backend implements four primitives: ``_put``, ``_get``, ``_delete``, ``_list``.

``save`` is a compare-and-set on the run's seq: it is refused with
:class:`~runtime.errors.StaleWrite` unless the stored snapshot's seq is
``expected_seq`` (``None``: no snapshot stored). A worker that lost its lease
and woke up late can therefore never overwrite a newer snapshot.

Backends: ``memory://`` (tests), ``file:///dir`` (embedded default),
``redis://…``, ``s3://bucket/prefix`` (extra ``ratchet[s3]``).

**Appending backends** (redis, s3) keep the bytes a save writes flat as the
transcript grows: they set ``appends_transcript`` and store a *head* (the
document with an empty transcript) plus the transcript's messages, appending
only the new ones (see :mod:`store.snapshots.format`). The base class plans
the write — which messages are new, the hash chain that proves the stored
transcript is a prefix of the new one, the full document's size against the
limit — so such a backend implements ``_put_parts``, ``_read_tip`` and
``_read`` instead of ``_put`` for saves. ``load_document`` still returns the
document byte-identical to :func:`~store.snapshots.format.encode`.

**A save written by another store's transaction** (a run store that
``commits_with`` this one writes the events, the snapshot and the lease's release
at once): the run store asks :meth:`SnapshotStore.plan_save` for the parts,
writes them, and tells this store the outcome, once: ``planned_save_written``, or
``forget_transcript`` when the write was refused, the transcript moved, or the
outcome is unknown. That is all a run store uses of this one
(``SnapshotTransactionContract`` in store/conformance/snapshots.py tests it).
"""

from __future__ import annotations

import builtins
import functools
import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import cast

from runtime import json_values
from runtime.errors import SnapshotMalformed, SnapshotTooLarge, StaleWrite
from runtime.models import Message, RunState, validate_run_id
from store.retry import with_retries
from store.snapshots import format as snapshot_format

log = logging.getLogger(__name__)

KNOWN_RUNS = 64
"""Runs whose last loaded or saved transcript a store remembers, to find the new messages."""


@dataclass(frozen=True)
class TranscriptTip:
    """What an appending backend holds of a run's transcript."""

    length: int
    """Messages stored."""
    size: int
    """Bytes of their fragments, for the document's size without assembling it."""
    chain: str
    """Hash chain over the fragments (:func:`~store.snapshots.format.chain`)."""


EMPTY_TIP = TranscriptTip(0, 0, snapshot_format.GENESIS)


@dataclass(frozen=True)
class Parts:
    """One planned save of an appending backend."""

    seq: int
    head: bytes
    """The document with an empty transcript."""
    base: TranscriptTip | None
    """The stored transcript this save appends to; ``None``: replace it whole."""
    fragments: tuple[bytes, ...]
    """The messages after ``base`` (all of them when replacing)."""
    tip: TranscriptTip
    """The transcript once written."""
    transcript: tuple[Message, ...] = field(default=(), repr=False, compare=False)
    """The whole transcript saved, for a backend that rewrites earlier messages together
    with the new ones (S3's compaction): :meth:`fragments_from`."""

    def fragments_from(self, start: int) -> tuple[bytes, ...]:
        """The encoded messages from index ``start`` to the end: the stored ones from
        ``start`` (encoded again, at the cost of one encoding each) and then ``fragments``."""
        stored = len(self.transcript) - len(self.fragments)
        if not 0 <= start <= stored:
            raise ValueError(f"messages from {start}: this save holds {stored} stored before")
        again = self.transcript[start:stored]
        return tuple(snapshot_format.encode_fragment(m) for m in again) + self.fragments


@dataclass(frozen=True)
class Prefetched:
    """A read of a run's stored snapshot made inside another store's call (the lease's:
    :meth:`store.runs.RunStore.acquire_and_read`), for :meth:`SnapshotStore.load` to
    decode in place of the read it would make: one round trip fewer per turn.

    Made by the snapshot store's backend from the other store's reply; ``load`` uses it
    only where it would have read exactly that (after the same transcript tip), so what
    it returns and refuses is what it would without it.
    """

    run_id: str
    base: TranscriptTip | None
    """The transcript tip the fragments were read after (:meth:`SnapshotStore.read_base`);
    None: the whole snapshot was read."""
    parsed: Callable[[], object]
    """The reply as the backend's ``_read_after(run_id, base)`` (``base`` set) or ``_read``
    (appending backends) or ``_get`` returns it, raising as they do."""


class TranscriptMoved(Exception):
    """The stored seq is the expected one but its transcript is not ``Parts.base``.

    Only a run deleted and started afresh under the same id gets here; the base
    class re-plans from what is stored. Never leaves the store.
    """


@dataclass(frozen=True)
class _Known:
    seq: int
    transcript: tuple[Message, ...]
    tip: TranscriptTip


def _chains_to(new: Sequence[Message], tip: TranscriptTip) -> bool:
    """``new`` starts with the transcript ``tip`` describes (costs an encoding of that prefix)."""
    if len(new) < tip.length:
        return False
    prefix = (snapshot_format.encode_fragment(m) for m in new[: tip.length])
    return snapshot_format.chain(snapshot_format.GENESIS, prefix) == tip.chain


def _extends(new: tuple[Message, ...], old: tuple[Message, ...]) -> bool:
    # Messages are frozen and a state grows by `transcript + (message,)`: tuple
    # equality compares items by identity first, so this costs a pointer walk in C,
    # and falls back to field equality only for a state rebuilt from events.
    return len(new) >= len(old) and new[: len(old)] == old


_last_save = threading.local()
"""Per thread: bytes written by the last successful save (any store), for metrics."""


class SnapshotStore(ABC):
    """Contract every snapshot backend passes (see tests/contract/)."""

    max_bytes: int = snapshot_format.MAX_BYTES
    name: str = "snapshot store"
    appends_transcript: bool = False
    """The backend implements ``_put_parts``/``_read_tip``/``_read``: saves write only new messages."""

    def __init__(self) -> None:
        # Appending backends only: the transcript last loaded or saved per run, so
        # that a save finds its new messages without reading the store first.
        self._known_lock = threading.Lock()
        self._known_runs: OrderedDict[str, _Known] = OrderedDict()

    @property
    def last_save_bytes(self) -> int | None:
        """Bytes the calling thread's last successful save wrote (for metrics); None before one."""
        saved: int | None = getattr(_last_save, "nbytes", None)
        return saved

    def save(self, state: RunState, expected_seq: int | None) -> None:
        """Store ``state`` as the run's snapshot if the stored one has seq ``expected_seq``.

        Raises StaleWrite (CAS lost), SnapshotTooLarge, or StoreUnavailable after
        bounded retries. A failed save leaves the previous snapshot intact.
        """
        run_id = validate_run_id(state.run_id)
        if self.appends_transcript:
            self._save_parts(run_id, state, expected_seq)
            return
        data = snapshot_format.encode(state, self.max_bytes)
        try:
            with_retries(lambda: self._put(run_id, state, data, expected_seq), run_id)
        except StaleWrite as exc:
            # A retried write whose first attempt landed but whose reply was lost finds
            # its own document: that is success, not a conflict.
            if exc.found_seq != state.seq or self._get(run_id) != data:
                raise
        _last_save.nbytes = len(data)

    def load(self, run_id: str, prefetched: Prefetched | None = None) -> RunState | None:
        """The run's snapshot, or ``None`` if it has none.

        ``prefetched``: the stored snapshot as another store's call just read it
        (:meth:`read_base` said what to read); decoded instead of read again where it is
        what this would read, and read again where not.
        """
        run_id = validate_run_id(run_id)
        if prefetched is not None and prefetched.run_id != run_id:
            raise ValueError(f"a read of run {prefetched.run_id}'s snapshot, not {run_id}'s")
        tip: TranscriptTip | None = None
        if self.appends_transcript:
            known = self._known(run_id)
            if known is not None:
                after = (
                    prefetched if prefetched is not None and prefetched.base == known.tip else None
                )
                grown = self._load_after(run_id, known, after)
                if grown is not None:
                    return grown
        whole = prefetched if prefetched is not None and prefetched.base is None else None
        try:
            if self.appends_transcript:
                found = cast(
                    "tuple[bytes, TranscriptTip | None] | None",
                    whole.parsed()
                    if whole is not None
                    else with_retries(lambda: self._read(run_id), run_id),
                )
                if found is None:
                    return None
                data, tip = found
            else:
                stored = cast(
                    "bytes | None",
                    whole.parsed()
                    if whole is not None
                    else with_retries(lambda: self._get(run_id), run_id),
                )
                if stored is None:
                    return None
                data = stored
        except (ValueError, TypeError, RecursionError) as exc:
            # A backend's own framing (a seq field, a packed head) that does not parse.
            raise SnapshotMalformed(
                self.where(run_id), f"its stored parts do not parse ({type(exc).__name__})"
            ) from exc
        state = snapshot_format.decode(data, self.where(run_id), self.max_bytes)
        if state.run_id != run_id:
            # A copied file, or a link to another run's: never another run's state.
            raise SnapshotMalformed(
                self.where(run_id), f"it holds the state of run {state.run_id[:80]!r}"
            )
        if tip is not None:
            self._remember(run_id, state.seq, state.transcript, tip)
        return state

    def read_base(self, run_id: str) -> TranscriptTip | None:
        """The transcript tip :meth:`load` reads the stored fragments after (None: it reads
        the whole snapshot): what another store's call reads for it (:class:`Prefetched`)."""
        if not self.appends_transcript:
            return None
        known = self._known(validate_run_id(run_id))
        return known.tip if known is not None else None

    def _load_after(
        self, run_id: str, known: _Known, prefetched: Prefetched | None = None
    ) -> RunState | None:
        """The stored state, decoding only the messages after the transcript this store
        last loaded or saved (None: read it whole). What a turn on the other process of a
        pool costs then stays flat; the stored hash chain proves the prefix is unchanged."""
        try:
            found = cast(
                "tuple[bytes, list[bytes], TranscriptTip] | None",
                prefetched.parsed()
                if prefetched is not None
                else with_retries(lambda: self._read_after(run_id, known.tip), run_id),
            )
        except (ValueError, TypeError, RecursionError):
            return None  # the whole read says exactly what does not parse
        if found is None:
            return None
        head, fragments, tip = found
        if (
            tip.length != known.tip.length + len(fragments)
            or snapshot_format.chain(known.tip.chain, fragments) != tip.chain
            or snapshot_format.document_size(head, tip.length, tip.size) > self.max_bytes
        ):
            return None
        where = self.where(run_id)
        state = snapshot_format.decode(head, where, self.max_bytes)
        if state.run_id != run_id or state.transcript:
            return None
        try:
            messages = tuple(Message.model_validate(json_values.loads(f)) for f in fragments)
        except (ValueError, RecursionError):
            return None
        snapshot_format.remember_fragments(messages, fragments)
        state = state.model_copy(update={"transcript": known.transcript + messages})
        self._remember(run_id, state.seq, state.transcript, tip)
        return state

    def _read_after(
        self, run_id: str, base: TranscriptTip
    ) -> tuple[bytes, list[bytes], TranscriptTip] | None:
        """Appending backends, optionally: the head, the fragments stored after ``base``
        and the stored tip; None when the backend cannot tell (then the whole is read)."""
        return None

    def where(self, run_id: str) -> str:
        """The run's snapshot as an error message names it (a file's path, a key)."""
        return f"snapshot of run {run_id}"

    def quarantine(self, run_id: str) -> str | None:
        """Move the run's stored snapshot aside for a person to inspect; where it went.

        Destructive for the run (it has no snapshot afterwards: the next load
        rebuilds it from events, the next save expects none), never for the
        document: it is kept, not deleted, under a name of its own per move
        (``quarantine/<run>.<UTC time>`` in the backend's terms). ``None`` if
        nothing was stored. Raises StoreUnavailable after bounded retries.
        """
        run_id = validate_run_id(run_id)
        if self.appends_transcript:
            self.forget_transcript(run_id)
        stamp = self.stamp()
        return with_retries(lambda: self._quarantine(run_id, stamp), run_id)

    @staticmethod
    def stamp() -> str:
        """The UTC time of a move aside, as it appears in a quarantined name (sorts by time)."""
        return datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")

    def load_document(self, run_id: str) -> bytes | None:
        """The snapshot exactly as a person reads it (``ratchet snapshots show``)."""
        run_id = validate_run_id(run_id)
        return with_retries(lambda: self._get(run_id), run_id)

    def delete(self, run_id: str) -> None:
        """Remove the run's snapshot; deleting a missing one is not an error."""
        run_id = validate_run_id(run_id)
        if self.appends_transcript:
            self.forget_transcript(run_id)
        with_retries(lambda: self._delete(run_id), run_id)

    def list(self) -> builtins.list[str]:
        """Ids of the runs that have a snapshot, sorted."""
        return sorted(with_retries(self._list))

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections; the store is not used afterwards."""

    # --- appending backends: plan once, write only what is new ---------------

    def _save_parts(self, run_id: str, state: RunState, expected_seq: int | None) -> None:
        for _ in range(2):
            parts = self.plan_save(state, expected_seq)
            put = functools.partial(self._put_parts, run_id, parts, expected_seq)
            try:
                with_retries(put, run_id)
            except TranscriptMoved:
                self.forget_transcript(run_id)
                continue
            except StaleWrite as exc:
                self.forget_transcript(run_id)
                # A retried write whose first attempt landed but whose reply was lost
                # finds its own document: that is success, not a conflict.
                if exc.found_seq != state.seq or self._get(run_id) != snapshot_format.encode(
                    state, self.max_bytes
                ):
                    raise
            self.planned_save_written(state, parts)
            return
        raise StaleWrite(run_id, expected_seq, expected_seq)

    # --- a save another store writes in its transaction: the public contract ----

    def plan_save(self, state: RunState, expected_seq: int | None) -> Parts:
        """Plan the save of ``state`` for a transaction of another store to write (a run
        store that :meth:`~store.runs.RunStore.commits_with` this one; appending backends).

        The plan holds the document's head, the messages new since the transcript stored at
        ``expected_seq`` (``Parts.base``; None: the transcript is written whole) and the tip
        once written; the document's full size is checked against the limit. It reads
        nothing when this store last saved or loaded the run at ``expected_seq``, else the
        stored tip. ``state.run_id`` is one the caller has checked (the run store's commit
        has). Raises SnapshotTooLarge, SnapshotMalformed, StoreUnavailable.

        The transaction writes ``Parts`` only if the stored seq is ``expected_seq`` and the
        stored transcript is ``Parts.base`` (else it raises StaleWrite or
        :class:`TranscriptMoved`). Tell the store how it ended, once: written,
        :meth:`planned_save_written`; refused, moved, or not known,
        :meth:`forget_transcript` (then plan again, if at all, from what is stored).
        """
        run_id = state.run_id
        messages = state.transcript
        base: TranscriptTip | None = None
        if expected_seq is not None:
            known = self._known(run_id)
            if known is not None and known.seq == expected_seq:
                base = known.tip if _extends(messages, known.transcript) else None
                diverged = base is None
            else:
                try:
                    stored = with_retries(lambda: self._read_tip(run_id), run_id)
                except (ValueError, TypeError) as exc:
                    raise SnapshotMalformed(
                        self.where(run_id), f"its stored seq or tip does not parse ({exc!r:.80})"
                    ) from exc
                # Nothing stored at the expected seq: the compare-and-set refuses the
                # save anyway. Stored whole (no tip): the save replaces it.
                if stored is not None and stored[0] == expected_seq and stored[1] is not None:
                    base = stored[1] if _chains_to(messages, stored[1]) else None
                diverged = stored is not None and stored[1] is not None and base is None
            if diverged:
                # Never expected (a transcript only grows); the compare-and-set on seq
                # still guards the rewrite.
                log.warning(
                    "run %s: the stored transcript is not a prefix of the one saved at seq %s; "
                    "rewriting it whole",
                    run_id,
                    state.seq,
                )
        start = base.length if base is not None else 0
        fragments = tuple(snapshot_format.encode_fragment(m) for m in messages[start:])
        before = base if base is not None else EMPTY_TIP
        tip = TranscriptTip(
            length=len(messages),
            size=before.size + sum(len(f) for f in fragments),
            chain=snapshot_format.chain(before.chain, fragments),
        )
        head = snapshot_format.encode_head(state)
        size = snapshot_format.document_size(head, tip.length, tip.size)
        if size > self.max_bytes:
            raise SnapshotTooLarge(run_id, size, self.max_bytes)
        return Parts(state.seq, head, base, fragments, tip, messages)

    def planned_save_written(self, state: RunState, parts: Parts) -> None:
        """``parts``, this store's plan of ``state`` (:meth:`plan_save`), are stored: by
        this store, or in another store's transaction. The next plan of the run appends
        to them without reading the store."""
        self._remember(state.run_id, state.seq, state.transcript, parts.tip)
        _last_save.nbytes = len(parts.head) + sum(len(f) for f in parts.fragments)

    def forget_transcript(self, run_id: str) -> None:
        """Forget what this store knows of ``run_id``'s stored transcript: after a planned
        save that was refused, whose transcript moved, or whose outcome is not known, and
        before a transaction that deletes the snapshot. Nothing stored changes; the next
        plan or load of the run reads what is stored."""
        with self._known_lock:
            self._known_runs.pop(run_id, None)

    def _known(self, run_id: str) -> _Known | None:
        with self._known_lock:
            return self._known_runs.get(run_id)

    def _remember(
        self, run_id: str, seq: int, transcript: tuple[Message, ...], tip: TranscriptTip
    ) -> None:
        with self._known_lock:
            self._known_runs[run_id] = _Known(seq, transcript, tip)
            self._known_runs.move_to_end(run_id)
            while len(self._known_runs) > KNOWN_RUNS:
                self._known_runs.popitem(last=False)

    def _put_parts(self, run_id: str, parts: Parts, expected_seq: int | None) -> None:
        """Appending backends: write ``parts`` if the stored seq is ``expected_seq``.

        With ``parts.base`` set, also require the stored transcript to be exactly
        it (else raise TranscriptMoved) and append ``parts.fragments``; with
        ``None``, replace the stored transcript by them. Raise StaleWrite on a seq
        mismatch. A reader must never see a head whose messages are not all stored.
        """
        raise NotImplementedError(f"{self.name} does not append transcripts")

    def _read_tip(self, run_id: str) -> tuple[int, TranscriptTip | None] | None:
        """Appending backends: the stored seq and transcript tip (``None``: stored whole)."""
        raise NotImplementedError(f"{self.name} does not append transcripts")

    def _read(self, run_id: str) -> tuple[bytes, TranscriptTip | None] | None:
        """Appending backends: the assembled document and its tip, from one consistent read."""
        raise NotImplementedError(f"{self.name} does not append transcripts")

    # --- primitives: what a backend implements -----------------------------

    @abstractmethod
    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        """Atomically replace the run's document if its stored seq is ``expected_seq``.

        Raise StaleWrite(run_id, expected_seq, found) otherwise, and StoreUnavailable
        for transient failures. Never leave a torn document.
        """

    @abstractmethod
    def _get(self, run_id: str) -> bytes | None: ...

    @abstractmethod
    def _quarantine(self, run_id: str, stamp: str) -> str | None:
        """Move the run's stored document (whatever its state) aside under ``stamp``; where to.

        Afterwards the run has no snapshot. Never delete the document; ``None``
        if the run had none. Must work on a document that cannot be decoded.
        """

    @abstractmethod
    def _delete(self, run_id: str) -> None: ...

    @abstractmethod
    def _list(self) -> builtins.list[str]: ...
