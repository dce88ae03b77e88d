"""Where each ratchet task goes: two queues, one route per task name.

``ratchet.turns`` carries the long work (a turn, a start, a resume);
``ratchet.control`` the short messages (continue, cancel, sweep, wake-ups,
deliveries to a parent) that must never wait behind a long turn. Each queue
has its own exchange and routing key: a bare ``Queue(name)`` would be bound to
Celery's default routing key, and every message would land in both.

**Queue types** (RabbitMQ, ``RATCHET_TASK_DEFAULT_QUEUE_TYPE``): ``classic`` (the
default) declares each queue with ``x-max-priority`` behind a direct exchange, as
every release did. ``quorum`` declares durable quorum queues (``x-queue-type``) with
no ``x-max-priority`` (RabbitMQ 3.10 refuses it on a quorum queue), behind topic
exchanges: Celery holds a countdown on quorum queues in RabbitMQ itself (its native
delayed delivery, the ``celery_delayed_*`` queues), which routes only through topic
or fanout exchanges; a countdown through a direct exchange would sit in a worker,
unacknowledged, where the per-consumer prefetch quorum queues impose cannot grow
around it. A topic binding ``ratchet.turns`` still matches only that routing key.
"""

from __future__ import annotations

import math
from typing import Any

from kombu import Exchange, Queue

REDIS_SCHEMES = ("redis", "rediss", "sentinel")
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
"""Brokers with priorities (tasks/delivery.py): Redis's lists, RabbitMQ's x-max-priority."""

TURNS_QUEUE = "ratchet.turns"
CONTROL_QUEUE = "ratchet.control"

ROUTES: dict[str, str] = {
    "ratchet.start": TURNS_QUEUE,
    "ratchet.turn": TURNS_QUEUE,
    "ratchet.resume": TURNS_QUEUE,
    "ratchet.continue": CONTROL_QUEUE,
    "ratchet.cancel": CONTROL_QUEUE,
    "ratchet.sweep": CONTROL_QUEUE,
    "ratchet.reconcile": CONTROL_QUEUE,
    "ratchet.wake": CONTROL_QUEUE,
    "ratchet.deliver": CONTROL_QUEUE,
}
"""The queue of each ratchet task (an app's ``task_routes``)."""


def scheme_of(broker_url: str) -> str:
    return broker_url.split("://", 1)[0].split("+", 1)[0]


QUORUM = {"x-queue-type": "quorum"}
"""The declaration argument of a quorum queue."""


def queues(max_priority: int | None = None, queue_type: str = "classic") -> tuple[Any, ...]:
    """ratchet's kombu queues (an app's ``task_queues``); with ``max_priority``, declared
    with ``x-max-priority`` (RabbitMQ: tasks/delivery.py); ``quorum``: as quorum queues
    behind topic exchanges, without priorities (see above)."""
    if queue_type == "quorum":
        arguments: dict[str, Any] | None = dict(QUORUM)
        exchange_type = "topic"
    else:
        arguments = {"x-max-priority": max_priority} if max_priority is not None else None
        exchange_type = "direct"
    return tuple(
        Queue(name, Exchange(name, type=exchange_type), routing_key=name, queue_arguments=arguments)  # type: ignore[no-untyped-call]
        for name in (TURNS_QUEUE, CONTROL_QUEUE)
    )


def continuations_queue(name: str, queue_type: str = "classic") -> Any:
    """The plain-JSON continuations queue ``name`` (tasks/continuations.py), on the default
    exchange; a quorum queue with the others."""
    arguments = dict(QUORUM) if queue_type == "quorum" else None
    return Queue(name, queue_arguments=arguments)  # type: ignore[no-untyped-call]


def is_quorum(queue: Any) -> bool:
    """Whether the kombu ``queue`` is declared as a quorum queue."""
    return bool((queue.queue_arguments or {}).get("x-queue-type") == "quorum")


def whole_seconds_on_quorum(app: Any, queue_name: str, countdown_s: float) -> float:
    """The countdown to send to ``queue_name`` through ``app``: whole seconds, rounded up,
    for a quorum queue; ``countdown_s`` otherwise.

    Celery's native delayed delivery (quorum queues) delays by whole seconds: it cuts
    the fraction off, and refuses a countdown under one second (Celery 5.7:
    ``ValueError: countdown must be a positive number``). Rounded up, a wake-up is never
    early and a turn waiting on a limit never goes before its time.
    """
    queue = app.amqp.queues.get(queue_name)
    if queue is None or not is_quorum(queue):
        return countdown_s
    return float(math.ceil(countdown_s))


def beat_schedule(sweep_interval_s: float) -> dict[str, dict[str, Any]]:
    """The crash sweeper, sent every ``sweep_interval_s`` by beat (an app's ``beat_schedule``).

    A sweep that waited longer than one interval is dropped, since the next one is
    already on its way.
    """
    return {
        "ratchet.sweep": {
            "task": "ratchet.sweep",
            "schedule": sweep_interval_s,
            "options": {"queue": CONTROL_QUEUE, "expires": sweep_interval_s},
        }
    }
