"""Broker priorities: turns of runs under way before first turns of new runs.

Each turn message carries a priority (tasks/limits.py ``turn_priority``, from
:func:`runtime.limits.broker_priority`): a run's priority (0-4, higher first; the
agent's ``[limits] priority`` or the start's) plus 5 for a run under way, so any
run under way goes before any new run. Control messages (continuations, cancels,
sweeps, wake-ups) go before both. The brokers' own support does the ordering:

- **Redis** (kombu): one list per priority step; kombu's default steps are
  ``[0, 3, 6, 9]``, so ratchet sets ``priority_steps = [0 … 9]`` and a worker's
  BRPOP names the ten lists in order. Redis serves **0 first**, so the levels are
  reversed (9 - level). Limits: ordering is per BRPOP, among messages already in
  Redis — a message a worker has prefetched (prefetch 1 a slot) or holds for a
  countdown is not reordered; ten lists per queue cost ten keys per BRPOP.
- **RabbitMQ**: queues declared with ``x-max-priority = 9``; 9 is served first.
  RabbitMQ fixes a queue's arguments when it is first declared: a deployment
  whose ``ratchet.turns`` / ``ratchet.control`` were declared without priorities
  must delete them (once drained) or a worker's declaration is refused with
  PRECONDITION_FAILED. Prefetched messages are not reordered either.
- **filesystem://** and **memory://** have no priorities: messages go in order.
"""

from __future__ import annotations

from typing import Any

from runtime.limits import broker_priority
from tasks.queues import AMQP_SCHEMES, REDIS_SCHEMES, scheme_of

MAX_PRIORITY = 9

REDIS_PRIORITY_SEP = "\x06\x16"
"""kombu's Redis transport keeps a queue's step ``n`` > 0 in the list ``<queue>\\x06\\x16<n>``."""


def redis_lists(queue: str) -> list[str]:
    """The Redis lists holding ``queue``'s messages, one per priority step (0 is the queue's name)."""
    return [f"{queue}{REDIS_PRIORITY_SEP}{n}" if n else queue for n in range(MAX_PRIORITY + 1)]


def with_priorities(config: dict[str, Any], control_queue: str) -> dict[str, Any]:
    """``config`` (worker/app.py) with the broker's priorities switched on, where it has them."""
    scheme = scheme_of(config["broker_url"])
    if scheme not in REDIS_SCHEMES + AMQP_SCHEMES:
        return config
    reversed_scale = scheme in REDIS_SCHEMES
    if reversed_scale:
        options = dict(config["broker_transport_options"])
        options["priority_steps"] = list(range(MAX_PRIORITY + 1))
        config["broker_transport_options"] = options
    else:
        config["task_queue_max_priority"] = MAX_PRIORITY
    # A turn sent without a priority (a first turn from Ratchet.start or a client's
    # send_task, a resume) is a new run's; control messages go first. In the routes, not
    # task_default_priority: that becomes every task's own priority, and outranks a route.
    new_run = broker_priority(2, False, reversed_scale)
    top = 0 if reversed_scale else MAX_PRIORITY
    config["task_routes"] = {
        name: {**route, "priority": top if route.get("queue") == control_queue else new_run}
        for name, route in config["task_routes"].items()
    }
    return config
