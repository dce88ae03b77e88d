"""Where each ratchet task goes: two queues, one route per task name.

``ratchet.turns`` carries the long work (a turn, a start, a resume);
``ratchet.control`` the short messages (continue, cancel, sweep, wake-ups,
deliveries to a parent) that must never wait behind a long turn. Each queue
has its own direct exchange and routing key: a bare ``Queue(name)`` would be
bound to Celery's default routing key, and every message would land in both.
"""

from __future__ import annotations

from typing import Any

from kombu.entity import Exchange, Queue

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


def queues(max_priority: int | None = None) -> tuple[Any, ...]:
    """ratchet's kombu queues (an app's ``task_queues``); with ``max_priority``, declared
    with ``x-max-priority`` (RabbitMQ: tasks/delivery.py)."""
    arguments = {"x-max-priority": max_priority} if max_priority is not None else None
    return tuple(
        Queue(name, Exchange(name, type="direct"), routing_key=name, queue_arguments=arguments)  # type: ignore[no-untyped-call]
        for name in (TURNS_QUEUE, CONTROL_QUEUE)
    )


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
