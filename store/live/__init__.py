"""A run's live stream: what observers watch form, beside the durable event log.

Model deltas (text and tool-call arguments as they arrive) and the progress a tool reports
are not the run's state: the event log and the snapshot stay the truth, and the response is
journaled whole when its stream ends. The live stream is bounded (the newest ``maxlen``
entries of a run) and expires ``keep_s`` after its last write, so a finished run's stream
goes away on its own. It lives where the run store lives:

- **Redis**: a Redis Stream per run, ``{prefix}:run:{<id>}:live`` (the run's hash tag, next
  to its record), trimmed exactly to ``maxlen`` by ``XADD MAXLEN`` and given a ``PEXPIRE``
  at each write; readers ``XREAD BLOCK`` on it.
- **SQLite** (the embedded default): a database of its own beside the run store's
  (``<name>.live.db``), so that writing deltas never takes the run store's write lock;
  several processes on the machine read it.
- **memory**: in the process, for tests and single-process use.

A run is **watched** while a reader says so (``watch``, again every few seconds): a model
call streams only when its run is watched as it begins, so streaming costs nothing for
runs nobody watches (``watched``: one read per model call).

Entries are JSON objects; each one's ``cursor`` (opaque, increasing within the run) is
where a reader that reconnects goes on from: it misses nothing still kept and sees
nothing twice. A write is never retried: a late delta is a lost one, and the caller
(:mod:`tasks.live`) drops and counts it rather than hold a turn.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

from runtime.models import validate_run_id

DEFAULT_MAXLEN = 2000
"""Entries a run's stream keeps: about a long answer's deltas, ten times over."""
DEFAULT_KEEP_S = 3600.0
"""How long a stream outlives its last write (the run's end, for a finished run)."""


class LiveEntry(NamedTuple):
    cursor: str
    """Opaque and increasing within the run's stream: read ``after`` it to go on."""
    data: dict[str, Any]


def encoded(entry: dict[str, Any]) -> str:
    """One entry as stored: ASCII JSON, so a lone surrogate a model sent cannot fail it."""
    return json.dumps(entry, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def decoded(text: str | bytes) -> dict[str, Any]:
    value = json.loads(text)
    return value if isinstance(value, dict) else {"value": value}


class LiveStream(ABC):
    """The live streams of one run store's runs."""

    name = "live stream"

    def add(
        self, run_id: str, entries: Sequence[dict[str, Any]], maxlen: int, keep_s: float
    ) -> None:
        """Append ``entries`` (in order) to the run's stream, keep its newest ``maxlen``,
        and let it expire ``keep_s`` after this write. StoreUnavailable if it cannot."""
        if maxlen < 1 or keep_s <= 0:
            raise ValueError(
                f"maxlen must be 1 or more and keep_s positive, not {maxlen}, {keep_s}"
            )
        if entries:
            self._add(validate_run_id(run_id), [encoded(e) for e in entries], maxlen, keep_s)

    def read(
        self, run_id: str, after: str | None = None, limit: int = 1000, block_s: float = 0.0
    ) -> list[LiveEntry]:
        """Up to ``limit`` entries after the cursor ``after`` (from the oldest kept when
        ``None``), waiting up to ``block_s`` for one when there are none yet."""
        if limit < 1 or block_s < 0:
            raise ValueError(
                f"limit must be 1 or more and block_s 0 or more, not {limit}, {block_s}"
            )
        return self._read(validate_run_id(run_id), after, limit, block_s)

    def watch(self, run_id: str, for_s: float) -> None:
        """Say someone watches the run for the next ``for_s`` seconds (a reader says it
        again while it reads). StoreUnavailable if it cannot."""
        if not for_s > 0:
            raise ValueError(f"for_s must be positive, not {for_s}")
        self._watch(validate_run_id(run_id), for_s)

    def watched(self, run_id: str) -> bool:
        """Whether someone said they watch the run and its time has not run out: a model
        call streams only then (tasks/held_run.py). StoreUnavailable if it cannot tell."""
        return self._watched(validate_run_id(run_id))

    def close(self) -> None:  # noqa: B027 - most hold nothing of their own
        """Release what the stream holds of its own."""

    @abstractmethod
    def _add(self, run_id: str, entries: list[str], maxlen: int, keep_s: float) -> None: ...

    @abstractmethod
    def _read(
        self, run_id: str, after: str | None, limit: int, block_s: float
    ) -> list[LiveEntry]: ...

    @abstractmethod
    def _watch(self, run_id: str, for_s: float) -> None: ...

    @abstractmethod
    def _watched(self, run_id: str) -> bool: ...


__all__ = ["DEFAULT_KEEP_S", "DEFAULT_MAXLEN", "LiveEntry", "LiveStream"]
