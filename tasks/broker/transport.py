# mypy: disable-error-code="no-untyped-call,override,misc,attr-defined"
# (kombu's transports are untyped, and the mixins below use its channel attributes.)
"""``ratchet-redis``: kombu's Redis transport, hardened and leaner; and the app's broker seams.

Its channel checks every entry it reads (``BRPOP``/``RPOP``, tasks/broker/entries.py)
and sets a bad one aside instead of dying on it, and it does less in the worker's
main process for each message: one client for every publish and ack, the BRPOP
packed once per order of its queues, and kombu's unacked bookkeeping written with
the next BRPOP (tasks/broker/unacked.py). Kombu's own source is untouched: the changes
are overrides of the channel's read methods, registered under their own alias.

``transport_for`` picks ratchet's transports by broker URL — this one for
``redis://`` and ``rediss://``, its Sentinel form (``ratchet-sentinel``) for kombu's
``sentinel://`` (which ``RATCHET_BROKER_URL=redis+sentinel://…`` becomes, worker/app.py),
``ratchet-filesystem`` (tasks/broker/embedded.py)
for ``filesystem://`` — and ``RatchetAMQP`` and ``RatchetEvents`` are the app's
``amqp`` and ``events`` seams (worker/app.py). What sending a message reaches of
Celery's and kombu's internals is in one module, tasks/broker/next_turn.py.
"""

from __future__ import annotations

import logging
import threading
from queue import Empty
from time import monotonic
from typing import Any

from celery.app.amqp import AMQP
from celery.app.events import Events
from celery.events.dispatcher import EventDispatcher
from kombu import Connection
from kombu.transport import TRANSPORT_ALIASES, redis
from kombu.utils.encoding import bytes_to_str
from redis import sentinel

from store.redis_connection import CheckedConnection
from store.rejected import RejectedStore
from store.rejected.redis import RedisRejected
from tasks.broker.embedded import FILESYSTEM_ALIAS, FilesystemChannel
from tasks.broker.entries import SafeEntries, envelope_problem
from tasks.broker.next_turn import without_sent_event
from tasks.broker.unacked import RedisQoS, RidingPoller

log = logging.getLogger("ratchet.transport")

REDIS_ALIAS = "ratchet-redis"
SENTINEL_ALIAS = "ratchet-sentinel"


class SafeRedisReads(SafeEntries):
    """The Redis channel's three reads of a queue entry, each through accept_entry."""

    def rejected_store(self) -> RejectedStore:
        return RedisRejected(self._create_client())

    def _brpop_read(self, **options: Any) -> bool:
        # kombu's _brpop_read with two changes: the replies of the unacked bookkeeping
        # the BRPOP carried are read first (tasks/broker/unacked.py), and the entry goes
        # through accept_entry instead of straight into loads() and the delivery
        # callback. Kept in step with kombu 5.7 (the reauth flush in `finally` included).
        if getattr(self.qos, "riding", 0):
            connection = self.client.connection
            try:
                self.qos.read_riding(connection)
                waiting = not self._closing and not connection.can_read(timeout=0)
            except self.connection_errors:
                connection.disconnect()
                self._in_poll = None
                raise
            if waiting:
                raise Empty()  # the BRPOP still waits: its reply wakes the loop again
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            payload = self.accept_entry(item, dest)
            if payload is None:
                raise Empty()
            # The connection is idle until the next BRPOP: the delivery's bookkeeping is
            # written on it (tasks/broker/unacked.py).
            self.delivering = self.client.connection
            try:
                self.connection._deliver(payload, dest)
            finally:
                self.delivering = None
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _get(self, queue: str) -> dict[str, Any]:
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                while item := client.rpop(self._q_for_pri(queue, pri)):
                    payload = self.accept_entry(item, queue)
                    if payload is not None:
                        self._maybe_update_queues_expire(client, queue)
                        return payload
            self._maybe_update_queues_expire(client, queue)
            raise Empty()

    def _deliver_fanout_message(self, message: Any, exchange: str) -> bool:
        problem = envelope_problem(message, self.decode_body)
        if problem is not None:
            # Broadcasts (remote control) are best-effort in kombu: log and skip.
            log.warning("fanout exchange %s: broadcast ignored: %s", exchange, problem)
            return False
        return bool(super()._deliver_fanout_message(message, exchange))


