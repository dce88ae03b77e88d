"""In-process run store, for tests and single-process use."""

from __future__ import annotations

import threading
from collections.abc import Callable

from runtime.errors import LeaseLost, StaleWrite
from runtime.models import Event, RunStatus
from store.live.memory import MemoryLiveStream
from store.runs import (
    Claim,
    Lease,
    Orphan,
    RunRecord,
    RunStore,
    owner_process,
)


class MemoryRunStore(RunStore):
    name = "memory run store"

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        super().__init__(clock)
        self._lock = threading.Lock()
        self._records: dict[str, RunRecord] = {}
        self._logs: dict[str, list[Event]] = {}
        self._leases: dict[str, Lease] = {}
        self._alive_until: dict[str, int] = {}
        self._live = MemoryLiveStream()

    def live(self) -> MemoryLiveStream:
        return self._live

    def _create(self, record: RunRecord, first: Event) -> None:
        with self._lock:
            if record.run_id in self._records:
                raise StaleWrite(record.run_id, 0, self._records[record.run_id].last_seq)
            self._records[record.run_id] = record
            self._logs[record.run_id] = [first]

    def _append(
        self, record: RunRecord, events: list[Event], owner: str | None, now_ms: int
    ) -> None:
        with self._lock:
            current = self._records.get(record.run_id)
            found = current.last_seq if current else None
            if found != events[0].seq - 1:
                raise StaleWrite(record.run_id, events[0].seq - 1, found)
            if owner is not None:
                lease = self._leases.get(record.run_id)
                if lease is None or lease.owner != owner or lease.expires_at_ms <= now_ms:
                    raise LeaseLost(record.run_id, owner)
            self._records[record.run_id] = record
            self._logs[record.run_id].extend(events)

    def _get(self, run_id: str) -> RunRecord | None:
        with self._lock:
            return self._records.get(run_id)

    def _list(self, status: RunStatus | None, limit: int) -> list[RunRecord]:
        with self._lock:
            records = [r for r in self._records.values() if status is None or r.status == status]
        records.sort(key=lambda r: (r.created_at_ms, r.run_id), reverse=True)
        return records[:limit]

    def _events(self, run_id: str, after_seq: int, limit: int | None) -> list[Event]:
        with self._lock:
            found = [e for e in self._logs.get(run_id, []) if e.seq > after_seq]
        return found[:limit] if limit is not None else found

    def _acquire(self, run_id: str, owner: str, lease_ms: int, now_ms: int) -> bool:
        with self._lock:
            lease = self._leases.get(run_id)
            if lease is not None and lease.owner != owner and lease.expires_at_ms > now_ms:
                return False
            self._leases[run_id] = Lease(owner=owner, expires_at_ms=now_ms + lease_ms)
            return True

    def _extend(self, run_id: str, owner: str, lease_ms: int, now_ms: int) -> bool:
        with self._lock:
            lease = self._leases.get(run_id)
            if lease is None or lease.owner != owner:
                return False
            self._leases[run_id] = Lease(owner=owner, expires_at_ms=now_ms + lease_ms)
            return True

    def _release(self, run_id: str, owner: str) -> None:
        with self._lock:
            lease = self._leases.get(run_id)
            if lease is not None and lease.owner == owner:
                del self._leases[run_id]

    def _lease(self, run_id: str, now_ms: int) -> Lease | None:
        with self._lock:
            lease = self._leases.get(run_id)
        return lease if lease is not None and lease.expires_at_ms > now_ms else None

    def _overdue(self, now_ms: int, limit: int) -> list[str]:
        with self._lock:
            due = sorted(
                (r.due_at_ms, r.run_id)
                for r in self._records.values()
                if r.due_at_ms is not None and r.due_at_ms <= now_ms
            )
            free = [
                run_id
                for _, run_id in due
                if run_id not in self._leases or self._leases[run_id].expires_at_ms <= now_ms
            ]
        return free[:limit]

    def _postpone(self, run_id: str, seen_seq: int, due_at_ms: int) -> bool:
        with self._lock:
            record = self._records.get(run_id)
            if record is None or record.last_seq != seen_seq or record.due_at_ms is None:
                return False
            self._records[run_id] = record.model_copy(update={"due_at_ms": due_at_ms})
            return True

    def _claim(
        self, run_id: str, owner: str, process: str | None, lease_ms: int, now_ms: int
    ) -> Claim:
        with self._lock:
            claim = Claim.decide(self._leases.get(run_id), owner, now_ms, self._alive_until.get)
            if claim.taken:
                self._leases[run_id] = Lease(owner=owner, expires_at_ms=now_ms + lease_ms)
            return claim

    def _beat(self, process: str, expires_at_ms: int, now_ms: int) -> bool:
        with self._lock:
            before = self._alive_until.get(process)
            self._alive_until[process] = expires_at_ms
        return before is not None and before > now_ms

    def _liveness(self, process: str) -> int | None:
        with self._lock:
            return self._alive_until.get(process)

    def _orphaned(self, now_ms: int, limit: int) -> list[Orphan]:
        # A scan of the leases held: fine for tests; the other backends index them.
        with self._lock:
            dead = {p for p, until in self._alive_until.items() if until <= now_ms}
            found = [
                Orphan(run_id, lease.owner)
                for run_id, lease in sorted(self._leases.items())
                if lease.expires_at_ms > now_ms and owner_process(lease.owner) in dead
            ]
            holding = {owner_process(o.owner) for o in found}
            for process in dead - holding:
                del self._alive_until[process]
        return found[:limit]

    def _purge(self, before_ms: int, limit: int) -> list[str]:
        with self._lock:
            old = sorted(
                (r.updated_at_ms, r.run_id)
                for r in self._records.values()
                if r.finished and r.updated_at_ms < before_ms
            )[:limit]
            for _, run_id in old:
                del self._records[run_id]
                self._logs.pop(run_id, None)
                self._leases.pop(run_id, None)
        return [run_id for _, run_id in old]
