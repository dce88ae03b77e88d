"""What every contract class shares: the injected clock and a start line for races."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T0_MS = 1_700_000_000_000
"""Where the injected clock starts: a fixed instant, far from the real one."""


class FakeClock:
    """A clock the test moves by hand; run stores read time only through it."""

    def __init__(self, now_ms: int = T0_MS) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


T = TypeVar("T")


def race(*calls: Callable[[], T]) -> list[T | Exception]:
    """Run the calls on threads released together; each one's result or error, in order."""
    start = threading.Barrier(len(calls))
    results: list[T | Exception] = [RuntimeError("did not finish")] * len(calls)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = calls[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results
