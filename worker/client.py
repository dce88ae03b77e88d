"""For applications that speak only Celery: send ratchet's tasks from your own Celery app.

Your app's messages go where *its* configuration routes them. Without a route,
``app.send_task("ratchet.start", …)`` lands on Celery's default queue ``celery``,
which ratchet's workers do not consume, and the run never starts. So either pass
``queue=`` on every send (see :data:`QUEUES`), or route your app once::

    from celery import Celery
    from worker.client import route, start_run

    app = Celery("shop", broker="redis://127.0.0.1:6379/0")   # the workers' broker
    app.conf.task_serializer = "json"                        # ratchet accepts JSON only
    route(app)
    start_run(app, "examples/refund-desk.toml", "Refund order B2", run_id="order-b2")

ratchet keeps no Celery results (``task_ignore_result``, no result backend):
``AsyncResult.get()`` raises ``NotImplementedError: No result backend is
configured``. What a run did is in the run store (``Ratchet().wait(run_id)``,
``ratchet runs show``). To be told when a run stops, set
``RATCHET_NOTIFY_TASK`` on the workers: they send that task, kwargs ``run_id``,
``status``, ``output``, ``error``, to ``RATCHET_NOTIFY_QUEUE`` (see docs/celery.md).
"""

from __future__ import annotations

from typing import Any

from runtime.errors import InvalidRequest
from tasks.delivery import MERGED, apply_delivery, delivery_settings
from tasks.messages import enqueue_cancel, enqueue_continue, enqueue_start
from tasks.queues import CONTROL_QUEUE, ROUTES, TURNS_QUEUE
from tasks.settings import Settings, get_settings

__all__ = [
    "CONTROL_QUEUE",
    "QUEUES",
    "TURNS_QUEUE",
    "cancel_run",
    "continue_run",
    "route",
    "start_run",
]

QUEUES = ROUTES
"""The queue of each ratchet task (the workers' ``task_routes``)."""


def route(app: Any, settings: Settings | None = None) -> None:
    """Route ``app``'s ratchet messages as ratchet's workers read them, keeping its own routes.

    ratchet's queues (declared as the workers declare them: with ``x-max-priority`` on
    RabbitMQ, which refuses a queue declared twice with other arguments), ratchet's
    routes ahead of the app's, the Redis priority steps, and ``json`` accepted — the
    sending half of the table the workers are configured from (:mod:`tasks.delivery`).
    ``settings``: the workers' (``RATCHET_TASK_DEFAULT_QUEUE_TYPE`` above all); default:
    this process's environment.
    """
    conf = app.conf
    settings = settings or get_settings()
    table = delivery_settings(conf.broker_url or settings.resolved_broker_url, settings)
    apply_delivery(conf, {name: table[name] for name in MERGED})


def start_run(app: Any, agent_file: str, text: str, *, run_id: str, **options: Any) -> str:
    """Send ``ratchet.start``: the worker creates ``run_id`` and takes its first turn.

    ``agent_file`` is a path the workers can read. Sending the same ``run_id``
    again does not start a second run. ``options`` go to Celery's ``send_task``.
    Returns the Celery task id.
    """
    return enqueue_start(agent_file=agent_file, text=text, run_id=run_id, app=app, **options)


def continue_run(app: Any, run_id: str, **answer_and_options: Any) -> str:
    """Send ``ratchet.continue``: one answer (input, approve or deny) to a suspended run.

    ``answer_and_options``: the message's other fields by keyword (``input``,
    ``approve``, ``deny``, ``continuation_id``, ``suspension_seq``), then
    Celery's ``send_task`` options. Name the answer (``continuation_id``; the same
    id twice is applied once) or the suspension it answers (``suspension_seq``,
    from ``runs show``): an answer naming neither is refused by the workers, so it
    is refused here. Returns the Celery task id.
    """
    pins = ("continuation_id", "suspension_seq")
    if all(answer_and_options.get(name) is None for name in pins):
        raise InvalidRequest(
            "give continuation_id or suspension_seq: which answer is this?", run_id
        )
    return enqueue_continue(run_id=run_id, app=app, **answer_and_options)


def cancel_run(app: Any, run_id: str, reason: str | None = None, **options: Any) -> str:
    """Send ``ratchet.cancel``: the run stops at its next boundary, for good."""
    return enqueue_cancel(run_id=run_id, reason=reason, app=app, **options)
