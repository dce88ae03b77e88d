"""OpenTelemetry traces of runs: one span per committed transition, never two.

Switched on by ``RATCHET_OTEL_EXPORTER`` (``otlp``, ``console``, or ``module:callable``
returning a ``SpanExporter``) with ``pip install 'ratchet[otel]'``. Set when a context
is built (tasks/context.py), it puts a :class:`TracingObserver` on the context's list of
observers (tasks/observers.py); unset, nothing here imports opentelemetry and no code of
this module runs in a turn.

Spans are **derived from the event log**, not from the code that runs: they are
emitted from the observer's ``committed`` hook *after* the append committed, by
the process whose append closed them. An event is committed exactly once (fenced by
seq and the lease), so a recovered, redelivered or retried turn cannot emit a span
for a transition that is already in the log: it never appends that event again.
The price is at-most-once: a process killed between its commit and the export
loses those spans (the ``otlp`` exporter batches; ``console`` and custom exporters
export each span as it ends).

One trace per run, its id derived from the run (:func:`trace_id_of`), and
deterministic span ids, so spans emitted by different workers at different times
nest without any of them holding the others in memory::

    ratchet.run       run.created → run.completed | failed | cancelled | expired
    └ ratchet.turn    first model.requested of turn N → the last event before turn N+1
      ├ ratchet.model       model.requested → model.responded | model.failed
      ├ ratchet.tool        tool.requested → tool.completed | tool.failed | tool.reconciled
      └ ratchet.suspension  run.suspended → run.continued | expired | cancelled

A model request cut short by a crash has no outcome event and so no span; the turn's
``ratchet.model_attempts`` attribute counts it. Parked, stalled and dead-lettered runs
can be resumed, so they close nothing; their spans close when the run goes on.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from celery.signals import worker_init, worker_process_shutdown
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.errors import ConfigInvalid
from runtime.models import Event, RunState, RunStatus
from tasks.observers import Observer

if TYPE_CHECKING:
    from store import RunStore

log = logging.getLogger("ratchet.tracing")

RUN_ENDS = frozenset({"run.completed", "run.failed", "run.cancelled", "run.expired"})
"""Events after which nothing can move the run on: they close the run's span."""
TOOL_ENDS = frozenset({"tool.completed", "tool.failed", "tool.reconciled", "tool.unsent"})
SUSPENSION_ENDS = frozenset(
    {"run.continued", "run.woken", "run.expired", "run.cancelled", "run.budget_raised"}
)


class TracingSettings(BaseSettings):
    """Tracing's settings live with the optional extra, not in the core Settings."""

    model_config = SettingsConfigDict(env_prefix="RATCHET_", extra="ignore")

    otel_exporter: str = ""
    """``otlp`` (OTEL_EXPORTER_OTLP_* say where), ``console``, ``module:callable``, or empty: off."""


# --- what the log says: pure, no opentelemetry ----------------------------------------


@dataclass(frozen=True)
class SpanSpec:
    """One span to emit: everything is derived from committed events."""

    name: str
    key: str
    """Names the span within its run's trace; its span id is derived from it."""
    parent_key: str | None
    start_ms: int
    end_ms: int
    attributes: dict[str, Any]
    error: str | None = None


@dataclass
class Cursor:
    """What a run has open, after the event at ``seq``: enough to close it later."""

    seq: int
    last_at_ms: int = 0
    turn: int = 0
    turn_start: Event | None = None
    turn_usage: tuple[int, int] = (0, 0)
    attempts: int = 0
    model_start: Event | None = None
    tools: dict[str, Event] = field(default_factory=dict)
    suspended: Event | None = None


def _turn_key(turn: int) -> str:
    return f"turn:{turn}"


def _usage(data: dict[str, Any]) -> tuple[int, int]:
    usage = data.get("usage") or {}
    return int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))