BRPOP_COMMANDS_MAX = 64
"""Packed BRPOP commands a channel keeps (one per order of its queues, at most)."""


class RedisChannel(SafeRedisReads, redis.Channel):
    QoS = RedisQoS
    # Plain TCP connections check themselves out without gevent's hub (TLS and Unix
    # sockets keep kombu's classes): store/redis_connection.py.
    connection_class = CheckedConnection
    delivering: Any = None
    """The BRPOP connection while a message read on it is delivered (else None)."""
    _plain_client: Any = None
    _brpop_connection: Any = None
    _brpop_commands: dict[tuple[Any, ...], Any] | None = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        # kombu asks for a new redis.Redis for every publish, ack and restore; each one
        # copies redis-py's table of ~170 response callbacks (measured: two per turn,
        # about 0.3 ms). The client holds no connection of its own (it checks one out
        # of the channel's pool per command), so one per pool serves them all.
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._plain_client
        if client is None or client.connection_pool is not self.pool:
            client = self._plain_client = super()._create_client()
        return client

    def _brpop_start(self, timeout: float | None = None) -> None:
        # kombu's _brpop_start, with the command packed once per order of the queues
        # instead of for every message: with ratchet's ten priority steps (worker/
        # priorities.py) a BRPOP names ten lists a queue, 21 keys for the turns and
        # control queues, and packing them was the largest share of what the steps
        # cost the worker's main process (measured: 3x the packing of a one-list BRPOP,
        # once a turn). Kept in step with kombu 5.7.
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        connection = self.client.connection
        commands = self._brpop_commands
        if commands is None or self._brpop_connection is not connection:
            # Packed with this connection's encoder (kombu may give the client a new one).
            commands = self._brpop_commands = {}
            self._brpop_connection = connection
        order = (*queues, timeout)
        packed = commands.get(order)
        if packed is None:
            keys = [self._q_for_pri(queue, pri) for pri in self.priority_steps
                    for queue in queues]  # fmt: skip
            command_args = ["BRPOP", *keys, timeout or 0]
            if self.global_keyprefix:
                command_args = self.client._prefix_args(command_args)
            packed = connection.pack_command(*command_args)
            if len(commands) >= BRPOP_COMMANDS_MAX:
                commands.clear()
            commands[order] = packed
        riders = self.qos.take_riders(connection) if self.qos.riders else None
        self._in_poll = connection
        self._brpop_sent_at = monotonic()  # type: ignore[assignment]  # kombu: None until sent
        try:
            # One send for the bookkeeping and the BRPOP: one write on the wire.
            connection.send_packed_command([b"".join((riders, *packed))] if riders else packed)
        except BaseException:
            self.qos.riding = 0
            raise

    def _flush_brpop_reauth(self) -> None:
        # kombu sends AUTH on the idle BRPOP connection and reads its reply: not before the
        # replies of the bookkeeping it carried are read (its timer tries again).
        if not self.qos.riding:
            super()._flush_brpop_reauth()

    def close(self) -> None:
        # What the bookkeeping still owes is written while the clients are open (kombu
        # closes them before it restores what the channel still holds).
        if not self.closed:
            try:
                self.qos.settle()
            except self.connection_errors as exc:
                # A lost connection closes the channel too: kombu's close must still run.
                log.warning("the broker's unacked bookkeeping was not written at close: %r", exc)
            if self._in_poll:
                try:
                    self._brpop_read()
                except Empty:
                    pass
                except self.connection_errors as exc:
                    # kombu's close reads the BRPOP in flight first and lets a dead
                    # connection's error out before it marks the channel closed; Celery
                    # 5.7 then closes it again after kombu dropped the transport, and
                    # restoring the unacked messages there died on `None.hostname`: an
                    # unrecoverable error that ended the worker whenever its Redis went
                    # away. The reply is lost with the connection; the close goes on.
                    log.warning("the broker connection died with a read in flight: %r", exc)
        super().close()


class RedisTransport(redis.Transport):
    Channel = RedisChannel
    driver_name = "redis"

    cycle: RidingPoller  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = RidingPoller()

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self.cycle.loop_thread = threading.get_ident()
        super().register_with_event_loop(connection, loop)


