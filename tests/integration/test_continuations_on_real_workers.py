"""Continuations on real workers: the CLI, a Celery client, plain JSON over Redis and RabbitMQ.

The in-process session worker (threads pool, Redis broker in database 0) serves
most tests; the RabbitMQ and worker-restart tests run ``celery -A worker worker``
subprocesses configured only by environment variables.
"""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from kombu import Connection, Queue

from runtime.models import Event, RunStatus
from store.runs import RunRecord
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.drain import join, queued
from tests.helpers import call, turn, write_agent
from tests.redis_server import RedisServer
from tests.workers import WorkerProcesses, redis_context, wait_for_run
from tests.workers import wait_for as worker_wait_for
from worker.api import Ratchet
from worker.app import make_app
from worker.cli import main

wait_for = partial(wait_for_run, timeout_s=30)

ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]
REFUND = [turn("refund", call("issue_refund", order_id="B2", amount_cents=2900)), turn("ok")]
QUEUE = "ratchet.continuations"


def suspended(record: RunRecord) -> bool:
    return record.status.is_suspended


def finished(record: RunRecord) -> bool:
    return record.status.is_terminal


def types(events: list[Event]) -> list[str]:
    return [e.type for e in events]


def start_suspended(
    ratchet: Ratchet, directory: Path, script: list[dict[str, Any]] = ASK, **agent: Any
) -> str:
    run_id = ratchet.start(write_agent(directory, script, **agent), "refund my order")
    wait_for(ratchet.ctx, run_id, suspended)
    return run_id


def input_reached_the_model(events: list[Event], text: str) -> bool:
    return (
        any(e.type == "run.continued" and e.data.get("input") == text for e in events)
        and types(events)[-1] == "run.completed"
    )