def step(cursor: Cursor, event: Event, state: RunState) -> tuple[Cursor, list[SpanSpec]]:
    """Fold one committed event into ``cursor``; the spans it closes. Pure.

    ``state`` is the run's state after ``event`` (for the run-wide attributes).
    """
    base = {"ratchet.run_id": state.run_id, "ratchet.agent": state.agent}
    spans: list[SpanSpec] = []
    c = replace(cursor, seq=event.seq, tools=dict(cursor.tools))
    kind, data = event.type, event.data
    if kind == "model.requested":
        turn = int(data.get("turn", c.turn + 1))
        if turn != c.turn:
            if c.turn_start is not None:
                spans.append(_turn_span(c, base))
            c.turn, c.turn_start, c.turn_usage, c.attempts = turn, event, (0, 0), 0
        c.attempts += 1
        c.model_start = event
    elif kind in ("model.responded", "model.failed") and c.model_start is not None:
        tokens_in, tokens_out = _usage(data)
        c.turn_usage = (c.turn_usage[0] + tokens_in, c.turn_usage[1] + tokens_out)
        attributes = {
            **base,
            "ratchet.seq": event.seq,
            "ratchet.turn": c.turn,
            "gen_ai.usage.input_tokens": tokens_in,
            "gen_ai.usage.output_tokens": tokens_out,
            "ratchet.tool_calls_asked": len(data.get("tool_calls", ())),
        }
        spans.append(
            SpanSpec(
                "ratchet.model",
                f"model:{c.model_start.seq}",
                _turn_key(c.turn),
                c.model_start.at_ms,
                event.at_ms,
                attributes,
                error=str(data.get("error")) if kind == "model.failed" else None,
            )
        )
        c.model_start = None
    elif kind == "tool.requested":
        c.tools[str(data["call_id"])] = event
    elif ends_call(kind, data) and str(data.get("call_id")) in c.tools:
        spans.append(_tool_span(c, event, base))
    # A run stopped on a budget may be given more (run.budget_raised) and go on: its
    # stop is a suspension of the trace, not its end, and the run span waits for that.
    budget_stop = kind == "run.failed" and bool(data.get("budget"))
    if budget_stop and c.turn_start is not None:
        c.last_at_ms = event.at_ms
        spans.append(_turn_span(c, base))
        c.turn_start = None
    if kind == "run.suspended" or budget_stop:
        c.suspended = event
    elif kind in SUSPENSION_ENDS and c.suspended is not None:
        spans.append(_suspension_span(c, event, base))
        c.suspended = None
    if kind in RUN_ENDS and not budget_stop:
        if c.turn_start is not None:
            c.last_at_ms = event.at_ms
            spans.append(_turn_span(c, base))
            c.turn_start = None
        spans.append(_run_span(event, state, base))
    c.last_at_ms = event.at_ms
    return c, spans


def _turn_span(c: Cursor, base: dict[str, Any]) -> SpanSpec:
    assert c.turn_start is not None
    return SpanSpec(
        "ratchet.turn",
        _turn_key(c.turn),
        "run",
        c.turn_start.at_ms,
        c.last_at_ms,
        {
            **base,
            "ratchet.seq": c.turn_start.seq,
            "ratchet.turn": c.turn,
            "ratchet.model_attempts": c.attempts,
            "gen_ai.usage.input_tokens": c.turn_usage[0],
            "gen_ai.usage.output_tokens": c.turn_usage[1],
        },
    )


def ends_call(kind: str, data: dict[str, Any]) -> bool:
    """An outcome: also a probe that found the effect of a call cut short (runtime/probes.py)."""
    return kind in TOOL_ENDS or (kind == "tool.probed" and data.get("answer") == "ran")


def _tool_span(c: Cursor, event: Event, base: dict[str, Any]) -> SpanSpec:
    data = event.data
    call_id = str(data["call_id"])
    start = c.tools.pop(call_id)
    attributes = {
        **base,
        "ratchet.seq": event.seq,
        "ratchet.turn": c.turn,
        "ratchet.call_id": call_id,
        "gen_ai.tool.name": str(start.data.get("name", "")),
    }
    error = None
    if event.type == "tool.probed":
        attributes["ratchet.probed"] = str(data.get("answer"))
    if event.type == "tool.failed":
        error = str(data.get("error", ""))
    elif event.type == "tool.unsent":
        error = f"not sent: {data.get('reason', '')}"
    elif event.type == "tool.reconciled":
        decision = str(data.get("decision"))
        attributes["ratchet.reconciled"] = decision
        if decision == "retry":
            # The call is run again: a new tool.requested opens a new span.
            error = "outcome unknown; an operator chose to run it again"
        elif decision == "fail":
            error = str(data.get("reason", ""))
    return SpanSpec(
        "ratchet.tool",
        f"tool:{call_id}:{start.seq}",
        _turn_key(c.turn),
        start.at_ms,
        event.at_ms,
        attributes,
        error,
    )


def _suspension_span(c: Cursor, event: Event, base: dict[str, Any]) -> SpanSpec:
    assert c.suspended is not None
    data = c.suspended.data
    return SpanSpec(
        "ratchet.suspension",
        f"suspension:{c.suspended.seq}",
        _turn_key(c.turn) if c.turn_start is not None else "run",
        c.suspended.at_ms,
        event.at_ms,
        {
            **base,
            "ratchet.seq": event.seq,
            "ratchet.reason": str(data.get("reason", "")),
            "ratchet.call_id": str(data.get("call_id", "")),
            "ratchet.answered_by": event.type,
        },
    )


