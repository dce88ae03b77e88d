"""Threads a turn uses: callers that bound model and tool calls, and one heartbeat.

Both are per process (a forked pool child makes its own) and reused, because a
thread per call or per turn costs more than most tool calls. In a gevent worker
they are greenlets (Celery patched ``threading`` before this module loaded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tasks import metrics
from tasks.context import Context
from tasks.per_process import PeriodicStats, PerProcess, Rounds

log = logging.getLogger("ratchet.turn")

T = TypeVar("T")


class CallTimedOut(Exception):
    """A model or tool call did not return in time and was abandoned."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} did not return within {timeout_s:g} s and was abandoned")
        self.timeout_s = timeout_s


class _Callers:
    """Daemon threads that run model and tool calls, so a turn can stop waiting for one.

    Reused across calls (a thread per call costs more than most tool calls). A
    call that times out is abandoned, not stopped — Python cannot stop a thread —
    and its thread is written off; a fresh one takes its place, so abandoned calls
    never starve the next turn. Daemon threads never hold the process open at exit.

    The hand-offs are bare locks, not ``threading.Event``s: an Event is a Condition,
    whose wait and notify are Python code, and a call crosses two (47 → 21 µs of CPU
    a call, measured). A slot's ``go`` lock is held while its thread is idle; a call's
    ``done`` lock is held until the call returns.
    """

    def __init__(self) -> None:
        self._idle: list[tuple[threading.Lock, list[Any]]] = []
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        return self.start(fn, what).result(timeout_s)

    def start(self, fn: Callable[[], T], what: str) -> Started[T]:
        """Start ``fn`` on a caller thread and return at once; :meth:`Started.result` waits."""
        with self._lock:
            slot = self._idle.pop() if self._idle else self._spawn()
        go, box = slot
        done = threading.Lock()
        done.acquire()
        box[:] = [fn, done, None, None]
        go.release()
        return Started(self, slot, done, what)

    def _give_back(self, slot: tuple[threading.Lock, list[Any]]) -> None:
        with self._lock:
            self._idle.append(slot)

    @staticmethod
    def _spawn() -> tuple[threading.Lock, list[Any]]:
        go = threading.Lock()
        go.acquire()
        box: list[Any] = [None, None, None, None]

        def serve() -> None:
            while True:
                go.acquire()
                fn, done = box[0], box[1]
                try:
                    box[2], box[3] = fn(), None
                except BaseException as exc:  # handed to the waiting thread as is
                    box[2], box[3] = None, exc
                abandoned = box[0] is None
                done.release()
                if abandoned:
                    return

        threading.Thread(target=serve, name="ratchet-call", daemon=True).start()
        return go, box


class Started(Generic[T]):
    """A call running on a caller thread (:func:`start`)."""

    def __init__(
        self,
        callers: _Callers,
        slot: tuple[threading.Lock, list[Any]],
        done: threading.Lock,
        what: str,
    ) -> None:
        self._callers, self._slot, self._done, self.what = callers, slot, done, what
        self._taken = False

    def done(self) -> bool:
        return self._taken or not self._done.locked()

    def result(self, timeout_s: float) -> T:
        """Wait up to ``timeout_s`` for the call's value (or its exception, raised here).

        Past the timeout the call is abandoned and CallTimedOut raised: its thread is
        written off and exits when (if ever) the call returns. Call once.
        """
        if self._taken:
            raise RuntimeError(f"{self.what}: its result was already taken")
        self._taken = True
        box = self._slot[1]
        if not self._done.acquire(timeout=max(0.0, timeout_s)):
            box[0] = None  # the thread exits when (if ever) the call returns
            raise CallTimedOut(self.what, timeout_s)
        value, error = box[2], box[3]
        self._callers._give_back(self._slot)
        if error is not None:
            raise error
        result: T = value
        return result


_callers = PerProcess(_Callers)


