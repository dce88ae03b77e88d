"""The live-stream writer: model deltas and tool progress handed off, never waited on.

A turn's model call and tools put entries here (a non-blocking queue put); one thread per
process writes them to the run store's live stream (store/live) in batches, in order.
A full queue or a failing store drops entries, counted in ``ratchet_live_dropped_total``
and logged at most once a minute; nothing here can raise into a turn or hold it. The
event log, not this stream, is what a run is: an observer that misses a delta still
sees the whole response when ``model.responded`` commits.

Each entry names the run, the call and the attempt::

    {"kind": "model.delta", "run": RUN, "model_call": 2, "at": 7, "attempt": 1, "text": "Hel"}
    {"kind": "model.delta", ..., "call": 0, "id": "call_a", "name": "lookup", "arguments": "{"}
    {"kind": "model.delta", ..., "aborted": "the stream was cut off: ..."}
    {"kind": "tool.progress", "run": RUN, "call_id": "call_2_1", "at": 9, "message": "3 of 10"}

``at`` is the seq of the ``model.requested`` (or ``tool.requested``) event of the attempt:
a worker that takes over after a crash writes under a new ``at``, so the attempt the dead
worker left unfinished is told apart from the next one (worker/watch.py marks it aborted).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any

from runtime import json_values
from runtime.errors import StoreError
from runtime.json_values import without_surrogates
from store.live import LiveStream
from tasks.observers import NONE, Observers

log = logging.getLogger("ratchet.live")

CAPACITY = 10_000
"""Entries waiting for the writer before new ones are dropped."""
MAX_PIECES_BYTES = 2 * json_values.MAX_OUTPUT_BYTES
"""The most characters of pieces one model call puts in the stream (its text and its calls'
arguments may each be up to the answer's limit); past it, pieces are dropped and counted
(``too_large``), and watchers see the rest of the answer when it commits."""
SETTLE_S = 0.1
"""How long a streamed model call waits for its last pieces to be written before its
answer commits (:meth:`LiveWriter.settle`): past it, the turn goes on and they are late."""
BATCH = 500
_WARN_EVERY_S = 60.0


def watched(writer: LiveWriter, run_id: str) -> bool:
    """Whether someone watches the run (store/live); a store that cannot tell is taken for
    no: the call goes unstreamed, whole, as it would anyway."""
    try:
        return writer.stream.watched(run_id)
    except StoreError:
        return False


def live_piece(piece: dict[str, Any]) -> dict[str, Any]:
    """A provider's piece as an observer may print it: text without lone surrogates (the
    journaled answer has them replaced the same way, runtime/provider.py ``checked_response``)."""
    return {k: without_surrogates(v) if isinstance(v, str) else v for k, v in piece.items()}


class LiveWriter:
    """One process's writer to one live stream (made again after a fork)."""

    def __init__(
        self, stream: LiveStream, maxlen: int, keep_s: float, observers: Observers = NONE
    ) -> None:
        self.stream, self.maxlen, self.keep_s = stream, maxlen, keep_s
        self.observers = observers
        """Told of each entry dropped (its context's, tasks/observers.py)."""
        self._queue: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue(CAPACITY)
        self._lock = threading.Lock()
        self._pid = 0
        self._warned_at = 0.0
        self._idle = threading.Event()
        self._idle.set()
        self._handed = 0
        """Entries taken into the queue by this process (the writer's order is theirs)."""
        self._written = 0
        """Of those, how many the writer has written or dropped."""
        self._progress = threading.Lock()
        self._waiting: list[tuple[int, int, threading.Event]] = []
        """(entries handed in when it began, ticket, its event): the calls that settle."""
        self._tickets = itertools.count()

    def put(self, run_id: str, entry: dict[str, Any]) -> None:
        """Hand ``entry`` to the writer; dropped (and counted) if the queue is full."""
        self._started()
        self._idle.clear()
        with self._progress:
            try:
                self._queue.put_nowait((run_id, entry))
            except queue.Full:
                if self.observers:
                    self.observers.live_dropped("full", 1)
                self._warn("its queue is full")
                return
            self._handed += 1

    def settle(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until every entry handed in so far is written (or
        dropped); whether it was. A model call's last pieces are then in the stream before
        its answer commits, so a watcher shows them as they came instead of dropping them
        as late (worker/watch.py). Only the waiters a batch satisfies are woken."""
        with self._progress:
            if self._written >= self._handed:
                return True
            done = threading.Event()
            heapq.heappush(self._waiting, (self._handed, next(self._tickets), done))
        return done.wait(timeout_s)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every entry handed in so far is written or dropped; whether it was."""
        deadline = time.monotonic() + timeout_s
        while not (self._queue.unfinished_tasks == 0):
            if time.monotonic() >= deadline:
                return False
            self._idle.wait(0.01)
        return True

    def _started(self) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._queue = queue.Queue(CAPACITY)
                self._handed = self._written = 0
                self._progress = threading.Lock()
                self._waiting = []
                thread = threading.Thread(target=self._write, name="ratchet-live", daemon=True)
                thread.start()
                self._pid = os.getpid()

    def _write(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            by_run: dict[str, list[dict[str, Any]]] = {}
            for run_id, entry in batch:
                by_run.setdefault(run_id, []).append(entry)
            for run_id, entries in by_run.items():
                try:
                    self.stream.add(run_id, entries, self.maxlen, self.keep_s)
                except Exception as exc:  # noqa: BLE001 - never into a turn: counted, logged
                    if self.observers:
                        self.observers.live_dropped("store", len(entries))
                    self._warn(f"{self.stream.name} failed ({type(exc).__name__}: {exc})")
            for _ in batch:
                self._queue.task_done()
            with self._progress:
                self._written += len(batch)
                while self._waiting and self._waiting[0][0] <= self._written:
                    heapq.heappop(self._waiting)[2].set()
            if self._queue.unfinished_tasks == 0:
                self._idle.set()

    def _warn(self, why: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "live stream: dropping deltas and tool progress (%s); runs go on, and their "
                "event logs are whole (ratchet_live_dropped_total counts what was dropped)",
                why,
            )
