"""Limits in the process: for tests and single-process use."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from store.limits.local import LocalLimitStore


class MemoryLimitStore(LocalLimitStore):
    """One process's limits (tests, ``memory://`` run stores)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        super().__init__(clock)
        self._docs: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def _documents(self, *names: str) -> Iterator[dict[str, dict[str, Any]]]:
        with self._lock:
            yield {name: self._docs.setdefault(name, {}) for name in names}
