"""This process's liveness: who it is, and the thread that tells the run store it is alive.

A lease protects a run from a live worker that is merely slow, so it is long
(``lease_s``). Whether the worker is *dead* can be known much sooner: every
process that takes leases renews a liveness record of ``liveness_s`` every
``heartbeat_interval_s`` from a daemon thread of its own — not the thread of a
turn, so a 20 s tool call or a CPU-bound one does not stop it (a pure-Python
loop gives the GIL up every 5 ms). A run whose lease holder's record lapsed may
be taken at once (:meth:`store.runs.RunStore.claim_lease`); the sweeper finds
such runs through :meth:`~store.runs.RunStore.orphaned`.

The trade-off: a process that is stalled as a whole — SIGSTOP, swapping, a VM
pause, a C extension that holds the GIL — for longer than ``liveness_s -
heartbeat_interval_s`` is declared dead. Its runs move to another worker and
its own writes are then refused (fencing): nothing is lost or done twice by
ratchet, but a non-idempotent tool call it had in flight parks its run for an
operator. The worst lateness a beat saw is kept in :attr:`Beats.stats`.

Every beat first measures the run store's clock against this host's
(:meth:`store.runs.RunStore.measure_clock`: Redis ``TIME``; a SQLite or memory store
is on this host, whose clock is the store's): leases, liveness records and deadlines
are decided on the store's clock, so hosts whose clocks disagree still agree on them.
A host further off than ``max_clock_skew_s`` is taken to be broken: it beats on (its
turns in progress finish) but takes no lease (:class:`runtime.errors.ClockSkewed`)
until the clocks agree again, and says so once in its log.

The process id is ``host:pid:token`` — the token is random per process, so a
restarted worker that gets the same pid (pid 1 in a container) is a new process.
A lease owner id is ``<process id>/<attempt>`` (:func:`tasks.persistence.new_owner`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from runtime.errors import ClockSkewed
from store.clock import ClockReading
from store.runs import Claim, RunStore
from tasks.per_process import PeriodicStats, PerProcess, Rounds
from tasks.settings import Settings

log = logging.getLogger("ratchet.liveness")


class Context(Protocol):
    """What liveness needs of a :class:`tasks.context.Context` (which imports this module,
    to stop beating in a run store it closes)."""

    @property
    def runs(self) -> RunStore: ...

    @property
    def settings(self) -> Settings: ...


_HOST = socket.gethostname().replace("/", "_") or "localhost"
_process_ids = PerProcess(lambda: f"{_HOST}:{os.getpid()}:{uuid.uuid4().hex[:8]}")


def process_id() -> str:
    """This process's id in liveness records and lease owners (a forked child gets its own)."""
    return _process_ids()


@dataclass
class LivenessStats(PeriodicStats):
    """What this process's liveness beats did so far (``beats().stats``)."""

    lapsed: int = 0
    """Beats that found the record had lapsed: the process may have been declared dead."""
    late_s: list[float] = field(default_factory=list)
    """The lateness of the last beats (at most 10,000), for benches."""

    @property
    def beats(self) -> int:
        """The beats made: this thread's rounds."""
        return self.rounds


@dataclass
class _Store:
    runs: weakref.ref[RunStore]
    """Weak: a store nobody uses any more (a test's, a closed context's) is not kept open."""
    liveness_s: float
    interval_s: float
    max_skew_s: float
    beaten_at: float | None = None
    """Monotonic time of the last beat that reached the store."""
    failing: int = 0
    """Beats that failed in a row."""
    skewed: ClockReading | None = None
    """The last clock reading, while it is past ``max_skew_s``: no lease is taken."""


