"""The lean publish of a chained ``ratchet.turn``: Celery's message, without Celery's per-message work.

Every turn that is not the last sends the next one from inside a running task
(tasks/turn.py ``enqueue_next``). Through ``send_task`` that publish merged the
task's options, routed them, built the message and its sent event, acquired a
producer from the pool, checked the queue's declaration and wrapped the publish
in a retrying ``ensure``, all the same for every turn (measured: a fifth of a
turn's wall time in the pool process, half of it outside the broker's round
trip). Here what does not change from one turn to the next is worked out once
per app and queue with Celery's own code (the routing, the exchange and routing
key, the delivery mode, the timelimit and origin headers), and each message costs
its ids, its headers, one JSON encoding, a producer taken from the pool and given
back, and the broker's ``basic_publish``.

The message is the one ``send_task`` would publish, field by field (headers,
properties, body, exchange, routing key, priority, queue; tests/test_publish.py
holds it to that), and Celery's ``before_task_publish`` and ``after_task_publish``
signals fire with the same arguments, so worker/observe.py still labels it and an
application's receivers still see it. Whatever this does not reproduce goes
through ``send_task`` instead (:meth:`LeanTurns.publish` returns None): a
countdown (an ETA), options of the sender's, a router that is not a plain map
(a function may route on the arguments), compression, an expiry, inherited
priorities, a result backend that acts on a send, ``task_sent`` receivers, and a publish that fails (``send_task``
then retries it, reconnecting as its policy says, under the same task id).

**The outbox.** When the broker is kombu's Redis channel on the same redis-server as
the run store (any database; not Sentinel, no key prefix, no queue expiry), the turn's
last checkpoint, the one that releases its lease (tasks/held_run.py), also pushes the
next turn in the same script (store/runs/lua/append.lua): checkpoint, release and
enqueue are one atomic write, one round trip fewer, and a crash between checkpoint and
enqueue no longer leaves the run to the sweeper. :meth:`LeanTurns.outbox` builds the
entry with kombu's own channel steps (``prepare_message``, ``_inplace_augment_message``,
the priority list of ``_q_for_pri``, kombu's JSON), so the bytes are those ``_put``
would LPUSH. ``before_task_publish`` fires as the entry is built, ``after_task_publish``
once the checkpoint is written; a checkpoint refused (fenced, stale) pushes nothing, and
one that falls back to separate writes leaves the turn to the ordinary publish.

**The seam.** This is the one module of :mod:`tasks.broker` where sending a message
reaches into Celery's and kombu's internals (checked against celery 5.7.0 and kombu 5.7.0; tests/test_publish.py
holds the message to ``send_task``'s byte for byte, tests/crash/test_outbox.py the outbox
entry to kombu's): upgrading either means reading this file, and that test. It uses:

- Celery: the registry ``app._tasks`` (``app.tasks`` would finalise the app),
  ``Task._get_exec_options``, ``Backend.on_task_call`` (compared, not called), the
  router's ``routes`` and ``MapRoute`` and ``route()``, ``amqp.default_exchange``,
  ``argsrepr_maxsize`` and ``kwargsrepr_maxsize``, the layout and order of
  ``AMQP.as_task_v2``'s headers, ``app.current_worker_task``, ``app.thread_oid``,
  ``app.producer_pool``, ``add_trail``, ``celery.utils`` (``uuid``, ``anon_nodename``,
  ``saferepr``), the arguments ``send_task_message`` gives the publish signals;
  ``celery._state.get_current_task`` (:func:`running_task`, for tasks/messages.py's
  ``sending_app``); and where ``as_task_v2`` takes ``create_sent_event`` by position
  (:func:`without_sent_event`, for tasks/broker/transport.py's ``RatchetAMQP``); and an
  attribute of ours on the app, its lean publisher (:data:`LEAN_TURNS_ATTRIBUTE`).
- kombu: ``Producer._delivery_details``, ``channel.prepare_message`` and
  ``basic_publish``, the connection's ``declared_entities`` and ``maybe_declare``,
  ``kombu.serialization.dumps``, ``kombu.utils.json.dumps``; on the Redis channel
  ``_put``, ``_inplace_augment_message``, ``_q_for_pri``, ``_get_message_priority``,
  ``global_keyprefix``, ``_expires``, ``pool.connection_kwargs`` and ``SentinelChannel``.

Receiving is the rest of this package (:mod:`tasks.broker`): kombu's channels
subclassed where they read and acknowledge, and Celery's consumer.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from celery import signals
from celery._state import get_current_task
from celery.app.routes import MapRoute
from celery.backends.base import Backend
from celery.utils import uuid
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from kombu import serialization
from kombu.common import Broadcast, maybe_declare
from kombu.utils import json as kombu_json

from store.runs import Outbox

TASK = "ratchet.turn"

_ROUTED_NAMED = frozenset(
    {"exchange", "routing_key", "queue", "serializer", "delivery_mode", "declare",
     "exchange_type"}
)  # fmt: skip
"""Routed options ``send_task_message`` takes by name; any other but ``priority`` (which
becomes a message property) is one this module does not reproduce."""


def _pushes_as_kombu(channel: Any) -> bool:
    """Whether ``channel`` puts a message on a queue exactly as kombu's Redis channel does:
    one LPUSH of the entry onto the list of its priority, nothing else (no key prefix, no
    queue expiry), on a single server (not Sentinel)."""
    kombu_redis = sys.modules.get("kombu.transport.redis")
    if kombu_redis is None:  # no Redis channel was ever made here; importing it would
        return False  # load redis-py (and the OpenTelemetry it loads) for nothing
    return (
        isinstance(channel, kombu_redis.Channel)
        and not isinstance(channel, kombu_redis.SentinelChannel)
        and type(channel)._put is kombu_redis.Channel._put
        and type(channel)._inplace_augment_message is kombu_redis.Channel._inplace_augment_message
        and not channel.global_keyprefix
        and not channel._expires
        and getattr(channel, "pool", None) is not None
    )


@dataclass(frozen=True)
class Route:
    """What every ``ratchet.turn`` of one app to one queue shares."""

    queue: Any
    """The kombu Queue (declared before the first publish on a connection)."""
    exchange: str
    routing_key: str
    priority: Any
    """The route's broker priority: a message sent without one carries it."""
    delivery_mode: Any
    serializer: str
    retry_policy: dict[str, Any]
    headers: dict[str, Any]
    """The headers that are the same for every message (``eta``, ``root_id``, … per message)."""


