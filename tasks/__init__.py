"""Celery tasks, thin: decode the message, call the runtime, persist, enqueue.

Task names are stable (``ratchet.*``): durable messages outlive module paths.
What each task takes, and the one function that sends it, is in :mod:`tasks.messages`.
The tasks are shared tasks (:func:`tasks.task_base.ratchet_task`): they belong to
no app of their own, and :func:`install` adds them, with their queues, routes and
the sweeper's beat entry, to the Celery app it is given — ratchet's own
(``worker.app``) or an application's (docs/celery.md, "Your own Celery app").
"""

from __future__ import annotations

import sys
from typing import Any

from tasks.children import deliver_run
from tasks.control import cancel_run, continue_run
from tasks.delivery import (
    apply_delivery,
    declaration_refusal,
    delivery_refusal,
    delivery_settings,
)
from tasks.messages import send_through
from tasks.queues import ROUTES, beat_schedule
from tasks.recovery import reconcile_run, resume_run, sweep
from tasks.settings import EXIT_CONFIG_INVALID, Settings, get_settings
from tasks.start import start_run
from tasks.sweep_logs import quiet_sweeps
from tasks.task_options import task_annotations
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
    """Configure the Celery app ``app`` to carry ratchet: tasks, queues, routes, beat entry.

    ``app`` gets the one table ratchet's own app is built from (:mod:`tasks.delivery`):
    queues with their arguments, routes with their priorities, the Redis priority steps
    and visibility timeout, json accepted, prefetch 1, task events, and the plain-JSON
    continuations consumer. What the app already has is kept: its own queues, routes
    (ratchet's win for ``ratchet.*`` names only), beat entries, accepted content, and any
    value it chose; a worker of the app refuses to start, naming the setting, when a
    value it chose is one ratchet cannot take (:func:`tasks.delivery.delivery_problems`).
    Each ratchet task gets, by annotation, what ratchet's own app sets for every task
    (:func:`tasks.task_options.task_annotations`): late acknowledgement, a requeue when the
    worker is lost, no result, the time limit.

    What ratchet sends outside a running task (the API's, the CLI's with ``--app``)
    goes through ``app`` from now on. The app's workers run ratchet's tasks when they
    consume its queues: ``celery -A proj worker -Q ratchet.turns,ratchet.control``.
    """
    from celery.signals import worker_init

    from tasks.continuations import ContinuationConsumer

    settings = settings or get_settings()
    conf = app.conf
    apply_delivery(
        conf, delivery_settings(conf.broker_url or settings.resolved_broker_url, settings)
    )
    conf.beat_schedule = {**(conf.beat_schedule or {}), **beat_schedule(settings.sweep_interval_s)}
    conf.ratchet_installed = True
    quiet_sweeps()  # an empty sweep's Celery lines at DEBUG, as on ratchet's own app
    annotation = task_annotations(settings.turn_time_limit_s)
    theirs = conf.task_annotations
    annotations = list(theirs) if isinstance(theirs, list | tuple) else [theirs] if theirs else []
    conf.task_annotations = ({name: dict(annotation) for name in ROUTES}, *annotations)
    app.steps["consumer"].add(ContinuationConsumer)
    send_through(app)

    def refuse_what_it_cannot_take(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        problem = delivery_refusal(app, settings, getattr(sender, "prefetch_multiplier", None))
        if problem is None:
            problem = declaration_refusal(app)
        if problem is not None:
            # SystemExit passes through Celery's signal dispatch (it catches Exception only).
            print(f"ratchet: refusing to start: {problem}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CONFIG_INVALID)

    worker_init.connect(refuse_what_it_cannot_take, weak=False)
