"""Every task of the control queue runs with the control options, on every app it is on.

The options are read from the tasks as a real Celery app registered them: ratchet's
own app (``worker.app.make_app``, broker priorities on) and a team's app that
installed ratchet (``tasks.install``).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

import tasks
from runtime.errors import HolderDied, LeaseHeld, RunBusy, RunMoving, StoreUnavailable
from tasks import messages
from tasks.queues import CONTROL_QUEUE, ROUTES
from tasks.settings import Settings
from tasks.task_base import control_task
from worker.app import make_app

SETTINGS = Settings(broker_url="redis://127.0.0.1:1/0", turn_time_limit_s=600)
CONTROL_TASKS = sorted(name for name, queue in ROUTES.items() if queue == CONTROL_QUEUE)


def ratchets_app() -> Any:
    return make_app(SETTINGS)


def a_teams_app() -> Any:
    app = Celery("proj", broker=SETTINGS.broker_url, set_as_current=False)
    tasks.install(app, SETTINGS)
    return app


def test_the_control_queue_carries_the_short_messages() -> None:
    assert CONTROL_TASKS == [
        "ratchet.cancel",
        "ratchet.continue",
        "ratchet.deliver",
        "ratchet.reconcile",
        "ratchet.sweep",
        "ratchet.wake",
    ]


@pytest.mark.parametrize("build", [ratchets_app, a_teams_app])
@pytest.mark.parametrize("name", CONTROL_TASKS)
def test_every_control_task_is_acked_late_retried_when_busy_and_bounded_in_time(
    build: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages, "_sending_app", messages._sending_app)
    app = build()
    task = app.tasks[name]
    # Sent to the control queue
    assert app.amqp.router.route({}, name)["queue"].name == CONTROL_QUEUE
    # acknowledged once done, put back when its worker is lost, no result kept
    assert (task.acks_late, task.reject_on_worker_lost, task.ignore_result) == (True, True, True)
    # a run that is busy (every kind of RunBusy) or a store briefly away: asked again
    assert {RunBusy, StoreUnavailable} <= set(task.autoretry_for or ())
    assert all(issubclass(busy, RunBusy) for busy in (LeaseHeld, RunMoving, HolderDied))
    assert (task.retry_backoff, task.retry_backoff_max, task.max_retries) == (1, 30, 20)
    # and stopped by the time limit
    assert task.time_limit == 600


@pytest.mark.parametrize("name", CONTROL_TASKS)
def test_every_control_task_goes_before_the_turns_where_the_broker_has_priorities(
    name: str,
) -> None:
    app = ratchets_app()
    top = app.amqp.router.route({}, "ratchet.continue")["priority"]
    assert app.amqp.router.route({}, name)["priority"] == top
    assert top != app.amqp.router.route({}, "ratchet.turn")["priority"]


def test_a_control_task_must_be_routed_to_the_control_queue() -> None:
    with pytest.raises(ValueError, match="ratchet.turn is not routed to ratchet.control"):
        control_task(name="ratchet.turn")
