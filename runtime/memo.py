"""What a process worked out from a frozen object, remembered by the object itself.

A run's transcript messages are frozen: each turn of a run this process holds reuses the
same objects, and what is made of them (the snapshot's encoding of a message, its form in
a model request) cannot change. :class:`IdentityMemo` keeps the newest of those by the
object's identity, holding the object so that its id is not reused while it is there,
bounded by a count and by the bytes the values take. The core starts no thread and takes
no lock of its own: the process side gives the memo its lock, and a fresh one in a forked
child (:meth:`IdentityMemo.renew_lock`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class IdentityMemo(Generic[K, V]):
    """Values by the identity of the frozen object they were made from; the newest kept."""

    def __init__(
        self,
        entries: int,
        max_bytes: int,
        size: Callable[[V], int],
        lock: AbstractContextManager[Any],
    ) -> None:
        self.entries, self.max_bytes, self._size, self._lock = entries, max_bytes, size, lock
        self._kept: dict[int, tuple[K, V, int]] = {}
        """By ``id(key)``: the key, its value and the value's size. Holding the key keeps its
        id from being reused while here."""
        self._bytes = 0

    def renew_lock(self, lock: AbstractContextManager[Any]) -> None:
        """Take a new lock: in a forked child, whose copy of the old one may be held by a
        thread that is not there."""
        self._lock = lock

    def get(self, key: K) -> V | None:
        found = self._kept.get(id(key))
        return found[1] if found is not None and found[0] is key else None

    def put(self, key: K, value: V) -> None:
        """Remember ``value`` for ``key`` unless it takes over a sixteenth of the bytes."""
        size = self._size(value)
        if size > self.max_bytes // 16:
            return
        with self._lock:
            if id(key) in self._kept:
                return
            self._kept[id(key)] = (key, value, size)
            self._bytes += size
            while len(self._kept) > self.entries or self._bytes > self.max_bytes:
                self._bytes -= self._kept.pop(next(iter(self._kept)))[2]

    def items(self) -> list[tuple[int, tuple[K, V]]]:
        """What is remembered, oldest first (for tests)."""
        with self._lock:
            return [(at, (key, value)) for at, (key, value, _) in self._kept.items()]

    @property
    def size(self) -> int:
        """The bytes the remembered values take."""
        return self._bytes
