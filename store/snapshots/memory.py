"""In-process snapshot store, for tests and single-process use."""

from __future__ import annotations

import threading

from runtime.errors import StaleWrite
from runtime.models import RunState
from store.snapshots import SnapshotStore


class MemorySnapshotStore(SnapshotStore):
    name = "memory snapshot store"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._docs: dict[str, tuple[int, bytes]] = {}
        self.quarantined: dict[str, bytes] = {}
        """Documents moved aside, by ``<run>.<stamp>``: kept for the process's life."""

    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        with self._lock:
            found = self._docs.get(run_id)
            found_seq = found[0] if found else None
            if found_seq != expected_seq:
                raise StaleWrite(run_id, expected_seq, found_seq)
            self._docs[run_id] = (state.seq, data)

    def _get(self, run_id: str) -> bytes | None:
        with self._lock:
            found = self._docs.get(run_id)
        return found[1] if found else None

    def _quarantine(self, run_id: str, stamp: str) -> str | None:
        with self._lock:
            found = self._docs.pop(run_id, None)
            if found is None:
                return None
            name = f"{run_id}.{stamp}"
            self.quarantined[name] = found[1]
        return f"memory quarantine {name}"

    def _delete(self, run_id: str) -> None:
        with self._lock:
            self._docs.pop(run_id, None)

    def _list(self) -> list[str]:
        with self._lock:
            return list(self._docs)
