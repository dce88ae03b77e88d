"""A worker killed at a failpoint, another one finishing: still one span per transition.

A three-turn refund run (turn 1 looks the order up, turn 2 issues the refund,
turn 3 answers) is taken by a ``celery -A worker worker`` subprocess armed to
``os._exit`` at a failpoint; the sweeper hands it to a healthy worker, and an
operator reconciles it when the refund was in flight. Both workers (and this
process, for the reconciliation) trace with the SDK's in-memory exporter made to
persist each span as it ends (tests/tracing_sink.py), so the spans of the worker
that died are counted too.

What the spans must be is computed here from the run's final event log, without
the tracing module: one ``ratchet.model`` span per model outcome event, one
``ratchet.tool`` span per tool outcome event, one ``ratchet.turn`` per turn
number, one ``ratchet.run``, all in the run's trace, no span id twice.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from runtime.models import Event, RunStatus
from store.runs import RunRecord
from tasks import tracing
from tasks.context import Context
from tasks.recovery import reconcile
from tasks.settings import Settings
from tasks.start import create_run
from tests.crash.test_failpoints import settle
from tests.helpers import call, turn, write_agent
from tests.redis_server import RedisServer, running_redis_server
from tests.tracing_sink import read_spans
from tests.workers import WorkerProcess, redis_context, worker_env
from worker.app import make_app

STORES_DB, DYING_BROKER_DB, HEALTHY_BROKER_DB = 0, 1, 2
EXPORTER = "tests.tracing_sink:exporter"


@dataclass
class Rig:
    server: RedisServer
    directory: Path
    ctx: Context
    spans: Path
    healthy: WorkerProcess
    dying_app: Celery
    healthy_app: Celery

    def worker(self, name: str, broker_db: int, **extra: str) -> WorkerProcess:
        env = worker_env(
            f"{self.server.url}/{STORES_DB}",
            self.directory / "refunds.ledger",
            self.directory / "data",
            RATCHET_LEASE_S="1",
            RATCHET_OTEL_EXPORTER=EXPORTER,
            RATCHET_TEST_SPAN_LOG=str(self.spans),
            **extra,
        )
        env["RATCHET_BROKER_URL"] = f"{self.server.url}/{broker_db}"
        return WorkerProcess(env, self.directory / f"{name}.log", ("--pool", "solo")).start()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    directory = tmp_path_factory.mktemp("tracing")
    spans = directory / "spans.jsonl"
    with running_redis_server(directory) as server:
        with pytest.MonkeyPatch.context() as env:
            # Its context traces (traced_here): a context takes its observers when built.
            env.setenv("RATCHET_OTEL_EXPORTER", EXPORTER)
            ctx = redis_context(f"{server.url}/{STORES_DB}")
        rig = Rig(
            server,
            directory,
            ctx,
            spans,
            None,  # type: ignore[arg-type]
            make_app(Settings(broker_url=f"{server.url}/{DYING_BROKER_DB}")),
            make_app(Settings(broker_url=f"{server.url}/{HEALTHY_BROKER_DB}")),
        )
        rig.healthy = rig.worker("healthy", HEALTHY_BROKER_DB)
        try:
            yield rig
        finally:
            rig.healthy.kill()
            rig.ctx.close()


@pytest.fixture
def traced_here(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process traces too: an operator's reconciliation appends events from here."""
    monkeypatch.setenv("RATCHET_OTEL_EXPORTER", EXPORTER)
    monkeypatch.setenv("RATCHET_TEST_SPAN_LOG", str(rig.spans))
    tracing.reset()
    try:
        yield
    finally:
        tracing.reset()


def record_the_refund(rig: Rig, record: RunRecord) -> None:
    """The refund did run (the ledger says so); an operator records its result."""
    events = rig.ctx.runs.events(record.run_id)
    call_id = next(e.data["call_id"] for e in events if e.type == "run.parked")
    reconcile(
        rig.ctx,
        record.run_id,
        call_id,
        "result",
        {"status": "refunded"},
        enqueue=lambda run, seq: rig.healthy_app.send_task(
            "ratchet.turn", (run, seq), queue="ratchet.turns"
        ),
    )


