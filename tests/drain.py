"""Wait until the workers have done everything sent to them (dramatiq's ``StubBroker.join``).

A test that checks "nothing changed" after sending a message must first know the
message was taken and handled, not that some time went by. :func:`join` waits until

- ratchet's queues on the broker hold no message: on Redis, every priority list of
  ``ratchet.turns``, ``ratchet.control`` and ``ratchet.continuations`` is empty and
  kombu's ``unacked`` hash (messages delivered to a worker and not yet acknowledged;
  turns are acknowledged late, after they ran) is empty; on RabbitMQ, each queue's
  ready count is 0;
- and every worker answering on the broker says it has no task active, reserved
  (prefetched) or scheduled (held for a countdown).

Both must hold on two looks in a row with a worker round trip between them: a
message a worker has just popped is, for an instant, in neither the list nor the
hash, but it is then reserved or active in that worker.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from celery import Celery
from kombu import Connection

from tasks.delivery import redis_lists
from tasks.queues import CONTROL_QUEUE, TURNS_QUEUE, scheme_of

QUEUES = (TURNS_QUEUE, CONTROL_QUEUE, "ratchet.continuations")
UNACKED = "unacked"
"""kombu's Redis transport: the hash of delivered, unacknowledged messages."""


def queued(broker_url: str, queues: tuple[str, ...] = QUEUES, unacked: bool = True) -> int:
    """Messages on the broker for ``queues`` that no worker has finished with.

    With ``unacked``, messages delivered to any worker and not yet acknowledged count
    too (kombu's Redis transport keeps one such hash for all queues).
    """
    if scheme_of(broker_url) in ("redis", "rediss"):
        client = redis.Redis.from_url(broker_url)
        try:
            lists = [name for queue in queues for name in redis_lists(queue)]
            with client.pipeline(transaction=False) as pipe:
                for name in lists:
                    pipe.llen(name)
                if unacked:
                    pipe.hlen(UNACKED)
                return sum(int(n) for n in pipe.execute())
        finally:
            client.close()
    with Connection(broker_url) as connection:
        channel = connection.default_channel
        total = 0
        for queue in queues:
            try:
                total += channel.queue_declare(queue=queue, passive=True).message_count
            except Exception:  # noqa: BLE001 - a queue never declared holds nothing
                channel = connection.channel()
        return total


def busy_workers(app: Celery) -> list[str]:
    """Names of the workers on ``app``'s broker holding a task, and what they hold."""
    inspect = app.control.inspect(timeout=1.0)
    held: dict[str, int] = {}
    for view in (inspect.active(), inspect.reserved(), inspect.scheduled()):
        for name, tasks in (view or {}).items():
            held[name] = held.get(name, 0) + len(tasks)
    return [f"{name} ({n} tasks)" for name, n in held.items() if n]


def join(app: Celery, timeout_s: float = 30.0, queues: tuple[str, ...] = QUEUES) -> None:
    """Wait until the broker of ``app`` holds nothing for ``queues`` and every worker is idle."""
    broker_url = str(app.conf.broker_url)
    deadline = time.monotonic() + timeout_s
    idle_looks = 0
    state: Any = None
    while idle_looks < 2:
        left = queued(broker_url, queues)
        busy = busy_workers(app) if left == 0 else []
        idle_looks = idle_looks + 1 if left == 0 and not busy else 0
        state = (left, busy)
        if idle_looks < 2:
            assert time.monotonic() < deadline, (
                f"the workers did not finish within {timeout_s}s: "
                f"{state[0]} messages on the broker, busy: {state[1] or 'none'}"
            )
            if idle_looks == 0:
                time.sleep(0.02)
