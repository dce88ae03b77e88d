"""Where ratchet's messages go and how they are read: one table, for every app that carries them.

ratchet's own app (``worker.app.make_app``) and a team's app (:func:`tasks.install`)
read the same table, :func:`delivery_settings`: queues (with their arguments),
routes (with their priorities), the Redis transport's priority steps, queue order and
visibility timeout, the content accepted, prefetch, task events (:func:`task_events_on`) and the plain-JSON
continuations queue. A sender and a worker configured from it agree on every name a
message is put under, so whatever sends a turn (the CLI, the console, the API, a
client, a worker chaining it, the sweeper), the workers read it at once.

:func:`delivery_problems` says what in a finished app's configuration disagrees with
the table: a value the team chose that ratchet cannot take (``tasks.install`` sets
every value the app left at Celery's default, and keeps the others); a worker of
that app refuses to start naming it.

**Broker priorities**: turns of runs under way before first turns of new runs. Each
turn message carries a priority (tasks/limits.py ``turn_priority``, from
:func:`runtime.limits.broker_priority`): a run's priority (0-4, higher first) plus 5
for a run under way, so any run under way goes before any new run. Control messages
(continuations, cancels, sweeps, wake-ups) go before both. The brokers' own support
does the ordering:

- **Redis** (kombu): one list per priority step; kombu's default steps are
  ``[0, 3, 6, 9]``, so ratchet sets ``priority_steps = [0 … 9]`` and a worker's BRPOP
  names the ten lists in order. A sender and a worker with different steps disagree
  about the lists: a turn sent at 7 to ``ratchet.turns\\x06\\x167`` is never read by a
  worker that reads only 0, 3, 6 and 9. Redis serves **0 first**, so the levels are
  reversed (9 - level). Ordering is per BRPOP, among messages already in Redis — a
  message a worker has prefetched or holds for a countdown is not reordered.
- **RabbitMQ**: ratchet's queues are declared with ``x-max-priority = 9``; 9 is served
  first. RabbitMQ fixes a queue's arguments when it is first declared, and refuses a
  declaration with other arguments (PRECONDITION_FAILED): a deployment whose
  ``ratchet.turns`` / ``ratchet.control`` were declared without priorities must delete
  them (once drained).
- **RabbitMQ quorum queues** (``RATCHET_TASK_DEFAULT_QUEUE_TYPE=quorum``): no
  ``x-max-priority`` (3.10 refuses it). Messages still carry their priority: RabbitMQ
  3.x serves a quorum queue in order whatever it says; 4.0 and later serve two levels,
  above 4 (runs under way, control messages) two for every one at 0-4 (new runs)
  (``python -m bench.quorum_priorities``, docs/broker.md).
- **filesystem://** and **memory://** have no priorities: messages go in order.
"""

from __future__ import annotations

from typing import Any

from celery.app.defaults import DEFAULTS

from runtime.limits import broker_priority
from tasks.queues import (
    AMQP_SCHEMES,
    CONTROL_QUEUE,
    REDIS_SCHEMES,
    ROUTES,
    TURNS_QUEUE,
    continuations_queue,
    queues,
    scheme_of,
)
from tasks.settings import Settings

MAX_PRIORITY = 9
PRECONDITION_FAILED = 406
"""AMQP's reply code to a declaration that differs from what the broker has."""
CONTINUATIONS = "ratchet.continuations"

REDIS_PRIORITY_SEP = "\x06\x16"
"""kombu's Redis transport keeps a queue's step ``n`` > 0 in the list ``<queue>\\x06\\x16<n>``."""

TEAM_MAY_CHOOSE = frozenset(
    {"worker_send_task_events", "task_send_sent_event", "queue_order_strategy"}
)
"""Settings of the table an app may set otherwise: they change what is seen, not what is read."""


def redis_lists(queue: str) -> list[str]:
    """The Redis lists holding ``queue``'s messages, one per priority step (0 is the queue's name)."""
    return [f"{queue}{REDIS_PRIORITY_SEP}{n}" if n else queue for n in range(MAX_PRIORITY + 1)]


def delivery_settings(broker_url: str, settings: Settings) -> dict[str, Any]:
    """The table: the Celery settings of an app on ``broker_url`` that carries ratchet's messages."""
    scheme = scheme_of(broker_url)
    redis = scheme in REDIS_SCHEMES
    transport: dict[str, Any] = {}
    if redis:
        transport = {
            "visibility_timeout": settings.visibility_timeout_s,
            "priority_steps": list(range(MAX_PRIORITY + 1)),
            "queue_order_strategy": "round_robin",
        }
    amqp = scheme in AMQP_SCHEMES
    queue_type = settings.task_default_queue_type if amqp else "classic"
    return {
        "task_queues": queues(MAX_PRIORITY if amqp else None, queue_type),
        "task_routes": _routes(scheme),
        "broker_transport_options": transport,
        "accept_content": ["json"],
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_send_task_events": task_events_on(settings, scheme),
        "task_send_sent_event": task_events_on(settings, scheme),
        "ratchet_continuations_queue": settings.continuations_queue,
        "ratchet_queue_type": queue_type,
    }


