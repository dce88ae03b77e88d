"""Live streams in the process (the memory run store's), for tests and single-process use."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from store.live import LiveEntry, LiveStream, decoded


@dataclass
class _Stream:
    entries: deque[tuple[int, str]] = field(default_factory=deque)
    next_id: int = 1
    expires_at: float = 0.0


def integer_cursor(after: str | None) -> int:
    """A cursor of the SQLite and memory streams (the id of the entry read last)."""
    if after is None:
        return 0
    if not after.isdigit() or len(after) > 19:
        raise ValueError(f"not a live-stream cursor: {after[:40]!r} (a cursor is a whole number)")
    return int(after)


class MemoryLiveStream(LiveStream):
    name = "memory live stream"

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._watched_until: dict[str, float] = {}
        self._changed = threading.Condition()

    def _watch(self, run_id: str, for_s: float) -> None:
        with self._changed:
            now = time.monotonic()
            for gone in [r for r, until in self._watched_until.items() if until <= now]:
                del self._watched_until[gone]
            self._watched_until[run_id] = now + for_s

    def _watched(self, run_id: str) -> bool:
        with self._changed:
            return self._watched_until.get(run_id, 0.0) > time.monotonic()

    def _add(self, run_id: str, entries: list[str], maxlen: int, keep_s: float) -> None:
        with self._changed:
            stream = self._live(run_id) or self._streams.setdefault(run_id, _Stream())
            for entry in entries:
                stream.entries.append((stream.next_id, entry))
                stream.next_id += 1
            while len(stream.entries) > maxlen:
                stream.entries.popleft()
            stream.expires_at = time.monotonic() + keep_s
            self._changed.notify_all()

    def _read(self, run_id: str, after: str | None, limit: int, block_s: float) -> list[LiveEntry]:
        last = integer_cursor(after)
        deadline = time.monotonic() + block_s
        with self._changed:
            while True:
                stream = self._live(run_id)
                found = [
                    LiveEntry(str(i), decoded(e))
                    for i, e in (stream.entries if stream else ())
                    if i > last
                ][:limit]
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return found
                self._changed.wait(left)

    def _live(self, run_id: str) -> _Stream | None:
        stream = self._streams.get(run_id)
        if stream is not None and stream.expires_at <= time.monotonic():
            del self._streams[run_id]
            return None
        return stream