class LeanTurns:
    """An app's lean ``ratchet.turn`` publisher: its routes, worked out once per queue."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._routes: dict[str, Route | None] = {}
        self._pid = os.getpid()

    def route(self, queue: str) -> Route | None:
        """The route of a ``ratchet.turn`` to ``queue``, or None when it must go through Celery."""
        if queue not in self._routes:
            self._routes[queue] = self._work_out(queue)
        return self._routes[queue]

    def _work_out(self, queue_name: str) -> Route | None:
        app, amqp, conf = self.app, self.app.amqp, self.app.conf
        router = amqp.router
        if conf.task_protocol != 2 or conf.task_inherit_parent_priority:
            return None
        if not all(isinstance(r, MapRoute) for r in router.routes):
            return None
        task_type = app._tasks.get(TASK)
        if task_type is None or type(app.backend).on_task_call is not Backend.on_task_call:
            return None  # a result backend that does something as a task is sent (rpc://)
        # send_task's own steps, once: the task's execution options under the caller's,
        # then the router's.
        exec_options = {k: v for k, v in task_type._get_exec_options().items() if v is not None}
        options = dict(exec_options, queue=queue_name)
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        if options.pop("expires", None) is not None or options.pop("ignore_result", None):
            return None
        options = router.route(options, TASK, (), {}, task_type)
        if set(options) - _ROUTED_NAMED - {"priority"} or options.get("declare") is not None:
            return None
        if conf.task_compression or options.get("compression"):
            return None
        # send_task_message's choice of exchange and routing key, once.
        queue = options["queue"]
        exchange, routing_key = options.get("exchange"), options.get("routing_key")
        exchange_type = options.get("exchange_type") or getattr(queue.exchange, "type", "direct")
        if (not exchange or not routing_key) and exchange_type == "direct":
            exchange, routing_key = "", queue.name
        elif exchange is None:
            exchange = queue.exchange.name or amqp.default_exchange
            routing_key = routing_key or queue.routing_key or conf.task_default_routing_key
        if not isinstance(exchange, str) or isinstance(queue, Broadcast):
            return None
        delivery_mode = options.get("delivery_mode") or (
            getattr(queue.exchange, "delivery_mode", None) or conf.task_default_delivery_mode
        )
        # as_task_v2's headers in its order (a consumer reads them back in it); those
        # set per message are None here.
        headers = {
            "lang": "py",
            "task": TASK,
            "id": None,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [time_limit, soft_time_limit],
            "root_id": None,
            "parent_id": None,
            "argsrepr": saferepr((), amqp.argsrepr_maxsize, maxlevels=conf.task_repr_maxlevels),
            "kwargsrepr": None,
            "origin": anon_nodename(),
            "ignore_result": None,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        }
        return Route(
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            priority=options.get("priority"),
            delivery_mode=delivery_mode,
            serializer=options.get("serializer") or conf.task_serializer,
            retry_policy=dict(conf.task_publish_retry_policy or {}),
            headers=headers,
        )

    def publish(
        self, kwargs: dict[str, Any], queue: str, priority: int | None, extra: dict[str, Any]
    ) -> str | None:
        """Publish ``ratchet.turn(**kwargs)`` from the running task; its id, or None if not sent.

        None means nothing went out: the caller sends the message through ``send_task``.
        ``extra``: headers of the sender's (ratchet's version header).
        """
        message = self._message(kwargs, queue, priority, extra)
        if message is None:
            return None
        message.before()
        try:
            with self._producer() as producer:
                self._send(
                    producer, message.route, message.body, message.headers, message.properties
                )
        except Exception:
            # Celery's path retries and reconnects (task_publish_retry_policy): hand it over.
            return None
        message.after()
        return message.task_id

    def outbox(
        self,
        runs: Any,
        kwargs: dict[str, Any],
        queue: str,
        priority: int | None,
        extra: dict[str, Any],
    ) -> OutboxTurn | None:
        """``ratchet.turn(**kwargs)`` as the entry kombu's Redis channel would LPUSH, for the
        run store ``runs`` to push with a transition (store/runs: :class:`Outbox`); None
        unless that is exactly what a publish would do (see the module docstring).

        Its ``before_task_publish`` has fired; call :meth:`OutboxTurn.sent` once it is pushed.
        """
        message = self._message(kwargs, queue, priority, extra)
        if message is None or message.route.exchange != "" or " " in message.route.routing_key:
            return None  # an exchange routes by its bindings, looked up as it publishes
        try:
            with self._producer() as producer:
                return self._outbox_entry(runs, message, producer)
        except Exception:  # noqa: BLE001 - the broker is out of reach: the publish path says so
            return None

    def _outbox_entry(self, runs: Any, message: LeanMessage, producer: Any) -> OutboxTurn | None:
        """:meth:`outbox`'s entry, built with ``producer``'s channel (nothing is sent on it)."""
        route = message.route
        channel = producer.channel
        if not _pushes_as_kombu(channel):
            return None
        server = dict(channel.pool.connection_kwargs)
        if not runs.pushes_to(server):
            return None
        if hash(route.queue) not in channel.connection.client.declared_entities:
            maybe_declare(route.queue, channel, True, **route.retry_policy)  # type: ignore[no-untyped-call]
        message.before()
        properties = dict(message.properties)
        priority = properties.pop("priority", 0)
        properties["delivery_mode"] = producer._delivery_details(
            route.exchange, route.delivery_mode
        )[1]
        content_type, content_encoding, data = serialization.dumps(  # type: ignore[no-untyped-call]
            message.body, serializer=route.serializer
        )
        # kombu's own steps from Producer._publish to Channel._put, less the LPUSH.
        entry = channel.prepare_message(
            data, priority, content_type, content_encoding, message.headers, properties
        )
        channel._inplace_augment_message(entry, route.exchange, route.routing_key)
        key = channel._q_for_pri(
            route.routing_key, channel._get_message_priority(entry, reverse=False)
        )
        payload = kombu_json.dumps(entry).encode("utf-8")  # type: ignore[no-untyped-call]
        return OutboxTurn(message, Outbox(int(server.get("db") or 0), key, payload))

    def _message(
        self, kwargs: dict[str, Any], queue: str, priority: int | None, extra: dict[str, Any]
    ) -> LeanMessage | None:
        """The message send_task would build, or None where it must go through Celery."""
        app = self.app
        if os.getpid() != self._pid:  # forked: the routes hold the parent's pid (origin)
            self._routes, self._pid = {}, os.getpid()
        parent = app.current_worker_task
        route = self.route(queue)
        if parent is None or route is None or signals.task_sent.receivers:
            return None
        conf = app.conf
        task_id: str = uuid()
        request = parent.request
        headers = dict(route.headers)
        headers["id"] = task_id
        headers["root_id"] = request.root_id or request.id or task_id
        headers["parent_id"] = request.id
        headers["kwargsrepr"] = _kwargsrepr(
            kwargs, app.amqp.kwargsrepr_maxsize, conf.task_repr_maxlevels
        )
        headers.update(extra)
        priority = route.priority if priority is None else priority
        properties: dict[str, Any] = {"correlation_id": task_id, "reply_to": app.thread_oid}
        if priority is not None:
            properties["priority"] = priority
        body = ((), kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
        return LeanMessage(app, parent, route, task_id, headers, properties, body)

    def _send(
        self,
        producer: Any,
        route: Route,
        body: Any,
        headers: dict[str, Any],
        properties: dict[str, Any],
    ) -> None:
        """kombu's Producer.publish and _publish, less what is the same every time."""
        properties = dict(properties)
        priority = properties.pop("priority", 0)
        properties["delivery_mode"] = producer._delivery_details(
            route.exchange, route.delivery_mode
        )[1]
        content_type, content_encoding, data = serialization.dumps(  # type: ignore[no-untyped-call]
            body, serializer=route.serializer
        )
        channel = producer.channel
        message = channel.prepare_message(
            data, priority, content_type, content_encoding, headers, properties
        )
        queue = route.queue
        if hash(queue) not in channel.connection.client.declared_entities:
            maybe_declare(queue, channel, True, **route.retry_policy)  # type: ignore[no-untyped-call]
        channel.basic_publish(
            message,
            exchange=route.exchange,
            routing_key=route.routing_key,
            mandatory=False,
            immediate=False,
            timeout=None,
            confirm_timeout=None,
        )

    def _producer(self) -> Any:
        """A producer of the app's pool, given back when the block ends (a context manager).

        Never kept by a thread between publishes: a threads or gevent worker runs more
        turns at once than the pool has producers (``broker_pool_limit``), and a slot
        kept by each would leave the rest, and Celery's own sends, waiting for ever.
        """
        return self.app.producer_pool.acquire(block=True)


