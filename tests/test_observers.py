"""The observer list (tasks/observers.py): empty unless something is switched on, and what an
observer on it sees of a real run taken in this process.

Failpoints, metrics and tracing each have their own tests on real workers
(tests/crash/test_failpoints.py, tests/integration/test_fleet.py, tests/test_tracing.py);
these check the list they all ride on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from runtime.models import Event, RunState, RunStatus
from tasks.observers import Observer, Observers
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent


class Recorder(Observer):
    """Keeps what it is told, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, ...]] = []
        self.states: list[RunState | None] = []

    def committed(
        self, before: RunStatus, after: RunStatus, events: Sequence[Event], state: RunState | None
    ) -> None:
        self.seen.append(("committed", before.value, after.value, *(e.type for e in events)))
        self.states.append(state)

    def reached(self, point: str, model_calls: int) -> None:
        self.seen.append((point, model_calls))

    def checkpointed(self, seconds: float, nbytes: int | None) -> None:
        self.seen.append(("checkpointed", nbytes is not None and nbytes > 0))


def test_a_context_with_nothing_switched_on_has_an_empty_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given no metrics port and no trace exporter (failpoints are read at import: none here)
    monkeypatch.delenv("RATCHET_METRICS_PORT", raising=False)
    monkeypatch.delenv("RATCHET_OTEL_EXPORTER", raising=False)
    # When a context is built
    ctx = memory_context()
    # Then nothing watches its turns, and the list tests false: a turn dispatches nothing
    assert ctx.observers == ()
    assert not ctx.observers


def test_each_switch_puts_its_observer_on_the_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a metrics port and a trace exporter set
    monkeypatch.setenv("RATCHET_METRICS_PORT", "9808")
    monkeypatch.setenv("RATCHET_OTEL_EXPORTER", "console")
    # When a context is built
    ctx = memory_context()
    # Then metrics then tracing watch its turns, tracing reading the context's run store
    assert [type(o).__name__ for o in ctx.observers] == ["MetricsObserver", "TracingObserver"]
    assert ctx.observers[1].runs is ctx.runs  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_an_observer_sees_each_commit_and_each_point_of_a_run_in_order(
    tmp_path: Path, ledger: Path
) -> None:
    # Given a context watched by a recorder, and a run of two turns: a tool call, an answer
    ctx = memory_context()
    recorder = Recorder()
    ctx.observers = Observers([recorder])
    agent = write_agent(tmp_path, [turn("look", call("lookup_order", order_id="B2")), turn("ok")])
    state = create_run(ctx, agent, "where is B2?")
    # When it runs to the end in this process (memory stores: events, then the snapshot; the
    # answer that asks for the lookup is its events alone, the turn's last checkpoint follows)
    assert drive(ctx, state.run_id).outcome == "completed"
    # Then it saw every commit after the run's creation and every point of both turns, in
    # the order they happened, each point at the count of model calls it belongs to
    assert recorder.seen == [
        ("committed", "queued", "model", "model.requested"),
        ("model.response.received", 1),
        ("committed", "model", "tools", "model.responded", "tool.requested"),
        ("model.response.checkpointed", 1),
        ("tool.requested", 1),
        ("tool.completed", 1),
        ("committed", "tools", "model", "tool.completed"),
        ("snapshot.before_save", 1),
        ("checkpointed", True),
        ("snapshot.after_save", 1),
        ("committed", "model", "model", "model.requested"),
        ("model.response.received", 2),
        ("committed", "model", "completed", "model.responded", "run.completed"),
        ("snapshot.before_save", 2),
        ("checkpointed", True),
        ("snapshot.after_save", 2),
        ("model.response.checkpointed", 2),
    ]
    # And each commit came with the state it produced, up to the run's last event
    assert [s.seq if s is not None else None for s in recorder.states] == [2, 4, 5, 6, 8]
    assert [e.seq for e in ctx.runs.events(state.run_id)][-1] == 8