TRANSPORT_ALIASES.setdefault(REDIS_ALIAS, f"{__name__}:RedisTransport")


class RedisSentinelChannel(RedisChannel, redis.SentinelChannel):
    """ratchet's Redis channel on the primary a Sentinel names (kombu's SentinelChannel
    finds it: each new connection asks the sentinels, so after a failover the consumer's
    reconnect reaches the promoted replica). Its connections are Sentinel's own class:
    they must ask where to connect, which the plain-TCP CheckedConnection does not."""

    connection_class = sentinel.SentinelManagedConnection  # type: ignore[assignment]
    connection_class_ssl = redis.SentinelManagedSSLConnection


class RedisSentinelTransport(RedisTransport):
    Channel = RedisSentinelChannel
    default_port = redis.SentinelTransport.default_port  # type: ignore[assignment]


TRANSPORT_ALIASES.setdefault(SENTINEL_ALIAS, f"{__name__}:RedisSentinelTransport")


def transport_for(broker_url: str) -> str | None:
    """The ratchet transport alias for ``broker_url``, or None to leave kombu's choice."""
    scheme = broker_url.split("://", 1)[0]
    if scheme in ("redis", "rediss"):
        return REDIS_ALIAS
    if scheme == "sentinel":
        return SENTINEL_ALIAS
    if scheme == "filesystem":
        return FILESYSTEM_ALIAS
    return None


class RatchetConnection(Connection):
    """kombu's Connection, with ratchet's transport for a ``redis://`` or ``filesystem://`` URL.

    Chosen per connection from the URL (not once in ``broker_transport``), so an
    app whose ``broker_url`` is changed after it was built still gets the right
    transport; an explicit ``transport=`` wins.
    """

    def __init__(self, hostname: Any = "localhost", *args: Any, **kwargs: Any) -> None:
        if kwargs.get("transport") is None and isinstance(hostname, str):
            kwargs["transport"] = transport_for(hostname)
        super().__init__(hostname, *args, **kwargs)


class RatchetAMQP(AMQP):
    """Celery's ``app.amqp`` (its ``Celery(amqp=…)`` seam), making RatchetConnections.

    And it does not send ``task-sent`` for a ratchet task that a running task sends
    (the next turn a turn chains, a sweep's resume): the worker that receives it
    sends ``task-received``, ``task-started`` and ``task-succeeded``, which is
    what Flower and ``celery events`` list a task by, so the event only cost a
    ``PUBLISH`` and its encoding in the pool process on every turn. What a client
    sends (the CLI, the API, beat) still has its ``task-sent``, and so does any
    task that is not ratchet's (an application's notification task).
    """

    Connection = RatchetConnection

    def as_task_v2(self, task_id: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("ratchet.") and self.app.current_worker_task is not None:
            args, kwargs = without_sent_event(args, kwargs)
        return super().as_task_v2(task_id, name, *args, **kwargs)


class ListenedEventDispatcher(EventDispatcher):
    """Celery's event dispatcher, which publishes nothing on a filesystem broker while
    no queue is bound to the events exchange.

    On a ``filesystem://`` broker the worker's consumer has no event loop, so Celery
    publishes each task event on its own (``task-received``, ``-started``,
    ``-succeeded``: three a turn), and with nothing listening kombu drops each one
    after encoding it (measured: about a fifth of the worker's main process CPU).
    ``celery events`` and Flower bind a queue to the exchange, which writes its
    table file: from the next event on, every event is published as Celery does.
    """

    def _publish(
        self, event: Any, producer: Any, routing_key: str, *args: Any, **kwargs: Any
    ) -> Any:
        # (Celery's one way out for send, publish and flush alike.)
        channel = producer.channel if producer is not None else None
        if isinstance(channel, FilesystemChannel) and not channel.get_table(self.exchange.name):
            return None
        return super()._publish(event, producer, routing_key, *args, **kwargs)


class RatchetEvents(Events):
    """Celery's ``app.events`` (its ``Celery(events=…)`` seam), with ListenedEventDispatcher."""

    dispatcher_cls = f"{__name__}:ListenedEventDispatcher"
