"""ratchet added to a Celery app of a team's own: its worker runs a run to the end.

The app (tests/fixtures/proj_app.py) is not ratchet's: its own name, queue,
route and beat entry, and ``tasks.install(app)`` adding ratchet's tasks, queues,
routes and sweeper. Every turn after the first is chained by the worker through
that app, so a route ``install`` did not add would leave the next turn on a
queue nobody consumes and the run would never end.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, current_app

import tasks
from runtime.models import RunStatus
from tasks import messages
from tasks.queues import CONTROL_QUEUE, TURNS_QUEUE
from tasks.task_base import RatchetTask
from tasks.turn import run_turn
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcesses, redis_context, wait_for
from worker.client import start_run

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_a_run_completes_on_a_worker_of_another_app_with_ratchet_installed(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    agent = write_agent(
        tmp_path,
        [
            turn("Looking.", call("lookup_order", order_id="B2")),
            turn("Refunding.", call("issue_refund", order_id="B2", amount_cents=1200)),
            turn("Refunded B2."),
        ],
    )
    ctx = redis_context(redis_url)
    # Given a worker of the team's app, consuming only ratchet's queues, with beat inside
    worker = worker_processes.start(
        "-Q", f"{TURNS_QUEUE},{CONTROL_QUEUE}", "--concurrency", "1", "--prefetch-multiplier",
        "1", "-B", "-s", str(tmp_path / "beat-schedule"),
        "--loglevel", "DEBUG",  # an empty sweep's lines are DEBUG (tasks/sweep_logs.py)
        app="tests.fixtures.proj_app", PROJ_BROKER_URL=redis_url,
        RATCHET_SWEEP_INTERVAL_S="0.5",
    )  # fmt: skip
    client = Celery("client", broker=redis_url, set_as_current=False)
    try:
        # When a client starts a run through ratchet's queues
        run_id = "proj-b2"
        start_run(client, str(agent), "refund order B2", run_id=run_id)
        # Then the team's worker takes it through every turn to the end
        wait_for(
            "the run completes",
            lambda: (
                (record := ctx.runs.get(run_id)) is not None
                and record.status == RunStatus.COMPLETED
            ),
        )
        assert ctx.runs.get(run_id).output == "Refunded B2."  # type: ignore[union-attr]
        # and the team's beat sends ratchet's sweeper, which that worker runs
        wait_for("a sweep runs", lambda: "ratchet.sweep[" in worker.log())
        assert "app:         proj:" in worker.log()
    finally:
        client.close()
        ctx.close()


def test_install_keeps_what_the_app_already_has(monkeypatch: pytest.MonkeyPatch) -> None:
    # (install makes the app the one ratchet sends through: the session's app again after)
    monkeypatch.setattr(messages, "_sending_app", messages._sending_app)
    app = Celery("proj", set_as_current=False)
    app.conf.task_routes = {"proj.add": {"queue": "proj.work"}}
    app.conf.beat_schedule = {"proj.add": {"task": "proj.add", "schedule": 60.0}}
    app.conf.accept_content = ["msgpack"]
    # When ratchet is installed on it
    tasks.install(app)
    # Then the app's route, beat entry and content type are still there beside ratchet's
    assert app.amqp.router.route({}, "proj.add")["queue"].name == "proj.work"
    assert app.amqp.router.route({}, "ratchet.turn")["queue"].name == TURNS_QUEUE
    assert app.amqp.router.route({}, "ratchet.cancel")["queue"].name == CONTROL_QUEUE
    assert set(app.conf.beat_schedule) == {"proj.add", "ratchet.sweep"}
    assert set(app.conf.accept_content) == {"msgpack", "json"}
    # and ratchet's tasks are registered on it, with the argument checks of ratchet's base
    assert app.tasks["ratchet.turn"].acks_late is True
    assert isinstance(app.tasks["ratchet.turn"], RatchetTask)
    # and what ratchet sends outside a task now goes through it
    assert run_turn.app is app


def test_an_app_built_later_in_the_process_does_not_take_over_what_ratchet_sends() -> None:
    before = current_app._get_current_object()
    ratchet_app = run_turn.app  # ratchet's (the session's)
    try:
        # Given a client's own Celery app, built after ratchet's (it becomes the current app)
        shop = Celery("shop", set_as_current=True)
        assert current_app.main == "shop" and ratchet_app is not shop
        # Then ratchet's tasks are still sent through ratchet's app, in this thread and in
        # a thread with no current app at all (the console's request threads)
        assert run_turn.app is ratchet_app
        elsewhere: list[Any] = []
        thread = threading.Thread(target=lambda: elsewhere.append(run_turn.app))
        thread.start()
        thread.join()
        assert elsewhere == [ratchet_app]
    finally:
        before.set_current()