class Beats:
    """One daemon thread per process renews its liveness record in every run store it uses."""

    def __init__(self) -> None:
        self._stores: dict[int, _Store] = {}
        self._changed = threading.Condition()
        self.stats = LivenessStats()
        threading.Thread(target=self._run, name="ratchet-liveness", daemon=True).start()

    def keep_alive(self, ctx: Context) -> None:
        """Make sure ``ctx.runs`` holds a fresh record of this process before it takes a lease.

        The first time (and whenever the thread fell behind by half the liveness) it
        beats here, synchronously: a lease must never be taken by a process that does
        not look alive, or another worker could take it straight back.
        """
        key = id(ctx.runs)
        with self._changed:
            store = self._stores.get(key)
            if store is None or store.runs() is not ctx.runs:  # new, or a dead one's id reused
                store = self._stores[key] = _Store(
                    weakref.ref(ctx.runs),
                    ctx.settings.liveness_s,
                    ctx.settings.heartbeat_interval_s,
                    ctx.settings.max_clock_skew_s,
                )
                self._changed.notify()
            fresh = (
                store.beaten_at is not None
                and time.monotonic() - store.beaten_at < store.liveness_s / 2
            )
        if not fresh:
            self._beat(store, 0.0)
        skewed = store.skewed
        if skewed is not None:
            raise ClockSkewed(skewed.offset_ms, store.max_skew_s, skewed.source)

    def forget(self, runs: RunStore) -> None:
        """Stop beating in ``runs`` (it is being closed); its record then lapses."""
        with self._changed:
            self._stores.pop(id(runs), None)

    def _run(self) -> None:
        rounds = Rounds(self._changed)
        while True:
            with self._changed:
                interval_s = min((s.interval_s for s in self._stores.values()), default=None)
                started = rounds.wait(interval_s)
                if started is None:
                    continue
                late_s = started[1]
                for key in [k for k, v in self._stores.items() if v.runs() is None]:
                    del self._stores[key]
                stores = list(self._stores.values())
            for store in stores:
                self._beat(store, late_s)

    def _beat(self, store: _Store, late_s: float) -> None:
        started = time.monotonic()
        runs = store.runs()
        if runs is None:
            return
        try:
            # First: the record's expiry is then on the store's clock as measured now.
            _check_clock(store, runs.measure_clock())
            was_alive = runs.renew_liveness(process_id(), store.liveness_s)
        except Exception as exc:  # a store error of any backend: try again next period
            self.stats.failed += 1
            store.failing += 1
            if store.failing == 1:  # once per outage, not every half second
                log.warning(
                    "liveness: cannot renew this process's record (%s: %s); trying again "
                    "every %g s — past %g s other workers take this process for dead",
                    type(exc).__name__,
                    " ".join(str(exc).split()),
                    store.interval_s,
                    store.liveness_s,
                )
            return
        if store.failing:
            log.info("liveness: renewed again after %d failed beats", store.failing)
            store.failing = 0
        previous = store.beaten_at
        store.beaten_at = started
        stats = self.stats
        stats.rounds += 1
        stats.max_late_s = max(stats.max_late_s, late_s)
        stats.late_s.append(late_s)
        del stats.late_s[:-10_000]
        if was_alive or previous is None:
            return
        if started - previous >= store.liveness_s:
            stats.lapsed += 1
            log.warning(
                "liveness: this process's record had lapsed (%.2f s since its last beat, a "
                "liveness of %g s): other workers may have declared it dead and taken its "
                "runs; its turns on those runs stop at their next write. The process is "
                "overloaded or was paused: lower its concurrency, or raise RATCHET_LIVENESS_S",
                started - previous,
                store.liveness_s,
            )
        else:
            # Beats on time, yet no live record: the store lost it (a flush, a restart
            # without its append-only file), not this process; the beat has put it back.
            log.info("liveness: this process's record was gone from the run store; renewed")


def _check_clock(store: _Store, reading: ClockReading | None) -> None:
    if reading is None or abs(reading.offset_ms) <= store.max_skew_s * 1000:
        if store.skewed is not None:
            log.warning("liveness: this host's clock agrees with the run store's again; "
                        "taking leases again")  # fmt: skip
        store.skewed = None
        return
    if store.skewed is None:  # once, not every beat
        skew = ClockSkewed(reading.offset_ms, store.max_skew_s, reading.source)
        log.error("liveness: taking no lease until the clocks agree: %s", skew)
    store.skewed = reading


_beats = PerProcess(Beats)


def beats() -> Beats:
    """This process's liveness thread (a forked pool child starts its own)."""
    return _beats()


def forget(runs: RunStore) -> None:
    """``runs`` is being closed: this process stops beating in it (if it ever did)."""
    found = _beats.made()
    if found is not None:
        found.forget(runs)


def claim(ctx: Context, run_id: str, owner: str) -> Claim:
    """Take the run's lease for ``owner`` (of this process), also from a dead holder."""
    beats().keep_alive(ctx)
    found = ctx.runs.claim_lease(run_id, owner, ctx.settings.lease_s)
    if found.took_from is not None:
        log.warning(
            "run %s: took the lease from %s, whose process stopped renewing its liveness "
            "(%g s): it is taken to be dead",
            run_id,
            found.took_from,
            ctx.settings.liveness_s,
        )
    return found