@dataclass
class LeanMessage:
    """One ``ratchet.turn`` as send_task would build it, and its publish signals."""

    app: Any
    parent: Any
    """The running task that sends it."""
    route: Route
    task_id: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    body: Any

    def before(self) -> None:
        """Celery's ``before_task_publish``, as send_task_message sends it."""
        signals.before_task_publish.send(
            sender=TASK, body=self.body, exchange=self.route.exchange,
            routing_key=self.route.routing_key, declare=[self.route.queue],
            headers=self.headers, properties=self.properties,
            retry_policy=dict(self.route.retry_policy),
        )  # fmt: skip

    def after(self) -> None:
        """Celery's ``after_task_publish``, and the parent's trail, as send_task does."""
        signals.after_task_publish.send(
            sender=TASK, body=self.body, headers=self.headers, exchange=self.route.exchange,
            routing_key=self.route.routing_key,
        )  # fmt: skip
        self.parent.add_trail(self.app.AsyncResult(self.task_id))


@dataclass
class OutboxTurn:
    """A turn for the run store to push with the checkpoint that ends the turn before it."""

    message: LeanMessage
    outbox: Outbox

    def sent(self) -> None:
        """The transition, and the message with it, is written."""
        self.message.after()


_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _kwargsrepr(kwargs: dict[str, Any], maxsize: int, maxlevels: int) -> str:
    """``saferepr(kwargs, maxsize, maxlevels=maxlevels)``, as send_task writes it.

    A turn's fields (a validated run id, a seq) print the same through ``repr``, which
    is 30 times cheaper: saferepr only differs on long, nested or unusual values.
    """
    plain = all(
        value is None
        or type(value) is int
        or (type(value) is str and len(value) <= 128 and _PLAIN.issuperset(value))
        for value in kwargs.values()
    )
    if (
        plain
        and maxlevels >= 1
        and all(type(key) is str and _PLAIN.issuperset(key) for key in kwargs)
    ):
        text = repr(kwargs)
        if len(text) <= maxsize // 2:
            return text
    text = saferepr(kwargs, maxsize, maxlevels=maxlevels)
    return str(text)


