"""Periodic daemon threads and per-process objects: what the liveness beat, the lease
heartbeat and the model and tool callers are built from.

A forked pool child makes its own of each (:class:`PerProcess`): the parent's
threads do not carry over a fork. A periodic thread waits for its next round with
:class:`Rounds` and counts what it did in a :class:`PeriodicStats`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """One ``T`` per process, made on first use: a forked pool child makes its own (what
    the parent made, its threads above all, does not carry over a fork)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._by_pid: dict[int, T] = {}

    def __call__(self) -> T:
        pid = os.getpid()
        found = self._by_pid.get(pid)  # one dict read is atomic: no lock once it is made
        if found is not None:
            return found
        with self._lock:
            found = self._by_pid.get(pid)
            if found is None:
                found = self._by_pid[pid] = self._make()
        return found

    def made(self) -> T | None:
        """This process's ``T`` if it was made, without making it."""
        with self._lock:
            return self._by_pid.get(os.getpid())


class Rounds:
    """The rounds of a periodic daemon thread, one every ``period_s`` (which may change).

    A round that started late is not followed by a burst of catch-up rounds: the next
    is planned at least half a period later.
    """

    def __init__(self, changed: threading.Condition) -> None:
        self._changed = changed
        self._planned: float | None = None

    def wait(self, period_s: float | None) -> tuple[float, float] | None:
        """Wait, holding ``changed``, for the next round: ``(now, late_s)`` as it starts.

        None: the wait ended before the round (a change was notified, or the time
        has not come yet): look again. ``period_s`` None: there is nothing to do,
        so wait until notified, and plan the next round afresh from then.
        """
        if period_s is None:
            self._planned = None
            self._changed.wait()
            return None
        now = time.monotonic()
        if self._planned is None:
            self._planned = now + period_s
        if now < self._planned:
            self._changed.wait(self._planned - now)
            return None
        late_s = now - self._planned
        self._planned = max(self._planned + period_s, now + period_s / 2)
        return now, late_s


@dataclass
class PeriodicStats:
    """What every periodic thread paced by :class:`Rounds` counts (its ``stats``)."""

    rounds: int = 0
    failed: int = 0
    """Store calls that failed (tried again at the next round)."""
    max_late_s: float = 0.0
    """How long after its planned time a round started, at worst: the process was busy."""
