"""The SnapshotStore contract: one snapshot per run, overwritten on each save.

The base class does the work once — run id validation, encoding, the 16 MiB
limit, retries of transient errors, decoding with kind/version checks — and a
backend implements four primitives: ``_put``, ``_get``, ``_delete``, ``_list``.

``save`` is a compare-and-set on the run's seq: it is refused with
:class:`~runtime.errors.StaleWrite` unless the stored snapshot's seq is
``expected_seq`` (``None``: no snapshot stored). A worker that lost its lease
and woke up late can therefore never overwrite a newer snapshot.

Backends: ``memory://`` (tests), ``file:///dir`` (embedded default),
``redis://…``.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod

from runtime.errors import StaleWrite
from runtime.models import RunState, validate_run_id
from store.retry import with_retries
from store.snapshots import format as snapshot_format


class SnapshotStore(ABC):
    """Contract every snapshot backend passes (see tests/contract/)."""

    max_bytes: int = snapshot_format.MAX_BYTES
    name: str = "snapshot store"

    def save(self, state: RunState, expected_seq: int | None) -> None:
        """Store ``state`` as the run's snapshot if the stored one has seq ``expected_seq``.

        Raises StaleWrite (CAS lost), SnapshotTooLarge, or StoreUnavailable after
        bounded retries. A failed save leaves the previous snapshot intact.
        """
        run_id = validate_run_id(state.run_id)
        data = snapshot_format.encode(state, self.max_bytes)
        try:
            with_retries(lambda: self._put(run_id, state, data, expected_seq))
        except StaleWrite as exc:
            # A retried write whose first attempt landed but whose reply was lost finds
            # its own document: that is success, not a conflict.
            if exc.found_seq != state.seq or self._get(run_id) != data:
                raise

    def load(self, run_id: str) -> RunState | None:
        """The run's snapshot, or ``None`` if it has none."""
        run_id = validate_run_id(run_id)
        data = with_retries(lambda: self._get(run_id))
        if data is None:
            return None
        return snapshot_format.decode(data, f"snapshot of run {run_id}", self.max_bytes)

    def load_document(self, run_id: str) -> bytes | None:
        """The snapshot exactly as a person reads it (``ratchet snapshots show``)."""
        run_id = validate_run_id(run_id)
        return with_retries(lambda: self._get(run_id))

    def delete(self, run_id: str) -> None:
        """Remove the run's snapshot; deleting a missing one is not an error."""
        run_id = validate_run_id(run_id)
        with_retries(lambda: self._delete(run_id))

    def list(self) -> builtins.list[str]:
        """Ids of the runs that have a snapshot, sorted."""
        return sorted(with_retries(self._list))

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections; the store is not used afterwards."""

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
    def _delete(self, run_id: str) -> None: ...

    @abstractmethod
    def _list(self) -> builtins.list[str]: ...