running_task = get_current_task
"""The task running in this thread, or None (Celery's own, private, lookup)."""

SENT_EVENT_AT = 14
"""Where ``create_sent_event`` is among ``AMQP.as_task_v2``'s arguments after
``task_id, name`` (Celery 5's ``send_task`` passes it by position)."""


def without_sent_event(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``as_task_v2``'s arguments after ``task_id, name``, asking for no ``task-sent`` event."""
    if len(args) > SENT_EVENT_AT:
        return (*args[:SENT_EVENT_AT], False, *args[SENT_EVENT_AT + 1 :]), kwargs
    kwargs["create_sent_event"] = False
    return args, kwargs


LEAN_TURNS_ATTRIBUTE = "_ratchet_lean_turns"
"""Where an app keeps its lean publisher: a Celery app carries its own per-app state as
attributes, and one kept there goes with the app (no registry keyed by ``id(app)``, whose
ids a collected app hands on)."""


def lean_turns(app: Any) -> LeanTurns:
    """``app``'s lean publisher: one per app, made on first use. A forked child inherits it
    and works its routes out again (:meth:`LeanTurns._message`)."""
    publisher: LeanTurns | None = app.__dict__.get(LEAN_TURNS_ATTRIBUTE)
    if publisher is None:
        # setdefault is one step under the GIL: threads that race here share one publisher.
        publisher = app.__dict__.setdefault(LEAN_TURNS_ATTRIBUTE, LeanTurns(app))
    return publisher
