"""A foreign Celery app (not ratchet's) driving runs on a ``celery -A worker worker`` subprocess."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import redis
from celery import Celery

from runtime.models import RunStatus
from tasks.context import Context
from tasks.settings import Settings
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcesses, redis_context, wait_for_run
from worker import client
from worker.app import celery_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]


def shop_app(broker_url: str) -> Celery:
    """What a team's own Celery app looks like: its name, the broker, JSON."""
    app = Celery("shop", broker=broker_url)
    app.conf.task_serializer = "json"
    app.conf.broker_transport_options = {"visibility_timeout": 3600}
    return app


@pytest.fixture
def ctx(redis_url: str) -> Iterator[Context]:
    with closing(redis_context(redis_url)) as context:
        yield context


def test_the_client_routes_are_the_workers_routes() -> None:
    routes = celery_config(Settings())["task_routes"]
    assert client.QUEUES == {name: route["queue"] for name, route in routes.items()}


def test_an_unrouted_send_lands_on_the_celery_queue_and_route_fixes_it(
    worker_processes: WorkerProcesses, redis_url: str, ctx: Context, tmp_path: Path
) -> None:
    agent = str(write_agent(tmp_path / "a", [turn("Done.")]))
    app = shop_app(redis_url)
    # Given a send with no route: Celery's default queue, which no ratchet worker reads.
    app.send_task("ratchet.start", kwargs={"agent_file": agent, "text": "hi", "run_id": "lost-1"})
    assert redis.Redis.from_url(redis_url).llen("celery") == 1
    # With the helper's routes, the same app's runs start, are answered and cancelled.
    client.route(app)
    worker = worker_processes.start("--pool", "threads")
    client.start_run(app, agent, "refund B2", run_id="routed-1")
    done = wait_for_run(ctx, "routed-1", lambda r: r.status.is_terminal)
    assert done.status == RunStatus.COMPLETED, worker.log()

    client.start_run(app, str(write_agent(tmp_path / "b", ASK)), "refund", run_id="asks-1")
    asked = wait_for_run(ctx, "asks-1", lambda r: r.status.is_suspended)
    assert asked.suspension is not None
    with pytest.raises(ValueError, match="continuation_id or suspension_seq"):
        client.continue_run(app, "asks-1", input="B2")
    client.continue_run(app, "asks-1", input="Order B2", suspension_seq=asked.suspension.seq)
    assert wait_for_run(ctx, "asks-1", lambda r: r.status.is_terminal).status == RunStatus.COMPLETED

    client.start_run(app, str(write_agent(tmp_path / "c", ASK)), "refund", run_id="stop-1")
    wait_for_run(ctx, "stop-1", lambda r: r.status.is_suspended)
    client.cancel_run(app, "stop-1", "customer hung up")
    assert wait_for_run(ctx, "stop-1", lambda r: r.status.is_terminal).status == RunStatus.CANCELLED
    assert ctx.runs.get("lost-1") is None  # the unrouted one never ran
    app.close()


def test_async_result_get_says_there_is_no_result_backend(redis_url: str) -> None:
    # Documented in docs/celery.md: ratchet keeps no Celery results.
    app = shop_app(redis_url)
    client.route(app)
    result = app.send_task("ratchet.cancel", kwargs={"run_id": "nope"}, queue="ratchet.control")
    with pytest.raises(NotImplementedError, match="No result backend is configured"):
        result.get(timeout=1)
    app.close()