def task_events_on(settings: Settings, scheme: str) -> bool:
    """Whether Celery task events are sent: RATCHET_TASK_EVENTS, and for ``auto`` the broker.

    On Redis they are off unless asked for: there they cost a turn up to 10-20% of the
    worker's CPU and 3 ``PUBLISH`` on a gevent worker (docs/broker.md), and Flower
    switches them on itself when it starts (its ``enable_events`` control command). On
    RabbitMQ no cost was measured; the embedded ``filesystem://`` broker publishes them
    only while someone listens. Both keep them on.
    """
    if settings.task_events != "auto":
        return bool(settings.task_events)
    return scheme not in REDIS_SCHEMES


def _routes(scheme: str) -> dict[str, dict[str, Any]]:
    """Each ratchet task's queue and, where the broker has priorities, its default priority.

    A turn sent without a priority (a first turn from a client's send_task, a resume) is
    a new run's; control messages go first. In the routes, not task_default_priority:
    that becomes every task's own priority, and outranks a route.
    """
    if scheme not in REDIS_SCHEMES + AMQP_SCHEMES:
        return {name: {"queue": queue} for name, queue in ROUTES.items()}
    reversed_scale = scheme in REDIS_SCHEMES
    new_run = broker_priority(2, False, reversed_scale)
    top = 0 if reversed_scale else MAX_PRIORITY
    return {
        name: {"queue": queue, "priority": top if queue == CONTROL_QUEUE else new_run}
        for name, queue in ROUTES.items()
    }


MERGED = ("task_queues", "task_routes", "broker_transport_options", "accept_content")
"""The table's settings that are added to an app's own rather than set in their place."""


def apply_delivery(conf: Any, table: dict[str, Any]) -> None:
    """Give ``conf`` (an app's) the table: merged where an app has its own, else set where
    the app left Celery's default. A value the app chose is kept (and, unless it may
    choose it, refused at worker start by :func:`delivery_problems`)."""
    known = {queue.name for queue in conf.task_queues or ()}
    conf.task_queues = (
        *(conf.task_queues or ()),
        *(queue for queue in table["task_queues"] if queue.name not in known),
    )
    existing = conf.task_routes
    ours = table["task_routes"]
    if existing is None:
        conf.task_routes = ours
    elif isinstance(existing, dict):
        conf.task_routes = {**existing, **ours}
    else:  # a list or tuple of routers: ours first
        conf.task_routes = (ours, *existing)
    conf.broker_transport_options = {
        **table["broker_transport_options"],
        **(conf.broker_transport_options or {}),
    }
    conf.accept_content = sorted({*(conf.accept_content or ()), *table["accept_content"]})
    for name, value in table.items():
        if name not in MERGED and conf.get(name) == DEFAULTS.get(name):
            conf[name] = value


def delivery_problems(
    app: Any, settings: Settings, prefetch_multiplier: int | None = None
) -> list[str]:
    """What in ``app``'s finished configuration disagrees with the table, one clause each.

    ``prefetch_multiplier``: a worker's own (``--prefetch-multiplier`` wins over the app's).
    """
    conf = app.conf
    table = delivery_settings(conf.broker_url or settings.resolved_broker_url, settings)
    problems = []
    for name, value in table.items():
        got = conf.get(name)
        if name == "worker_prefetch_multiplier" and prefetch_multiplier is not None:
            got = prefetch_multiplier
        if name in MERGED or name in TEAM_MAY_CHOOSE or got == value:
            continue
        problems.append(f"{name} is {got!r}, ratchet needs {value!r}")
    options = conf.broker_transport_options or {}
    for key, value in table["broker_transport_options"].items():
        if key in TEAM_MAY_CHOOSE or options.get(key) == value:
            continue
        got = f"is {options[key]!r}" if key in options else "is not set (kombu's default)"
        variable = " (RATCHET_VISIBILITY_TIMEOUT_S)" if key == "visibility_timeout" else ""
        problems.append(
            f"broker_transport_options[{key!r}] {got}, ratchet needs {value!r}{variable}"
        )
    if "json" not in (conf.accept_content or ()):
        problems.append(f"accept_content is {conf.accept_content!r}: ratchet's messages are json")
    theirs = {queue.name: queue for queue in conf.task_queues or ()}
    for queue in table["task_queues"]:
        got = theirs.get(queue.name)
        if got is not None and _declared(got) != _declared(queue):
            problems.append(
                f"task_queues declares {queue.name} as {_declared(got)}, ratchet as "
                f"{_declared(queue)}"
            )
    router = app.amqp.router
    for task, queue_name in ROUTES.items():
        routed = router.route({}, task)["queue"].name
        if routed != queue_name:
            problems.append(
                f"task_routes sends {task} to {routed}, ratchet's workers read {queue_name}"
            )
    return problems


