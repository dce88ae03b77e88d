"""Runs on real Celery workers: Celery's in-process test worker, and `celery -A worker worker`."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
from celery import Celery

from runtime.models import RunStatus
from tasks.messages import enqueue_turn
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, refunds, turn, write_agent
from tests.workers import (
    EXAMPLE_AGENT,
    ROOT,
    WorkerProcesses,
    ratchet_cli,
    redis_context,
    start_example,
)
from worker.api import Ratchet
from worker.app import make_app


def strictly_increasing(seqs: list[int]) -> bool:
    return seqs == list(range(1, len(seqs) + 1))


def test_a_multi_turn_agent_with_tools_completes_on_a_real_worker(
    ratchet: Ratchet, ledger: Path
) -> None:
    # Given the example refund desk, when it runs on a real worker
    run_id = ratchet.start(EXAMPLE_AGENT, "Refund order B2")
    record = ratchet.wait(run_id, timeout_s=30)
    # Then it completes after four turns and three tool calls
    assert record.status == RunStatus.COMPLETED, record.error
    assert record.output is not None and "refunded" in record.output
    assert (record.usage.model_turns, record.usage.tool_calls) == (3, 3)
    events = ratchet.events(run_id)
    assert strictly_increasing([e.seq for e in events])
    assert events[-1].type == "run.completed"
    # And its snapshot is gone while its events stay
    assert ratchet.snapshot_document(run_id) is None
    assert refunds(ledger) == ["refund B2 2900"]


def test_the_same_turn_message_delivered_twice_runs_its_tool_once(
    ratchet: Ratchet, ledger: Path, tmp_path: Path
) -> None:
    agent = write_agent(
        tmp_path,
        [turn("refund", call("issue_refund", order_id="D1", amount_cents=7)), turn("done")],
    )
    from tasks.start import create_run

    state = create_run(ratchet.ctx, agent, "refund D1")
    # When the broker delivers the first turn's message twice, at once
    enqueue_turn(run_id=state.run_id, expected_seq=state.seq)
    enqueue_turn(run_id=state.run_id, expected_seq=state.seq)
    record = ratchet.wait(state.run_id, timeout_s=30)
    # Then the run completes and the refund happened exactly once
    assert record.status == RunStatus.COMPLETED
    assert ledger.read_text().splitlines() == ["refund D1 7"]
    types = [e.type for e in ratchet.events(state.run_id)]
    assert types.count("tool.requested") == 1 and types.count("model.responded") == 2


def test_budget_exhaustion_fails_the_run_with_its_reason_on_a_real_worker(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    agent = write_agent(
        tmp_path, [turn("again", call("lookup_order", order_id="A1"))] * 6, budgets={"max_turns": 3}
    )
    run_id = ratchet.start(agent, "loop forever")
    record = ratchet.wait(run_id, timeout_s=30)
    assert record.status == RunStatus.FAILED
    assert record.error is not None and "budget `max_turns` exhausted: 3 used of 3" in record.error
    assert ratchet.snapshot_document(run_id) is None


def test_a_pickle_message_is_refused_and_runs_nothing(
    ratchet: Ratchet, session_app: Celery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = write_agent(tmp_path, [turn("done")])
    from tasks.start import create_run

    state = create_run(ratchet.ctx, agent, "x")
    # A refused message is one WARNING line (and an entry in the dead-letter store).
    with caplog.at_level(logging.WARNING):
        session_app.send_task("ratchet.turn", (state.run_id, state.seq), serializer="pickle")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "pickle" not in caplog.text:
            time.sleep(0.05)
    assert "Refusing to deserialize untrusted content of type pickle" in caplog.text
    assert [e.type for e in ratchet.events(state.run_id)] == ["run.created"]


@pytest.mark.timeout(90)
def test_a_worker_process_and_the_cli_in_another_process_complete_a_run_on_each_broker(
    worker_processes: WorkerProcesses,
    broker_url: str,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
) -> None:
    # Given a worker process on the broker, with its stores on Redis
    worker = worker_processes.start("--concurrency", "2", RATCHET_BROKER_URL=broker_url)
    env = {**worker_processes.base_env, "RATCHET_BROKER_URL": broker_url}
    # When the CLI, in another process, starts the example agent and waits
    started = start_example(env, "--json")
    # Then the run completes with every transition recorded once, in order
    assert started.returncode == 0, started.stderr + worker.log()
    assert started.stdout, started.stderr
    record = json.loads(started.stdout)
    assert record["status"] == "completed"
    events = ratchet_cli(
        env, "runs", "events", record["run_id"], "--json", timeout_s=30, check=True
    )
    seqs = [json.loads(line)["seq"] for line in events.stdout.splitlines()]
    assert strictly_increasing(seqs) and len(seqs) == 14

    # When the broker delivers one turn message of another run twice, at once
    ctx = redis_context(redis_url)
    agent = write_agent(
        tmp_path,
        [turn("refund", call("issue_refund", order_id="D1", amount_cents=7)), turn("done")],
    )
    state = create_run(ctx, agent, "refund D1")
    client = make_app(Settings(broker_url=broker_url))
    try:
        client.send_task("ratchet.turn", (state.run_id, state.seq))
        client.send_task("ratchet.turn", (state.run_id, state.seq))
        deadline = time.monotonic() + 30
        while (done := ctx.runs.get(state.run_id)) is None or not done.status.is_terminal:
            assert time.monotonic() < deadline, worker.log()
            time.sleep(0.05)
    finally:
        client.close()
    # Then the run completes and its refund happened exactly once
    assert done.status == RunStatus.COMPLETED, done.error
    assert refunds(ledger) == ["refund B2 2900", "refund D1 7"]
    types = [e.type for e in ctx.runs.events(state.run_id)]
    assert types.count("tool.requested") == 1 and types.count("model.responded") == 2
    ctx.close()


@pytest.mark.timeout(90)
def test_the_embedded_default_runs_a_worker_and_the_cli_in_two_processes(tmp_path: Path) -> None:
    # Given nothing configured but a data directory: filesystem broker, files, SQLite
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_DATA_DIR=str(tmp_path / "data"),
        PYTHONPATH=str(ROOT),
        RATCHET_EXAMPLE_LEDGER=str(tmp_path / "ledger"),
    )
    processes = WorkerProcesses(env, tmp_path)
    try:
        processes.start("--concurrency", "1")
        started = start_example(env)
        assert started.returncode == 0, started.stderr + processes.started[0].log()
        run_id = started.stdout.splitlines()[0]
        shown = ratchet_cli(env, "runs", "show", run_id, "--json", timeout_s=30, check=True)
        assert json.loads(shown.stdout)["status"] == "completed"
        assert (tmp_path / "data" / "runs.sqlite3").exists()
        assert refunds(tmp_path / "ledger") == ["refund B2 2900"]
    finally:
        processes.stop_all()