def test_a_suspended_run_answered_from_the_cli_completes_and_a_repeat_is_acknowledged(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    run_id = start_suspended(ratchet, tmp_path)
    runner = CliRunner()
    shown = runner.invoke(main, ["runs", "show", run_id])
    assert "prompt     Which order?" in shown.output and "needs_user_input" in shown.output

    args = ["runs", "continue", run_id, "--input", "Order B2", "--continuation-id", "cli-1"]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    assert f"run {run_id}: continued (cli-1)" in first.output
    record = wait_for(ratchet.ctx, run_id, finished)
    assert record.status == RunStatus.COMPLETED, record.error
    assert input_reached_the_model(ratchet.events(run_id), "Order B2")

    again = runner.invoke(main, args)
    assert again.exit_code == 0
    assert "continuation cli-1 was already applied; nothing to do" in again.output
    refused = runner.invoke(main, ["runs", "continue", run_id, "--input", "Order A1"])
    assert refused.exit_code == 1
    assert f"run {run_id} is completed: only a suspended run" in refused.output
    assert types(ratchet.events(run_id)).count("run.continued") == 1


def test_a_continuation_sent_by_a_celery_client_is_applied_once_even_when_sent_twice(
    ratchet: Ratchet, session_app: Celery, tmp_path: Path
) -> None:
    run_id = start_suspended(ratchet, tmp_path)
    answer = {"run_id": run_id, "input": "Order B2", "continuation_id": "celery-1"}
    # When a client that speaks Celery sends the same answer twice, and then a different one
    session_app.send_task("ratchet.continue", kwargs=answer)
    session_app.send_task("ratchet.continue", kwargs=answer)
    record = wait_for(ratchet.ctx, run_id, finished)
    session_app.send_task("ratchet.continue", kwargs={**answer, "continuation_id": "celery-2"})
    join(session_app)  # the worker took the late answer and finished with it
    # Then the run completed with exactly one answer
    assert record.status == RunStatus.COMPLETED
    events = ratchet.events(run_id)
    assert input_reached_the_model(events, "Order B2")
    assert [e.data["continuation_id"] for e in events if e.type == "run.continued"] == ["celery-1"]


@pytest.fixture
def session_broker(redis_server: RedisServer) -> str:
    return f"{redis_server.url}/0"


def publish_with_kombu(broker_url: str, body: Any, queue: str = QUEUE, **options: Any) -> None:
    """What a producer that knows only kombu does (the README's example)."""
    if "content_type" not in options:
        options["serializer"] = "json"
    with Connection(broker_url) as connection:
        producer = connection.Producer()
        producer.publish(
            body, exchange="", routing_key=queue, declare=[Queue(queue)], retry=True, **options
        )


def test_plain_json_continuations_published_with_kombu_on_redis_are_applied_and_bad_ones_dropped(
    ratchet: Ratchet, session_app: Celery, tmp_path: Path, session_broker: str
) -> None:
    run_id = start_suspended(ratchet, tmp_path)
    before = ratchet.events(run_id)
    # Given malformed messages ahead of the good one
    publish_with_kombu(session_broker, "just text")
    publish_with_kombu(session_broker, {"input": "no run id"})
    publish_with_kombu(session_broker, {"run_id": run_id, "input": "B2", "colour": "red"})
    publish_with_kombu(session_broker, {"run_id": run_id, "input": 42})
    publish_with_kombu(
        session_broker, b"\x80 not json", content_type="application/json", content_encoding="binary"
    )
    join(session_app)  # the consumer took every one of them
    assert ratchet.events(run_id) == before
    # When a well-formed one follows, the consumer is still there to apply it
    publish_with_kombu(
        session_broker, {"run_id": run_id, "input": "Order B2", "continuation_id": "kombu-1"}
    )
    record = wait_for(ratchet.ctx, run_id, finished)
    assert record.status == RunStatus.COMPLETED
    assert input_reached_the_model(ratchet.events(run_id), "Order B2")


REDIS_CLI_PRODUCER = (
    r"""redis-cli -u "$REDIS_URL" LPUSH ratchet.continuations """
    r""""{\"body\": \"$(printf '%s' "$BODY" | base64 -w0)\", \"content-encoding\": \"utf-8\", """
    r"""\"content-type\": \"application/json\", \"headers\": {}, \"properties\": """
    r"""{\"body_encoding\": \"base64\", \"delivery_tag\": \"$(cat /proc/sys/kernel/random/uuid)\", """
    r"""\"delivery_info\": {\"exchange\": \"\", \"routing_key\": \"ratchet.continuations\"}, """
    r"""\"priority\": 0}}" """
)
"""The README's redis-cli producer, verbatim: kombu's Redis-transport envelope around the body."""


def test_a_plain_json_continuation_pushed_with_redis_cli_is_applied(
    ratchet: Ratchet, tmp_path: Path, session_broker: str
) -> None:
    run_id = start_suspended(ratchet, tmp_path)
    body = json.dumps({"run_id": run_id, "input": "Order B2", "continuation_id": "raw-1"})
    pushed = subprocess.run(
        ["sh", "-c", REDIS_CLI_PRODUCER],
        env={"BODY": body, "REDIS_URL": session_broker, "PATH": "/usr/bin:/bin:/usr/local/bin"},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert pushed.returncode == 0 and pushed.stdout.strip().isdigit(), pushed
    record = wait_for(ratchet.ctx, run_id, finished)
    assert record.status == RunStatus.COMPLETED
    assert input_reached_the_model(ratchet.events(run_id), "Order B2")


def test_an_approved_tool_runs_once_and_a_denied_tool_never_runs_on_a_real_worker(
    ratchet: Ratchet, tmp_path: Path, ledger: Path
) -> None:
    approved = start_suspended(ratchet, tmp_path / "a", REFUND, require_approval=["issue_refund"])
    denied = start_suspended(ratchet, tmp_path / "b", REFUND, require_approval=["issue_refund"])
    shown = CliRunner().invoke(main, ["runs", "show", approved])
    assert "awaiting_approval" in shown.output
    assert 'issue_refund({"amount_cents": 2900, "order_id": "B2"})' in shown.output
    assert not ledger.exists()  # the tool waits for the person, it does not run first

    assert CliRunner().invoke(main, ["runs", "continue", approved, "--approve"]).exit_code == 0
    deny = CliRunner().invoke(main, ["runs", "continue", denied, "--deny", "over the limit"])
    assert deny.exit_code == 0, deny.output
    for run_id in (approved, denied):
        assert wait_for(ratchet.ctx, run_id, finished).status == RunStatus.COMPLETED

    assert ledger.read_text().splitlines() == ["refund B2 2900"]
    denied_events = ratchet.events(denied)
    assert "tool.requested" not in types(denied_events)
    assert "tool.requested" in types(ratchet.events(approved))


def test_cancelling_a_run_during_a_slow_model_call_stops_it_at_its_next_write(
    ratchet: Ratchet, session_app: Celery, tmp_path: Path, ledger: Path
) -> None:
    slow = [
        {**turn("refund", call("issue_refund", order_id="B2", amount_cents=1)), "sleep_s": 1.5},
        turn("ok"),
    ]
    run_id = ratchet.start(write_agent(tmp_path, slow), "refund")
    wait_for(ratchet.ctx, run_id, lambda r: r.usage.model_attempts == 1)
    # When an operator cancels while the model call is in progress
    result = CliRunner().invoke(main, ["runs", "cancel", run_id, "--reason", "wrong customer"])
    assert result.exit_code == 0, result.output
    join(session_app)  # the model call returned and the turn tried to record it
    # Then the run is cancelled for good, the response was never recorded, no tool ran
    events = ratchet.events(run_id)
    assert types(events)[-1] == "run.cancelled", types(events)
    assert "model.responded" not in types(events)
    assert not ledger.exists()
    assert ratchet.get(run_id).status == RunStatus.CANCELLED
    assert ratchet.snapshot_document(run_id) is None
    refused = CliRunner().invoke(main, ["runs", "continue", run_id, "--input", "B2"])
    assert refused.exit_code == 1 and f"run {run_id} is cancelled" in refused.output
    again = CliRunner().invoke(main, ["runs", "cancel", run_id])
    assert again.exit_code == 1 and f"run {run_id} is cancelled" in again.output


# --- worker subprocesses ---------------------------------------------------------


def client_app(broker_url: str) -> Any:
    """A Celery client of the workers under test (their broker, not the session worker's)."""
    client = make_app(Settings(broker_url=broker_url))
    client.conf.broker_transport_options = {"visibility_timeout": 3600}
    return client


def start_run_on(broker_url: str, ctx: Context, agent: Path) -> str:
    state = create_run(ctx, agent, "refund my order")
    client = client_app(broker_url)
    client.send_task("ratchet.turn", (state.run_id, state.seq))
    client.close()
    return state.run_id


def test_plain_json_continuations_on_rabbitmq_are_applied_by_a_worker_process(
    worker_processes: WorkerProcesses, rabbitmq_vhost: str, redis_url: str, tmp_path: Path
) -> None:
    ctx = redis_context(redis_url)
    try:
        worker = worker_processes.start("--pool", "threads", RATCHET_BROKER_URL=rabbitmq_vhost)
        run_id = start_run_on(rabbitmq_vhost, ctx, write_agent(tmp_path, ASK))
        wait_for(ctx, run_id, suspended, timeout_s=60)
        before = ctx.runs.events(run_id)
        publish_with_kombu(rabbitmq_vhost, ["not", "an", "object"])
        publish_with_kombu(rabbitmq_vhost, {"run_id": run_id, "approve": "yes"})
        worker_wait_for(
            "the worker refused both malformed continuations",
            lambda: (
                "the body is a JSON array" in worker.log()
                and "`approve` must be bool" in worker.log()
            ),
        )
        assert ctx.runs.events(run_id) == before
        answer = {"run_id": run_id, "input": "Order B2", "continuation_id": "amqp-1"}
        publish_with_kombu(rabbitmq_vhost, answer)
        publish_with_kombu(rabbitmq_vhost, answer)
        record = wait_for(ctx, run_id, finished)
        assert record.status == RunStatus.COMPLETED, worker.log()
        events = ctx.runs.events(run_id)
        assert input_reached_the_model(events, "Order B2")
        assert types(events).count("run.continued") == 1
        log = worker.log()
        assert "continuation message refused: the body is a JSON array" in log
        assert "`approve` must be bool, not string" in log
    finally:
        ctx.close()


def test_a_continuation_sent_while_no_worker_runs_is_applied_once_a_worker_starts(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    ctx = redis_context(redis_url)
    try:
        # Given a run that suspended on a worker which then died
        first = worker_processes.start("--pool", "threads")
        run_id = start_run_on(redis_url, ctx, write_agent(tmp_path, ASK))
        wait_for(ctx, run_id, suspended, timeout_s=60)
        first.kill()
        # When its answer is sent, through Celery and as plain JSON, with no worker running
        client = client_app(redis_url)
        answer = {"run_id": run_id, "input": "Order B2", "continuation_id": "offline-1"}
        client.send_task("ratchet.continue", kwargs=answer)
        client.close()
        publish_with_kombu(redis_url, answer)
        # the answers wait on the broker, one in each queue, and the run waits for them
        assert queued(redis_url, ("ratchet.control",), unacked=False) == 1
        assert queued(redis_url, (QUEUE,), unacked=False) == 1
        assert ctx.runs.get(run_id).status == RunStatus.NEEDS_USER_INPUT  # type: ignore[union-attr]
        # Then a worker that starts later applies it, once, and the run completes
        worker_processes.start("--pool", "threads")
        record = wait_for(ctx, run_id, finished, timeout_s=60)
        assert record.status == RunStatus.COMPLETED
        events = ctx.runs.events(run_id)
        assert types(events).count("run.continued") == 1
        assert input_reached_the_model(events, "Order B2")
    finally:
        ctx.close()
