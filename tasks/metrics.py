"""Prometheus metrics of a worker: on when ``RATCHET_METRICS_PORT`` is set, else no-ops.

The server binds ``RATCHET_METRICS_ADDRESS``, 127.0.0.1 by default: the metrics
name runs' statuses and tools' outcomes, which is nobody else's business, and a
scraper on another host is a choice an operator makes (``0.0.0.0`` or an interface's
address), not a default.

``pip install 'ratchet[metrics]'`` (prometheus-client). The tasks reach the metrics
through :class:`MetricsObserver`, on a context's list of observers (tasks/observers.py)
only while ``RATCHET_METRICS_PORT`` is set: unset, no code of this module runs in a turn.

**Prefork.** Celery's prefork pool runs turns in child processes, and a child
cannot serve the port its parent owns. So ratchet uses prometheus-client's
*multiprocess mode*: at ``worker_init`` (in the main process, before the pool
forks) it points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory (an
operator's own setting is used instead, and emptied), and starts one HTTP server
on the port that sums every process's memory-mapped files at scrape time. Each
pool child writes its own file; a child that dies or is replaced keeps its
counts. The threads and solo pools record in the main process, which works the
same way. Two workers on one host need two ports (and, if set, two directories).

Exposed (all counters except the two histograms):

- ``ratchet_events_total{type}`` — events appended;
- ``ratchet_run_transitions_total{status}`` — runs entering a status (completed,
  failed, suspended, …: the runs-by-status picture, counted, not scanned);
- ``ratchet_turns_total{outcome}`` — turn tasks by outcome, a
  :class:`runtime.actions.TurnOutcome` (next, completed, suspended, stalled,
  leased, stale, …);
- ``ratchet_checkpoint_seconds``, ``ratchet_checkpoint_bytes`` — snapshot save
  latency and bytes written per checkpoint;
- ``ratchet_heartbeat_lateness_seconds`` (histogram), ``ratchet_heartbeat_max_lateness_seconds``
  (gauge, the worst of any process), ``ratchet_lease_renewals_total``,
  ``ratchet_leases_lost_total`` — the heartbeat that renews every turn's lease;
- ``ratchet_resumes_total{by}`` (sweeper, operator), ``ratchet_suspensions_total{reason}``,
  ``ratchet_continuations_total``, ``ratchet_parked_total``, ``ratchet_dead_lettered_total``,
  ``ratchet_purged_runs_total``;
- ``ratchet_throttled_total{reason}`` — turns put back on the queue by a limit
  (reserved, over_limit, 429, concurrency); ``ratchet_limit_checks_total{outcome}``
  and ``ratchet_limit_check_seconds_total`` — the limit store's answers and the time
  they took; ``ratchet_turn_seconds_total{throttled}`` — time inside turn tasks,
  split by whether the turn ended waiting on a limit (the slot time waiting costs).
  ``ratchet limits`` shows each limit's use this minute, its lines and its places.
- ``ratchet_unreplicated_calls_total`` — tool calls not started because the run store's
  replicas did not acknowledge their journal entry within ``replica_timeout_ms``
  (``min_replicas``, store/replicas.py): each stalls its run until an operator resumes it;
- ``ratchet_live_dropped_total{reason}`` — live-stream entries (model deltas, tool
  progress) dropped rather than hold a turn: ``full`` (the writer's queue), ``store``
  (the stream's store failed) or ``too_large`` (a model call's pieces past their
  bound); the event log never drops anything.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery.signals import worker_init, worker_shutdown

from runtime.actions import TurnOutcome
from runtime.models import Event, RunState, RunStatus
from tasks.observers import Observer
from tasks.settings import get_settings

log = logging.getLogger("ratchet.metrics")

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
HEARTBEAT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5)
SIZE_BUCKETS = (256, 1024, 4096, 16_384, 65_536, 262_144, 1_048_576, 4_194_304, 16_777_216)


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Any:
            return Counter(name, doc, labels, registry=None)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, buckets=buckets, registry=None)

        self.events = counter("ratchet_events", "Events appended, by type.", ["type"])
        self.transitions = counter("ratchet_run_transitions", "Runs entering a status.", ["status"])
        self.turns = counter("ratchet_turns", "Turn tasks, by outcome.", ["outcome"])
        self.checkpoint_s = histogram(
            "ratchet_checkpoint_seconds", "Snapshot save latency.", LATENCY_BUCKETS_S
        )
        self.checkpoint_bytes = histogram(
            "ratchet_checkpoint_bytes", "Bytes written per snapshot save.", SIZE_BUCKETS
        )
        self.resumes = counter("ratchet_resumes", "Runs resumed, by who resumed them.", ["by"])
        self.suspensions = counter("ratchet_suspensions", "Runs suspended, by reason.", ["reason"])
        self.continuations = counter("ratchet_continuations", "Continuations applied.")
        self.parked = counter("ratchet_parked", "Runs parked for reconciliation.")
        self.dead_lettered = counter("ratchet_dead_lettered", "Runs dead-lettered by the sweeper.")
        self.purged = counter("ratchet_purged_runs", "Finished runs purged by retention.")
        self.heartbeat_late_s = histogram(
            "ratchet_heartbeat_lateness_seconds",
            "How long after its planned time a heartbeat round started.",
            HEARTBEAT_BUCKETS_S,
        )
        self.heartbeat_max_late_s = Gauge(
            "ratchet_heartbeat_max_lateness_seconds",
            "The latest a heartbeat round started, in any process.",
            registry=None,
            multiprocess_mode="max",
        )
        self.renewals = counter("ratchet_lease_renewals", "Leases renewed by heartbeats.")
        self.leases_lost = counter("ratchet_leases_lost", "Leases a heartbeat found taken.")
        self.throttled = counter(
            "ratchet_throttled", "Turns put back on the queue by a limit.", ["reason"]
        )
        self.limit_checks = counter(
            "ratchet_limit_checks", "Answers of the limit store, by outcome.", ["outcome"]
        )
        self.limit_check_s = counter(
            "ratchet_limit_check_seconds", "Time spent asking the limit store."
        )
        self.live_dropped = counter(
            "ratchet_live_dropped",
            "Live-stream entries (deltas, tool progress) dropped, by why.",
            ["reason"],
        )
        self.unreplicated = counter(
            "ratchet_unreplicated_calls",
            "Tool calls not started: the run store's replicas did not acknowledge their journal.",
        )
        self.turn_s = counter(
            "ratchet_turn_seconds", "Time inside turn tasks, by whether they waited.", ["throttled"]
        )


_on: _Metrics | None = None
_made_directory: Path | None = None

_BY_TYPE = {
    "run.continued": "continuations",
    "run.parked": "parked",
    "run.dead_lettered": "dead_lettered",
}


# --- the observer (tasks/observers.py) ------------------------------------------------


class MetricsObserver(Observer):
    """Counts what the tasks do, once :func:`enable` ran in this process (at ``worker_init``);
    on every context built while ``RATCHET_METRICS_PORT`` is set (tasks/context.py), since a
    context may be built before the worker starts."""

    def committed(
        self, before: RunStatus, after: RunStatus, events: Sequence[Event], state: RunState | None
    ) -> None:
        if _on is None:
            return
        for event in events:
            _on.events.labels(event.type).inc()
            if event.type == "run.resumed":
                _on.resumes.labels(str(event.data.get("by", "unknown"))).inc()
            elif event.type == "run.suspended":
                _on.suspensions.labels(str(event.data.get("reason", "unknown"))).inc()
            elif event.type in _BY_TYPE:
                getattr(_on, _BY_TYPE[event.type]).inc()
        if after != before:
            _on.transitions.labels(after.value).inc()

    def turn_ended(self, outcome: TurnOutcome, seconds: float, throttled: bool) -> None:
        if _on is not None:
            _on.turn_s.labels("yes" if throttled else "no").inc(seconds)
            _on.turns.labels(outcome).inc()

    def throttled(self, reason: str) -> None:
        if _on is not None:
            _on.throttled.labels(reason).inc()

    def live_dropped(self, reason: str, entries: int) -> None:
        if _on is not None:
            _on.live_dropped.labels(reason).inc(entries)

    def limit_checked(self, seconds: float, outcome: str) -> None:
        if _on is not None:
            _on.limit_checks.labels(outcome).inc()
            _on.limit_check_s.inc(seconds)

    def checkpointed(self, seconds: float, nbytes: int | None) -> None:
        if _on is None:
            return
        _on.checkpoint_s.observe(seconds)
        if nbytes is not None:
            _on.checkpoint_bytes.observe(nbytes)

    def purged(self, count: int) -> None:
        if _on is not None and count:
            _on.purged.inc(count)

    def unreplicated(self, calls: int) -> None:
        if _on is not None:
            _on.unreplicated.inc(calls)


# --- the heartbeat: the process's, not a context's ------------------------------------


def heartbeat_round(late_s: float, took_s: float, leases: int, lost: int) -> None:
    """A heartbeat round started ``late_s`` after its planned time and renewed ``leases``.

    Called by the process's one heartbeat thread (tasks/threads.py), whose rounds renew
    the leases of every context of the process at once: a round is no context's to
    observe, and the gauge of its lateness is the process's.
    """
    if _on is None:
        return
    global _worst_late_s
    _on.heartbeat_late_s.observe(late_s)
    if late_s > _worst_late_s:
        _worst_late_s = late_s
        _on.heartbeat_max_late_s.set(late_s)
    _on.renewals.inc(leases - lost)
    if lost:
        _on.leases_lost.inc(lost)


_worst_late_s = 0.0


# --- switching on ------------------------------------------------------------------


def enable(port: int, directory: Path | None = None, address: str = "127.0.0.1") -> None:
    """Multiprocess mode in ``directory`` (default: a new temporary one); serve ``address:port``.

    Call in the worker's main process before the pool forks. Raises ImportError
    naming the extra when prometheus-client is missing.
    """
    global _on, _made_directory
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "RATCHET_METRICS_PORT is set but prometheus-client is not installed: "
            "pip install 'ratchet[metrics]'"
        ) from exc
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server, values

    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="ratchet-metrics-"))
        _made_directory = directory
    directory.mkdir(parents=True, exist_ok=True)
    # Files left by an earlier worker would be summed into this one's counts.
    for stale in directory.glob("*.db"):
        stale.unlink()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    # prometheus-client picks its value class when first imported; pick again now.
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    start_http_server(port, addr=address, registry=registry)
    _on = _Metrics()
    shown = f"[{address}]" if ":" in address else address
    log.info("metrics on %s:%s/metrics (multiprocess directory %s)", shown, port, directory)


@worker_init.connect
def _enable_at_worker_start(**_: Any) -> None:
    settings = get_settings()
    if settings.metrics_port is None:
        return
    configured = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    enable(
        settings.metrics_port, Path(configured) if configured else None, settings.metrics_address
    )


@worker_shutdown.connect
def _remove_directory(**_: Any) -> None:
    if _made_directory is not None:
        shutil.rmtree(_made_directory, ignore_errors=True)
