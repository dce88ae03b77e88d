"""The store's clock: every lease, liveness record and deadline is decided on it.

Leases and liveness records hold expiry times that one process writes and another
compares with its own "now". With each host's wall clock, a worker 4 s ahead took
a live worker's runs (its liveness looked lapsed) and parked their calls; 2 h ahead,
every run failed on its deadline at once. So a run store's ``clock`` is this
host's wall clock plus the offset of the store's own clock, measured with one
round trip (Redis ``TIME``) when first used and again on each liveness round
(tasks/liveness.py). Processes on several hosts then share one clock, to within
half a round trip and the drift between two rounds (milliseconds). A store with
no clock of its own (SQLite, memory) lives on this host: the host's clock is the
store's, and the offset is 0.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

HOST_CLOCK = "this host's clock"


def _test_clock_offset_ms() -> int:
    """``RATCHET_TEST_CLOCK_OFFSET_S``, for tests only: this process's wall clock is shifted
    by it, as on a host whose time sync broke (tests/crash/test_clock_skew.py)."""
    text = os.environ.get("RATCHET_TEST_CLOCK_OFFSET_S", "0")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise SystemExit(f"ratchet: RATCHET_TEST_CLOCK_OFFSET_S={text} is not a number of seconds")
    return int(seconds * 1000)


_TEST_OFFSET_MS = _test_clock_offset_ms()


def wall_ms() -> int:
    return time.time_ns() // 1_000_000 + _TEST_OFFSET_MS


class ClockReading(NamedTuple):
    offset_ms: int
    """The store's clock minus this host's (positive: this host is behind)."""
    round_trip_ms: int
    """How long the measurement took: the offset is known to within half of it."""
    source: str
    """Whose clock the store's is (``Redis TIME``, or this host's)."""


class StoreClock:
    """Milliseconds now on the store's clock (callable); see the module docstring.

    ``server_ms`` reads the store's own clock (None: the store has none). Thread-safe.
    """

    def __init__(self, server_ms: Callable[[], int | None], source: str) -> None:
        self._server_ms = server_ms
        self.source = source
        self.offset_ms = 0
        self.last: ClockReading | None = None
        self._lock = threading.Lock()
        self._first = threading.Lock()
        self._first_tried = False

    def __call__(self) -> int:
        if self.last is None and not self._first_tried:
            self._measure_first()
        return wall_ms() + self.offset_ms

    def _measure_first(self) -> None:
        # One caller measures; the others go on with the host's clock meanwhile rather than
        # each take a connection for it (a pool sized for the calls has none to spare).
        if not self._first.acquire(blocking=False):
            return
        try:
            if not self._first_tried:
                self._first_tried = True
                self.measure()
        except Exception:  # noqa: BLE001 - a store error: measured again at the next round
            pass
        finally:
            self._first.release()

    def measure(self) -> ClockReading:
        """Measure the offset now (one round trip to the store, if it has a clock) and use it."""
        before = time.monotonic_ns()
        host_before = wall_ms()
        server = self._server_ms()
        round_trip_ms = (time.monotonic_ns() - before) // 1_000_000
        if server is None:
            reading = ClockReading(0, 0, HOST_CLOCK)
        else:
            reading = ClockReading(server - (host_before + round_trip_ms // 2), round_trip_ms,
                                   self.source)  # fmt: skip
        with self._lock:
            self.offset_ms, self.last = reading.offset_ms, reading
        return reading
