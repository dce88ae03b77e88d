"""The rejected-message store: every message a worker refuses, kept raw for an operator.

A worker refuses what it cannot or must not act on: an entry on a queue that is
not a kombu envelope (``LPUSH ratchet.turns garbage``), a body that cannot be
decoded (bad base64, a pickle, not JSON), a task ratchet does not know, a
ratchet task with missing, extra or mistyped arguments, a message over
:data:`MAX_MESSAGE_BYTES`. Each is set aside here — its raw bytes (at most
:data:`MAX_RAW_BYTES` of them), the reason, the queue and the time — and the
worker goes on with the next message (:mod:`tasks.refusals`). ``ratchet rejected
list|show|purge`` reads and empties the store. (Not to be confused with a *run*
that is dead-lettered, ``run.dead_lettered``: that is a run ratchet stopped
retrying; this is a message no worker could act on.)

One store per broker, beside the queues; this module is the contract and the
entry, each backend a module of its own:

- Redis (:mod:`store.rejected.redis`): the list ``ratchet:rejected`` on the
  broker's database, newest first, capped at :data:`MAX_ENTRIES` (``LTRIM``);
- RabbitMQ (:mod:`store.rejected.amqp`): the durable queue ``ratchet.rejected``
  with ``x-max-length`` :data:`MAX_ENTRIES` (the oldest entry is dropped first);
- ``filesystem://`` (:mod:`store.rejected.folder`): one JSON file per entry in
  ``<data dir>/broker/rejected``, oldest removed beyond :data:`MAX_ENTRIES`.

Bounded on purpose: a producer stuck in a loop of garbage must not fill the
broker.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.errors import RejectedEntryNotFound

log = logging.getLogger("ratchet.rejected")

MAX_ENTRIES = 1000
"""Entries kept per broker; the oldest go first."""
MAX_RAW_BYTES = 64 * 1024
"""Bytes of a refused message kept; the entry records the full size."""
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""A broker entry larger than this is refused unread (a turn message is a few hundred bytes)."""
REDIS_KEY = "ratchet:rejected"
AMQP_QUEUE = "ratchet.rejected"
ENTRY_ID = re.compile(r"\A[0-9]{13}-[0-9a-f]{12}\Z")


class _EntryClock:
    """Milliseconds and an order within each millisecond: the ids one process gives sort in
    the order it set the entries aside (a folder keeps the newest by sorting its names;
    a random suffix alone ordered entries of one millisecond at random)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms, self._order = 0, 0

    def next(self) -> tuple[int, int]:
        with self._lock:
            now = max(int(time.time() * 1000), self._ms)  # never backwards
            self._order = self._order + 1 if now == self._ms else 0
            if self._order > 0xFFFF:  # 65,536 in one millisecond: borrow the next one
                now, self._order = now + 1, 0
            self._ms = now
            return now, self._order


_entry_clock = _EntryClock()


@dataclass(frozen=True)
class Rejected:
    """One refused message, as set aside."""

    id: str
    """Sortable by time: ``<ms since the epoch>-<random>``."""
    at_ms: int
    """When the worker refused it."""
    queue: str
    """The queue it came from."""
    reason: str
    """Why it was refused, in one line."""
    size: int
    """Its full size in bytes (``raw`` may be cut at MAX_RAW_BYTES)."""
    raw: str
    """The message as it was on the broker, base64."""

    @property
    def truncated(self) -> bool:
        return len(base64.b64decode(self.raw)) < self.size

    def raw_bytes(self) -> bytes:
        return base64.b64decode(self.raw)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "truncated": self.truncated}

    @classmethod
    def new(cls, raw: bytes, reason: str, queue: str) -> Rejected:
        now, order = _entry_clock.next()
        return cls(
            id=f"{now:013d}-{order:04x}{uuid.uuid4().hex[:8]}",
            at_ms=now,
            queue=queue,
            reason=reason,
            size=len(raw),
            raw=base64.b64encode(raw[:MAX_RAW_BYTES]).decode("ascii"),
        )

    @classmethod
    def from_json(cls, document: bytes | str) -> Rejected:
        data = json.loads(document)
        return cls(
            id=str(data["id"]),
            at_ms=int(data["at_ms"]),
            queue=str(data["queue"]),
            reason=str(data["reason"]),
            size=int(data["size"]),
            raw=str(data["raw"]),
        )

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def read_entries(documents: Any) -> list[Rejected]:
    """The entries among ``documents``; one that is not an entry is skipped with a warning."""
    entries = []
    for document in documents:
        try:
            entries.append(Rejected.from_json(document))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                "skipping an unreadable rejected-message entry (%s: %s)", type(exc).__name__, exc
            )
    return entries


class RejectedStore:
    """Where refused messages go. ``add`` keeps at most MAX_ENTRIES; list is newest first."""

    where: str = ""

    def add(self, entry: Rejected) -> None:
        raise NotImplementedError

    def list(self, limit: int = 50) -> list[Rejected]:
        raise NotImplementedError

    def get(self, entry_id: str) -> Rejected:
        if not ENTRY_ID.match(entry_id):
            raise RejectedEntryNotFound(entry_id)
        for entry in self.list(MAX_ENTRIES):
            if entry.id == entry_id:
                return entry
        raise RejectedEntryNotFound(entry_id)

    def purge(self) -> int:
        """Destructive: delete every entry; how many there were."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def rejected_folder(data_dir: Path) -> Path:
    return data_dir / "broker" / "rejected"