def delivery_refusal(
    app: Any, settings: Settings, prefetch_multiplier: int | None = None
) -> str | None:
    """Why ``app`` cannot carry ratchet's messages, in one line naming each setting; or None."""
    problems = delivery_problems(app, settings, prefetch_multiplier)
    if not problems:
        return None
    return (
        f"app {app.main!r} has settings ratchet cannot take: {'; '.join(problems)}; "
        "remove them from the app's configuration (tasks.install sets them)"
    )


def declaration_refusal(app: Any) -> str | None:
    """Why RabbitMQ refuses ratchet's queues as ``app`` declares them, in one line; or None.

    Declares ratchet's queues (their exchanges, the queues, the bindings) as the
    worker is about to. RabbitMQ never changes a queue's type or arguments, nor an
    exchange's type: one declared before otherwise (a classic ``ratchet.turns`` from
    before ``RATCHET_TASK_DEFAULT_QUEUE_TYPE=quorum``, or the other way round) is
    refused with PRECONDITION_FAILED, which Celery's consumer met as an unrecoverable
    traceback. None on other brokers, and when RabbitMQ cannot be reached (Celery's
    own connection retries report that).
    """
    conf = app.conf
    if scheme_of(str(conf.broker_url or "")) not in AMQP_SCHEMES:
        return None
    queue_type = conf.get("ratchet_queue_type") or "classic"
    ours = [app.amqp.queues[name] for name in (TURNS_QUEUE, CONTROL_QUEUE)]
    ours.append(
        continuations_queue(conf.get("ratchet_continuations_queue") or CONTINUATIONS, queue_type)
    )
    connection = app.connection_for_write()
    try:
        for queue in ours:
            refused = _refused(connection, queue)
            if refused is not None:
                return _migrate(connection, queue, queue_type, refused)
    except connection.connection_errors:
        return None
    finally:
        connection.release()
    return None


def _refused(connection: Any, queue: Any) -> str | None:
    """RabbitMQ's PRECONDITION_FAILED reply to declaring ``queue``, or None once declared."""
    channel = connection.channel()
    try:
        queue(channel).declare()
    except connection.channel_errors as exc:
        if getattr(exc, "code", None) != PRECONDITION_FAILED:
            raise
        return " ".join(str(exc).split())
    finally:
        try:
            channel.close()
        except connection.channel_errors:
            pass  # RabbitMQ closed it with its refusal
    return None


def _migrate(connection: Any, queue: Any, queue_type: str, refused: str) -> str:
    vhost = connection.virtual_host or "/"
    declared = f"a {queue_type} queue behind a {queue.exchange.type} exchange"
    # RabbitMQ names the first argument that differs: the queue's type, or the exchange's
    # (which quorum queues change too), means the other type was declared before.
    other = "classic" if queue_type == "quorum" else "quorum"
    keep = (
        f"; or set RATCHET_TASK_DEFAULT_QUEUE_TYPE={other} to keep the queues RabbitMQ has"
        if "'x-queue-type'" in refused or "for exchange" in refused
        else ""
    )
    return (
        f"RabbitMQ refuses {queue.name} as this worker declares it ({declared}, "
        f"RATCHET_TASK_DEFAULT_QUEUE_TYPE={queue_type}): {refused}; RabbitMQ never changes "
        "a queue's type or arguments, nor an exchange's type: stop the senders and workers "
        f"of the old declaration, let {queue.name} drain, delete it and its exchange "
        f"(`rabbitmqctl delete_queue -p {vhost} {queue.name}`, `rabbitmqadmin -V {vhost} "
        f"delete exchange name={queue.name}`) and start the workers again{keep}"
    )


def _declared(queue: Any) -> str:
    exchange = queue.exchange.name if queue.exchange is not None else ""
    arguments = dict(queue.queue_arguments or {})
    return f"exchange {exchange!r}, routing key {queue.routing_key!r}, arguments {arguments}"


__all__ = [
    "CONTROL_QUEUE",
    "MAX_PRIORITY",
    "TURNS_QUEUE",
    "apply_delivery",
    "declaration_refusal",
    "delivery_problems",
    "delivery_refusal",
    "delivery_settings",
    "redis_lists",
]