def _run_span(event: Event, state: RunState, base: dict[str, Any]) -> SpanSpec:
    u = state.usage
    return SpanSpec(
        "ratchet.run",
        "run",
        None,
        state.created_at_ms,
        event.at_ms,
        {
            **base,
            "ratchet.seq": event.seq,
            "ratchet.status": state.status.value,
            "ratchet.model_turns": u.model_turns,
            "ratchet.tool_calls": u.tool_calls,
            "gen_ai.usage.input_tokens": u.input_tokens,
            "gen_ai.usage.output_tokens": u.output_tokens,
        },
        error=state.error if event.type != "run.completed" else None,
    )


def covers_open_turn(events: list[Event], start_seq: int) -> bool:
    """Whether folding ``events`` (those after ``start_seq``) finds what the run has open.

    Everything open belongs to the latest turn, so the window must reach back past the
    first request of that turn: to an event that cannot lie between two requests of one
    turn (a response, a tool event, an earlier turn's request) or to the run's start.
    """
    if start_seq == 0:
        return True
    requests = [i for i, e in enumerate(events) if e.type == "model.requested"]
    if not requests:
        return False
    turn = events[requests[-1]].data.get("turn")
    first = next(i for i in requests if events[i].data.get("turn") == turn)
    return any(
        e.type == "model.responded"
        or e.type.startswith("tool.")
        or (e.type == "model.requested" and e.data.get("turn") != turn)
        for e in events[:first]
    )


def fold(events: list[Event], state: RunState, start_seq: int = 0) -> Cursor:
    """The cursor after ``events``; their spans are discarded (they were emitted before)."""
    cursor = Cursor(seq=start_seq)
    for event in events:
        cursor, _ = step(cursor, event, state)
    return cursor


def rebuild_cursor(
    read: Callable[[int, int], list[Event]], state: RunState, upto_seq: int, window: int = 64
) -> Cursor:
    """The cursor at ``upto_seq`` from the log's tail, read by ``read(after_seq, limit)``.

    For a process that did not append the run's previous events (another worker took
    the turn before): it reads a window of the tail, widening it until the window
    reaches back past the open turn's first request.
    """
    while True:
        start = max(0, upto_seq - window)
        events = read(start, upto_seq - start)
        if covers_open_turn(events, start):
            return fold(events, state, start)
        window *= 4


