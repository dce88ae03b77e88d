"""Spans of a run, derived from its committed events: in-process, with the SDK's exporter.

The crash half of the story (a worker killed at a failpoint, another one
finishing) is tests/crash/test_tracing.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.fsm import rebuild
from runtime.models import Event
from tasks import tracing
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent
from tests.test_golden_event_logs import LOGS, read_log
from tests.workers import ROOT, WorkerProcess, worker_env


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    monkeypatch.setenv("RATCHET_OTEL_EXPORTER", "tests.tracing_sink:exporter")
    monkeypatch.delenv("RATCHET_TEST_SPAN_LOG", raising=False)
    tracing.reset()
    on = tracing.enabled()
    assert on is not None
    try:
        yield on.exporter
    finally:
        tracing.reset()


def three_turns(directory: Path) -> Path:
    return write_agent(
        directory,
        [
            turn("look", call("lookup_order", order_id="B2"), tokens=(100, 10)),
            turn("policy", call("refund_policy"), tokens=(200, 20)),
            turn("Refunded.", tokens=(300, 30)),
        ],
    )


@pytest.mark.timeout(60)
def test_a_three_turn_run_is_one_trace_of_nested_spans_with_its_usage(
    exporter: object, tmp_path: Path, ledger: Path
) -> None:
    # Given a three-turn run taken in this process with tracing on
    ctx = memory_context()
    state = create_run(ctx, three_turns(tmp_path), "refund B2")
    # When it runs to completion
    assert drive(ctx, state.run_id).outcome == "completed"
    spans = exporter.get_finished_spans()  # type: ignore[attr-defined]
    events = ctx.runs.events(state.run_id)
    by_name: dict[str, list[object]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    # Then there is one span per closing transition: 1 run, 3 turns, 3 model calls, 2 tools
    assert {k: len(v) for k, v in by_name.items()} == {
        "ratchet.run": 1,
        "ratchet.turn": 3,
        "ratchet.model": 3,
        "ratchet.tool": 2,
    }
    # And all are in the run's trace, nested run > turn > model | tool, ids all distinct
    trace_id = tracing.trace_id_of(state.run_id, state.created_at_ms)
    assert {s.context.trace_id for s in spans} == {trace_id}
    assert len({s.context.span_id for s in spans}) == len(spans)
    (run,) = by_name["ratchet.run"]
    assert run.parent is None  # type: ignore[attr-defined]
    turns = {s.attributes["ratchet.turn"]: s for s in by_name["ratchet.turn"]}  # type: ignore[attr-defined]
    assert sorted(turns) == [1, 2, 3]
    for t in turns.values():
        assert t.parent.span_id == run.context.span_id  # type: ignore[attr-defined]
    for s in by_name["ratchet.model"] + by_name["ratchet.tool"]:
        parent = turns[s.attributes["ratchet.turn"]]  # type: ignore[attr-defined]
        assert s.parent.span_id == parent.context.span_id  # type: ignore[attr-defined]
    # And the attributes carry the run, the agent, the seq, the call id and the tokens
    responded = [e for e in events if e.type == "model.responded"]
    models = sorted(by_name["ratchet.model"], key=lambda s: s.attributes["ratchet.seq"])  # type: ignore[attr-defined]
    assert [m.attributes["ratchet.seq"] for m in models] == [e.seq for e in responded]  # type: ignore[attr-defined]
    assert [m.attributes["gen_ai.usage.input_tokens"] for m in models] == [100, 200, 300]  # type: ignore[attr-defined]
    assert {m.attributes["ratchet.run_id"] for m in models} == {state.run_id}  # type: ignore[attr-defined]
    assert {m.attributes["ratchet.agent"] for m in models} == {"test-agent"}  # type: ignore[attr-defined]
    requested = {e.data["call_id"] for e in events if e.type == "tool.requested"}
    assert {s.attributes["ratchet.call_id"] for s in by_name["ratchet.tool"]} == requested  # type: ignore[attr-defined]
    assert run.attributes["gen_ai.usage.output_tokens"] == 60  # type: ignore[attr-defined]
    assert run.attributes["ratchet.status"] == "completed"  # type: ignore[attr-defined]
    # And each span lies inside its parent's time
    for s in spans:
        if s.parent is not None:
            parent = next(p for p in spans if p.context.span_id == s.parent.span_id)
            assert parent.start_time <= s.start_time <= s.end_time <= parent.end_time


def _spans(cursor: tracing.Cursor, events: list[Event], state: object) -> list[tracing.SpanSpec]:
    out: list[tracing.SpanSpec] = []
    for event in events:
        cursor, closed = tracing.step(cursor, event, state)  # type: ignore[arg-type]
        out.extend(closed)
    return out


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_a_worker_that_takes_a_run_over_at_any_seq_emits_what_one_worker_would(
    path: Path,
) -> None:
    # Given a recorded run, and the spans one process appending all of it emits
    events = read_log(path)
    state = rebuild(events)
    assert state is not None
    whole = _spans(tracing.Cursor(seq=0), events, state)
    # Then each closing transition has exactly one span, whatever the run went through
    closing = [e for e in events if e.type in ("model.responded", "model.failed")]
    assert len([s for s in whole if s.name == "ratchet.model"]) == len(closing)
    # A call refused before it was requested (a `run_child` past the tree's bounds) has no
    # span: it never started. Every requested call that ended has exactly one.
    requested = {e.data["call_id"] for e in events if e.type == "tool.requested"}
    tool_ends = [
        e
        for e in events
        if tracing.ends_call(e.type, e.data) and e.data.get("call_id") in requested
    ]
    assert len([s for s in whole if s.name == "ratchet.tool"]) == len(tool_ends)
    assert len({s.key for s in whole}) == len(whole)
    for k in range(1, len(events)):
        # When another worker appends from seq k on, rebuilding from a small window
        cursor = tracing.rebuild_cursor(
            lambda after, limit: events[after : after + limit], state, k, window=2
        )
        # Then together they emit exactly the spans of the single worker
        before = _spans(tracing.Cursor(seq=0), events[:k], state)
        assert before + _spans(cursor, events[k:], state) == whole, k


@pytest.mark.timeout(60)
def test_without_the_setting_no_opentelemetry_module_is_imported(tmp_path: Path) -> None:
    # Given a process that takes a whole run with RATCHET_OTEL_EXPORTER unset
    agent = three_turns(tmp_path)
    code = (
        "import sys\n"
        "from tasks.start import create_run\n"
        "from tests.helpers import drive, memory_context\n"
        "ctx = memory_context()\n"
        f"run = create_run(ctx, {str(agent)!r}, 'refund B2')\n"
        "assert drive(ctx, run.run_id).outcome == 'completed'\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "RATCHET_EXAMPLE_LEDGER": str(tmp_path / "ledger"),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=50
    )
    # Then it completes and never imported opentelemetry
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_told_to_trace_where_it_cannot_refuses_to_start(
    redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    # Given a worker whose exporter setting names nothing that exists
    env = worker_env(redis_url, ledger, tmp_path / "data", RATCHET_OTEL_EXPORTER="no_such:exporter")
    worker = WorkerProcess(env, tmp_path / "worker.log").start()
    try:
        # When it starts, Then it exits at once with one line saying why
        assert worker.wait(60) == 2, worker.log()[-2000:]
    finally:
        worker.kill()
    assert (
        "ratchet: refusing to start: RATCHET_OTEL_EXPORTER='no_such:exporter': "
        "No module named 'no_such'; give otlp, console or module:callable"
    ) in worker.log()