def bounded(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``call`` on a caller thread; raise CallTimedOut if it takes over ``timeout_s``."""
    return _callers().call(call, timeout_s, what)


def start(call: Callable[[], T], what: str) -> Started[T]:
    """Start ``call`` on a caller thread and return at once: calls that run side by side."""
    return _callers().start(call, what)


@dataclass
class _Held:
    ctx: Context
    run_id: str
    owner: str
    renewed_at: float
    """Monotonic time the lease was last taken or renewed (before the call was sent)."""
    releasing: bool = False
    """The turn's last checkpoint, which lets the lease go, is sent or on its way."""


@dataclass
class HeartbeatStats(PeriodicStats):
    """What this process's heartbeat did so far (``heartbeats().stats``).

    ``failed`` counts renewals, not rounds.
    """

    renewed: int = 0
    """Leases renewed."""
    lost: int = 0
    """Leases found taken (or timed out) while their turn was still in progress."""
    largest_batch: int = 0
    """The most leases due in one round."""
    last_late_s: float = 0.0
    """How late the latest round started."""
    max_round_s: float = 0.0
    """The longest round, store calls included."""


class _Heartbeats:
    """One thread per process renews the leases of every turn in progress, in batches.

    Rounds are planned every sixth of the shortest lease held. Each renews, with
    one ``RunStore.renew_leases`` call per store (one Redis pipeline for up to a
    thousand leases), every lease last renewed a third of its length ago or more.
    On time, a lease is renewed between 1/3 and 1/2 of its length after the last
    renewal, so half of it is slack for a round the process was too busy to start
    on time. Lateness is measured every round: kept in :attr:`stats`, recorded as
    the ``ratchet_heartbeat_lateness_seconds`` metric, and logged when a round
    eats a sixth of the lease. Most turns end before their first renewal is due,
    so a thread per turn would be started and joined for nothing.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], _Held] = {}
        self._changed = threading.Condition()
        self._period_s: float | None = None
        """The round period the thread waits with; None while it waits for a lease."""
        self.stats = HeartbeatStats()
        threading.Thread(target=self._run, name="ratchet-heartbeats", daemon=True).start()

    def add(self, ctx: Context, run_id: str, owner: str) -> tuple[str, str]:
        """Renew ``run_id``'s lease, just taken by ``owner``, until :meth:`remove`."""
        key = (run_id, owner)
        with self._changed:
            self._held[key] = _Held(ctx, run_id, owner, time.monotonic())
            # A thread already pacing rounds for leases this long reaches this one in
            # time: waking it would only make it wait again (a context switch a turn).
            if self._period_s is None or ctx.settings.lease_s / 6 < self._period_s:
                self._changed.notify()
        return key

    def releasing(self, key: tuple[str, str]) -> None:
        """The write that releases ``key``'s lease is about to be sent: a round that finds
        the lease gone before :meth:`remove` is not a lease lost. It is still renewed
        while the write is on its way (a store call that fails leaves it held)."""
        with self._changed:
            held = self._held.get(key)
            if held is not None:
                held.releasing = True

    def remove(self, key: tuple[str, str]) -> None:
        with self._changed:
            self._held.pop(key, None)

    def held(self) -> int:
        with self._changed:
            return len(self._held)

    def _run(self) -> None:
        rounds = Rounds(self._changed)
        while True:
            with self._changed:
                shortest = min((h.ctx.settings.lease_s for h in self._held.values()), default=None)
                self._period_s = None if shortest is None else shortest / 6
                started = rounds.wait(self._period_s)
                if started is None:
                    continue
                now, late_s = started
                due = [
                    h
                    for h in self._held.values()
                    if now - h.renewed_at >= h.ctx.settings.lease_s / 3
                ]
            self._round(due, now, late_s)

    def _round(self, due: list[_Held], started: float, late_s: float) -> None:
        batches: dict[tuple[int, float], list[_Held]] = {}
        for held in due:
            batches.setdefault((id(held.ctx.runs), held.ctx.settings.lease_s), []).append(held)
        lost = failed = 0
        for (_, lease_s), batch in batches.items():
            runs = batch[0].ctx.runs
            try:
                gone = set(runs.renew_leases([(h.run_id, h.owner) for h in batch], lease_s))
            except Exception:
                failed += len(batch)
                log.exception(
                    "heartbeat: renewing %d leases failed; retrying next round", len(batch)
                )
                continue
            with self._changed:
                for held in batch:
                    key = (held.run_id, held.owner)
                    if held.run_id not in gone:
                        held.renewed_at = started
                    elif held.releasing:
                        pass  # The turn's last checkpoint let it go; remove() is on its way.
                    elif self._held.pop(key, None) is not None:
                        # Still in its turn: the lease was taken (or timed out and released).
                        log.warning("run %s: lease lost during the turn", held.run_id)
                        lost += 1
                    # Else the turn ended and released its lease while this round was on the way.
        took_s = time.monotonic() - started
        self._account(len(due), lost, failed, late_s, took_s)

    def _account(self, due: int, lost: int, failed: int, late_s: float, took_s: float) -> None:
        stats = self.stats
        stats.rounds += 1
        stats.renewed += due - lost - failed
        stats.lost += lost
        stats.failed += failed
        stats.largest_batch = max(stats.largest_batch, due)
        stats.last_late_s = late_s
        stats.max_late_s = max(stats.max_late_s, late_s)
        stats.max_round_s = max(stats.max_round_s, took_s)
        metrics.heartbeat_round(late_s, took_s, due, lost)
        with self._changed:
            shortest = min((h.ctx.settings.lease_s for h in self._held.values()), default=None)
        if shortest is not None and late_s + took_s > shortest / 6:
            log.warning(
                "heartbeat: a round started %.2f s late and took %.2f s for %d leases; "
                "leases of %g s keep less slack — the process is overloaded: lower its "
                "concurrency",
                late_s,
                took_s,
                due,
                shortest,
            )


_heartbeats = PerProcess(_Heartbeats)


def heartbeats() -> _Heartbeats:
    """This process's heartbeat thread (a forked pool child starts its own)."""
    return _heartbeats()