def trace_id_of(run_id: str, created_at_ms: int) -> int:
    """The 128-bit trace id of a run; ids reused after a purge get a new trace."""
    digest = hashlib.sha256(f"ratchet:{run_id}:{created_at_ms}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


def span_id_of(trace_id: int, key: str) -> int:
    digest = hashlib.sha256(f"{trace_id:032x}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


# --- emitting: only here is opentelemetry imported --------------------------------------


class _Tracing:
    """This process's tracer provider, exporter and the cursors of runs it touched."""

    CURSORS_KEPT = 256

    def __init__(self, exporter_name: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.id_generator import IdGenerator

        ids = threading.local()

        class _DerivedIds(IdGenerator):
            # The SDK asks its IdGenerator for every new span's id; ours come from the log.
            def generate_span_id(self) -> int:
                return int(ids.span_id)

            def generate_trace_id(self) -> int:
                return int(ids.trace_id)

        self._ids = ids
        self.exporter = _exporter(exporter_name)
        processor = (
            BatchSpanProcessor(self.exporter)
            if exporter_name == "otlp"
            else SimpleSpanProcessor(self.exporter)
        )
        self.provider = TracerProvider(
            resource=Resource.create(
                {"service.name": os.environ.get("OTEL_SERVICE_NAME", "ratchet")}
            ),
            id_generator=_DerivedIds(),
        )
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("ratchet")
        self._cursors: OrderedDict[str, Cursor] = OrderedDict()
        self._lock = threading.Lock()

    def committed(self, runs: RunStore, after: RunState, events: Sequence[Event]) -> None:
        run_id, before_seq = after.run_id, events[0].seq - 1
        with self._lock:
            cursor = self._cursors.pop(run_id, None)
        if cursor is None or cursor.seq != before_seq:
            cursor = self._rebuild(runs, after, before_seq)
        spans: list[SpanSpec] = []
        for event in events:
            cursor, closed = step(cursor, event, after)
            spans.extend(closed)
        with self._lock:
            self._cursors[run_id] = cursor
            while len(self._cursors) > self.CURSORS_KEPT:
                self._cursors.popitem(last=False)
        trace_id = trace_id_of(run_id, after.created_at_ms)
        for spec in spans:
            self._emit(trace_id, spec)

    def _rebuild(self, runs: RunStore, state: RunState, upto_seq: int) -> Cursor:
        return rebuild_cursor(
            lambda after, limit: runs.events(state.run_id, after_seq=after, limit=limit),
            state,
            upto_seq,
        )

    def _emit(self, trace_id: int, spec: SpanSpec) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

        parent = None
        if spec.parent_key is not None:
            parent = trace.set_span_in_context(
                trace.NonRecordingSpan(
                    SpanContext(
                        trace_id,
                        span_id_of(trace_id, spec.parent_key),
                        is_remote=False,
                        trace_flags=TraceFlags(TraceFlags.SAMPLED),
                    )
                )
            )
        self._ids.trace_id, self._ids.span_id = trace_id, span_id_of(trace_id, spec.key)
        span = self.tracer.start_span(
            spec.name,
            context=parent,
            attributes=spec.attributes,
            start_time=spec.start_ms * 1_000_000,
        )
        if spec.error is not None:
            span.set_status(Status(StatusCode.ERROR, spec.error[:500]))
        span.end(end_time=spec.end_ms * 1_000_000)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _exporter(name: str) -> Any:
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ConfigInvalid(
            "RATCHET_OTEL_EXPORTER",
            f"RATCHET_OTEL_EXPORTER={name!r}: give otlp, console or module:callable "
            "(a callable returning a SpanExporter)",
        )
    try:
        factory: Callable[[], Any] = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigInvalid(
            "RATCHET_OTEL_EXPORTER",
            f"RATCHET_OTEL_EXPORTER={name!r}: {exc}; give otlp, console or module:callable",
        ) from exc
    return factory()


_tracing: _Tracing | None = None
_tracing_pid: int | None = None
_tracing_lock = threading.Lock()


def enabled() -> _Tracing | None:
    """This process's tracing, set up on first use (after a prefork pool forked); None if off.

    Raises ImportError naming the extra when it is switched on without opentelemetry.
    """
    global _tracing, _tracing_pid
    if _tracing_pid == os.getpid():
        return _tracing
    with _tracing_lock:
        if _tracing_pid != os.getpid():
            # Set first: a setting that fails fails once, not at every append.
            _tracing, _tracing_pid = None, os.getpid()
            name = TracingSettings().otel_exporter.strip()
            if name:
                try:
                    import opentelemetry.sdk.trace  # noqa: F401
                except ImportError as exc:
                    raise ImportError(
                        f"RATCHET_OTEL_EXPORTER={name} is set but opentelemetry is not "
                        "installed: pip install 'ratchet[otel]'"
                    ) from exc
                _tracing = _Tracing(name)
    return _tracing


@worker_init.connect
def _check_at_worker_start(**_: Any) -> None:
    # A worker that was asked to trace and cannot refuses to start, saying why.
    try:
        enabled()
    except Exception as exc:
        # SystemExit passes through Celery's signal dispatch (it catches Exception only).
        print(f"ratchet: refusing to start: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from exc


@worker_process_shutdown.connect
def _flush_at_exit(**_: Any) -> None:
    if _tracing is not None and _tracing_pid == os.getpid():
        _tracing.provider.force_flush()


def configured() -> bool:
    """Whether ``RATCHET_OTEL_EXPORTER`` asks for traces (what :func:`enabled` reads)."""
    return bool(TracingSettings().otel_exporter.strip())


class TracingObserver(Observer):
    """Emits the spans each commit closes, read back from ``runs`` when this process has
    no cursor of the run (another worker appended its previous events).

    On a context built while :func:`configured` (tasks/context.py). The tracer itself is
    still set up per process on first use (:func:`enabled`): a prefork pool's children
    each set up their own, and :func:`reset` lets a test switch exporters.
    """

    def __init__(self, runs: RunStore) -> None:
        self.runs = runs

    def committed(
        self, before: RunStatus, after: RunStatus, events: Sequence[Event], state: RunState | None
    ) -> None:
        """Emit the spans ``events`` close; called only once they are committed.

        Without the run's state (an ending appended without it) there is nothing to emit
        (as before the observers: only a fold's commits were traced). Never raises: a
        trace that cannot be written must not stop a run that was recorded.
        """
        if state is None:
            return
        try:
            tracing = enabled()
            if tracing is not None and events:
                tracing.committed(self.runs, state, events)
        except Exception:
            log.exception("run %s: could not emit trace spans", state.run_id)


def reset() -> None:
    """Forget this process's tracing (tests switch exporters between runs)."""
    global _tracing, _tracing_pid
    with _tracing_lock:
        if _tracing is not None:
            _tracing.shutdown()
        _tracing, _tracing_pid = None, None