def wait_for_spans(rig: Rig, trace_id: str, timeout_s: float = 20) -> list[dict[str, Any]]:
    """The run's spans, once its run span (the last one emitted) is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in read_spans(rig.spans) if s["trace_id"] == trace_id]
        if any(s["name"] == "ratchet.run" for s in spans):
            return spans
        assert time.monotonic() < deadline, f"no run span in {len(spans)} spans"
        time.sleep(0.1)


def seqs(spans: list[dict[str, Any]], name: str) -> Counter[int]:
    return Counter(int(s["attributes"]["ratchet.seq"]) for s in spans if s["name"] == name)


def expected_turns(events: list[Event]) -> dict[int, int]:
    """Each turn number and the seq of its first model request."""
    first: dict[int, int] = {}
    for e in events:
        if e.type == "model.requested":
            first.setdefault(int(e.data["turn"]), e.seq)
    return first


CASES = [
    "model.response.received@2",  # the model is asked again for turn 2
    "snapshot.before_save@2",  # events committed, snapshot not saved
    "tool.completed@1",  # an idempotent lookup ran, outcome not journaled: it runs again
    "tool.requested@2",  # the refund was in flight: parked, then reconciled
    "turn.enqueued@2",  # everything committed; the next turn is on the dead worker's broker
]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("failpoint", CASES)
def test_a_run_killed_at_a_failpoint_and_recovered_has_one_span_per_committed_transition(
    rig: Rig, tmp_path: Path, traced_here: None, failpoint: str
) -> None:
    # Given a three-turn run taken by a worker armed to die at the failpoint
    agent = write_agent(
        tmp_path,
        [
            turn("look", call("lookup_order", order_id="B2"), tokens=(100, 10)),
            turn("refund", call("issue_refund", order_id="B2", amount_cents=900), tokens=(200, 20)),
            turn("Refunded.", tokens=(300, 30)),
        ],
    )
    dying = rig.worker(f"dying-{failpoint}", DYING_BROKER_DB, RATCHET_FAILPOINT=failpoint)
    try:
        state = create_run(rig.ctx, agent, "refund B2")
        run_id = state.run_id
        rig.dying_app.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
        # When it dies there and the run is recovered (swept, resumed, reconciled if parked)
        record = settle(rig, run_id, dying, 45, parked=partial(record_the_refund, rig))
        assert dying.wait(10) == 137, dying.log()[-2000:]
    finally:
        dying.kill()
    assert record.status == RunStatus.COMPLETED, record.error
    events = rig.ctx.runs.events(run_id)
    trace_id = f"{tracing.trace_id_of(run_id, state.created_at_ms):032x}"
    spans = wait_for_spans(rig, trace_id)
    # Then the spans are exactly one per committed transition, whoever committed it
    model_ends = [e.seq for e in events if e.type in ("model.responded", "model.failed")]
    tool_ends = [e.seq for e in events if e.type in tracing.TOOL_ENDS]
    assert seqs(spans, "ratchet.model") == Counter(model_ends)
    assert seqs(spans, "ratchet.tool") == Counter(tool_ends)
    turns = expected_turns(events)
    assert sorted(turns) == [1, 2, 3]
    turn_spans = {s["attributes"]["ratchet.turn"]: s for s in spans if s["name"] == "ratchet.turn"}
    assert len([s for s in spans if s["name"] == "ratchet.turn"]) == 3
    assert {t: int(s["attributes"]["ratchet.seq"]) for t, s in turn_spans.items()} == turns
    completed = next(e.seq for e in events if e.type == "run.completed")
    assert seqs(spans, "ratchet.run") == Counter([completed])
    assert len(spans) == len(model_ends) + len(tool_ends) + 3 + 1
    # And they form one trace: no span id twice, every parent present
    ids = [s["span_id"] for s in spans]
    assert len(set(ids)) == len(ids)
    assert {s["parent_id"] for s in spans} - {None} <= set(ids)
    # And both workers emitted some of them: the dying worker's spans were not repeated
    assert len({s["pid"] for s in spans}) >= 2
    if failpoint == "model.response.received@2":
        assert turn_spans[2]["attributes"]["ratchet.model_attempts"] == 2
    if failpoint == "tool.requested@2":
        reconciled = [s for s in spans if s["attributes"].get("ratchet.reconciled") == "result"]
        assert len(reconciled) == 1
