"""Every ratchet task runs with exactly the options of tasks/task_options.py, on every app.

The options are read from the tasks as a real Celery app registered them: ratchet's own
app (``worker.app.make_app``) and a team's app that installed ratchet (``tasks.install``),
one whose defaults say otherwise.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery, Task
from celery.backends.base import DisabledBackend

import tasks
from tasks import messages
from tasks.queues import ROUTES
from tasks.settings import Settings
from tasks.task_base import ratchet_task
from tasks.task_options import CONTROL_RETRIES, EVERY_TASK, TIME_LIMIT, declared
from worker.app import make_app

SETTINGS = Settings(broker_url="redis://127.0.0.1:1/0", turn_time_limit_s=600)

APP_CHOSEN = {"task_track_started": True, "task_acks_on_failure_or_timeout": False}
"""Options the table leaves to the app, set away from Celery's defaults on the team's app."""


def ratchets_app() -> Any:
    return make_app(SETTINGS)


def a_teams_app() -> Any:
    app = Celery("proj", broker=SETTINGS.broker_url, set_as_current=False)
    # whose own defaults are Celery's (early acks, results kept, no time limit), but two
    app.conf.update(APP_CHOSEN)
    tasks.install(app, SETTINGS)
    return app


def a_plain_task() -> None:
    """A task of the app's own, with the app's defaults."""


@pytest.mark.parametrize("build", [ratchets_app, a_teams_app])
def test_every_registered_ratchet_task_carries_exactly_the_tables_options(
    build: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages, "_sending_app", messages._sending_app)
    app = build()
    plain = app.task(name="proj.plain", shared=False)(a_plain_task)
    registered = sorted(name for name in app.tasks if name.startswith("ratchet."))
    # Every ratchet task the app has is one the table knows, and the other way round
    assert registered == sorted(ROUTES)
    for name in registered:
        task = app.tasks[name]
        wanted = {**declared(name), TIME_LIMIT: SETTINGS.turn_time_limit_s}
        # Then each carries the table's value for each of the table's options
        assert {option: getattr(task, option) for option in wanted} == wanted, name
        # and, for every other option Celery reads from the app's settings, what a plain
        # task of the app has: the table is all ratchet sets
        for option, _ in Task.from_config:
            if option not in wanted:
                assert getattr(task, option) == getattr(plain, option), (name, option)
    if build is a_teams_app:
        assert all(app.tasks[name].track_started is True for name in registered)


def test_the_control_queue_alone_retries_a_busy_run() -> None:
    assert declared("ratchet.cancel") == {**EVERY_TASK, **CONTROL_RETRIES}
    assert declared("ratchet.turn") == dict(EVERY_TASK)


def test_a_task_that_spells_a_table_option_itself_is_refused() -> None:
    with pytest.raises(TypeError, match="ratchet.turn: acks_late are tasks.task_options'"):
        ratchet_task(name="ratchet.turn", acks_late=False)


def test_the_worker_app_builds_one_result_backend_for_every_thread() -> None:
    # Celery builds a result backend for each thread that first asks unless it is shared;
    # a gevent worker runs every task on a new greenlet, so each turn paid for building one
    app = make_app(Settings(broker_url="redis://127.0.0.1:6379/0"))
    seen: list[object] = []
    for _ in range(3):  # one after another, as a worker's tasks come
        thread = threading.Thread(target=lambda: seen.append(app.backend))
        thread.start()
        thread.join()
    assert len(seen) == 3 and all(backend is app.backend for backend in seen)
    assert isinstance(app.backend, DisabledBackend)  # ratchet keeps no Celery results
