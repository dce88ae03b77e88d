"""Celery tasks, thin: decode the message, call the runtime, persist, enqueue.

Task names are stable (``ratchet.*``): durable messages outlive module paths.
What each task takes, and the one function that sends it, is in :mod:`tasks.messages`.
The tasks are shared tasks (:func:`tasks.task_base.ratchet_task`): they belong to
no app of their own, and :func:`install` adds them, with their queues, routes and
the sweeper's beat entry, to the Celery app it is given — ratchet's own
(``worker.app``) or an application's (docs/celery.md, "Your own Celery app").
"""

from __future__ import annotations

from typing import Any

from tasks.children import deliver_run
from tasks.control import cancel_run, continue_run
from tasks.messages import send_through
from tasks.queues import ROUTES, beat_schedule, queues, route
from tasks.recovery import reconcile_run, resume_run, sweep
from tasks.settings import Settings, get_settings
from tasks.start import start_run
from tasks.timers import wake_run
from tasks.turn import run_turn

__all__ = [
    "cancel_run",
    "deliver_run",
    "continue_run",
    "install",
    "reconcile_run",
    "resume_run",
    "run_turn",
    "start_run",
    "sweep",
    "wake_run",
]


def install(app: Any, settings: Settings | None = None) -> None:
    """Add ratchet to the Celery app ``app``: its tasks, queues, routes and beat entry.

    What the app already has is kept: its own queues, routes (ratchet's win for
    ``ratchet.*`` names only), beat entries and accepted content types
    (``json`` is added: ratchet's messages are JSON). Each ratchet task gets, by
    annotation, what ratchet's own app sets for every task: late acknowledgement,
    a requeue when the worker is lost, no result, and the turn time limit.

    What ratchet sends outside a running task (the API's starts) goes through ``app``
    from now on. The app's workers run ratchet's tasks when they consume its queues:
    ``celery -A proj worker -Q ratchet.turns,ratchet.control --prefetch-multiplier 1``.
    """
    settings = settings or get_settings()
    conf = app.conf
    known = {queue.name for queue in conf.task_queues or ()}
    conf.task_queues = (
        *(conf.task_queues or ()),
        *(queue for queue in queues() if queue.name not in known),
    )
    route(app)
    send_through(app)
    conf.beat_schedule = {**(conf.beat_schedule or {}), **beat_schedule(settings.sweep_interval_s)}
    conf.accept_content = sorted({*(conf.accept_content or ()), "json"})
    annotation = {
        "acks_late": True,
        "reject_on_worker_lost": True,
        "ignore_result": True,
        "time_limit": settings.turn_time_limit_s,
    }
    theirs = conf.task_annotations
    annotations = list(theirs) if isinstance(theirs, list | tuple) else [theirs] if theirs else []
    conf.task_annotations = ({name: dict(annotation) for name in ROUTES}, *annotations)
