"""kombu's unacked bookkeeping on a real prefork worker, which no longer waits on it
(tasks/broker/unacked.py): a message is held in Redis while its task runs, so a worker
SIGKILLed then still gives it back, and every ack reaches Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from runtime.models import RunStatus
from tasks.broker.transport import RatchetConnection
from tasks.delivery import MAX_PRIORITY
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcesses, redis_context, run_status, wait_for
from worker.app import make_app

pytestmark = pytest.mark.slow


def enqueue_turn(broker_url: str, run_id: str) -> None:
    app = make_app(Settings(broker_url=broker_url))
    app.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
    app.close()


def held_tasks(client: redis.Redis) -> list[str]:
    """The task names of the messages in kombu's unacked hash."""
    held: dict[bytes, bytes] = client.hgetall("unacked")  # type: ignore[assignment]
    return [json.loads(value)[0]["headers"]["task"] for value in held.values()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "pool",
    [
        ("--concurrency", "1"),  # prefork, one process: no BRPOP while it runs
        ("--concurrency", "2"),
        ("--pool", "solo"),  # the turn runs inside the delivery, before the loop ticks again
        ("--pool", "threads", "--concurrency", "2"),
    ],
    ids=["prefork-1", "prefork-2", "solo", "threads"],
)
def test_a_turn_is_held_in_redis_while_it_runs_and_comes_back_after_a_sigkill(
    worker_processes: WorkerProcesses,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
    pool: tuple[str, ...],
) -> None:
    agent = write_agent(
        tmp_path, [{**turn("look", call("lookup_order", order_id="B2")), "sleep_s": 30}]
    )
    ctx = redis_context(redis_url)
    client = redis.Redis.from_url(redis_url)
    # Given a worker in the middle of a long model call
    worker = worker_processes.start(*pool)
    run_id = create_run(ctx, agent, "refund B2").run_id
    enqueue_turn(redis_url, run_id)
    wait_for(
        "the model is asked",
        lambda: any(e.type == "model.requested" for e in ctx.runs.events(run_id)),
    )
    # Then Redis holds the turn's message as unacknowledged
    wait_for("the turn's message is held", lambda: held_tasks(client) == ["ratchet.turn"])
    # When the whole worker is SIGKILLed
    worker.kill()
    # Then the message is still held, and comes back once past the visibility timeout
    assert held_tasks(client) == ["ratchet.turn"]
    tags: list[bytes] = client.zrange("unacked_index", 0, -1)  # type: ignore[assignment]
    client.zadd("unacked_index", {tags[0]: 1.0})
    options = {"priority_steps": list(range(MAX_PRIORITY + 1)), "visibility_timeout": 3600}
    with RatchetConnection(redis_url, transport_options=options) as other:
        other.default_channel.qos.restore_visible(interval=1)
    assert client.hlen("unacked") == 0
    assert any(client.llen(key) for key in client.keys("ratchet.turns*"))
    client.close()
    ctx.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "pool",
    [("--concurrency", "2"), ("--pool", "threads", "--concurrency", "2")],
    ids=["prefork", "threads"],
)
def test_every_message_of_a_finished_run_is_acknowledged_in_redis(
    worker_processes: WorkerProcesses,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
    pool: tuple[str, ...],
) -> None:
    agent = write_agent(
        tmp_path,
        [turn(f"look {i}", call("lookup_order", order_id="B2")) for i in range(5)] + [turn("done")],
    )
    ctx = redis_context(redis_url)
    client = redis.Redis.from_url(redis_url)
    worker_processes.start(*pool)
    # Given a run of six turns on a worker
    run_id = create_run(ctx, agent, "refund B2").run_id
    enqueue_turn(redis_url, run_id)
    # When it completes
    wait_for("the run completes", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED)
    # Then Redis holds none of its messages: every ack reached it
    wait_for("every message is acknowledged", lambda: client.hlen("unacked") == 0)
    assert client.zcard("unacked_index") == 0
    client.close()
    ctx.close()
