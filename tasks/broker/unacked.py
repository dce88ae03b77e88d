# mypy: disable-error-code="no-untyped-call,override,misc,attr-defined"
# (kombu's transports are untyped, and the classes below use its channel attributes.)
"""kombu's unacked bookkeeping on Redis, written on the BRPOP connection and not waited for.

kombu's Redis channel emulates acknowledgements: every delivery adds the message
to the ``unacked`` hash and its tag to the ``unacked_index`` sorted set, every ack
removes both, so a worker that dies holding a message gives it back once the
visibility timeout has passed. Each step is a pipeline the worker's main process
sends and then waits for — two round trips a turn, in the loop that hands the
next turn to a pool process (py-spy, a chain of turns: about 40% of that loop's
busy time).

In a worker's event loop the steps are written on the channel's BRPOP connection
and their replies read when they come, ahead of the BRPOP's own:

- a delivery's step at once, as the delivery is read and before it is handed on
  (where kombu sends its pipeline), since the connection is idle just then;
- an ack's step at the loop's next tick: ahead of the BRPOP the tick sends, in the
  same write, or on its own when the connection is idle (a channel that may not
  consume more, so sends no BRPOP: a prefork worker whose processes are all busy),
  or, while a BRPOP waits on that connection, as kombu sends it, a pipeline waited
  for. An ack from another thread (a threads pool acknowledges from its own) is
  kombu's pipeline, sent from that thread.

A delivery's step is written when kombu writes it, an ack's one tick later at most,
and neither is waited for. Before anything reads
the hash — a restore, a reject, the channel's close — every queued step is written
and every reply read. Outside an event loop (a client draining events) kombu's own
steps are sent, each a pipeline.

The hash is read defensively: kombu's ``restore_by_tag`` parses an entry as
``[envelope, exchange, routing_key]`` inside the worker's loop, and one entry that is
not (``HSET unacked t garbage`` with ``t`` in the index: ``JSONDecodeError``; ``[[1],2]``:
``ValueError``) ended every worker at its first restore, and stayed to end the next.
Here an entry that cannot be restored is taken out of the hash and its index in the
same transaction as any restore, and set aside in the refused-message store
(:mod:`store.rejected`) once, by the one worker whose transaction removed it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from time import time
from typing import Any

from kombu.transport import redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from tasks.broker.entries import envelope_problem
from tasks.refusals import set_aside

log = logging.getLogger("ratchet.transport")

UNACKED_QUEUE = "unacked"
"""The queue named on an entry set aside from kombu's unacked hash (the hash's key)."""


def unacked_problem(raw: bytes, decode_body: Any) -> str | None:
    """Why ``raw`` (a value of kombu's unacked hash) cannot be restored; None if it can.

    kombu writes ``[envelope, exchange, routing_key]`` and restores the envelope to the
    queues the exchange and routing key name, so the envelope must be one its channel
    can deliver (tasks/broker/entries.py).
    """
    try:
        entry = loads(bytes_to_str(raw))
    except (ValueError, TypeError, RecursionError) as exc:
        return f"not JSON ({type(exc).__name__}: {str(exc)[:200]})"
    if not (isinstance(entry, list) and len(entry) == 3):
        return "not a JSON array [envelope, exchange, routing_key]"
    envelope, exchange, routing_key = entry
    if not (isinstance(exchange, str) and isinstance(routing_key, str)):
        return "its exchange and routing key must be strings"
    problem = envelope_problem(envelope, decode_body)
    return None if problem is None else f"its message: {problem}"


class RedisQoS(redis.QoS):
    """kombu's QoS, with the bookkeeping as riders (see the module docstring) and, where
    it is still sent on its own, one plain pipeline instead of a transaction.

    Plain pipelines: kombu wraps each pair in MULTI/EXEC, which doubles the commands
    the worker's main process packs and the replies it parses. The pair is still sent
    in one write and run in order. Nothing needs it atomic: the only reader,
    ``restore_visible``, takes tags older than the visibility timeout and restores each
    in a transaction that WATCHes the hash, so a half-applied pair reads as a message
    already acked (nothing restored) or, for a delivery cut short, a tag without a
    message (its index entry removed) — and the message was taken off its list before
    either. Restores keep kombu's transactions (they pass their own pipe).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.riders: list[tuple[Any, ...]] = []
        self.riding = 0  # steps written with the BRPOP in flight, their replies not yet read
        self._riding_on: Any = None  # the socket they were written to

    def _ride(self) -> bool:
        channel = self.channel
        connection = channel.connection
        # A closed channel (its broker connection lost) has none: an ack that arrives for
        # one of its messages afterwards (its task still ran) takes kombu's own path.
        if connection is None:
            return False
        return connection.cycle.loop_thread is not None and not channel.global_keyprefix

    def _on_loop(self) -> bool:
        return bool(self.channel.connection.cycle.loop_thread == threading.get_ident())

    def append(self, message: Any, delivery_tag: Any) -> None:
        connection = self.channel.delivering
        if connection is None or not self._ride():
            super().append(message, delivery_tag)
            return
        delivery = message.delivery_info
        raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        self.riders.append(("ZADD", self.unacked_index_key, time(), delivery_tag))
        self.riders.append(("HSET", self.unacked_key, delivery_tag, raw))
        self.write_riders(connection)
        redis.virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: Any) -> None:
        if not self._ride():
            super().ack(delivery_tag)
            return
        if not self._on_loop():
            # A threads pool's thread: kombu's own pipeline, there (the delivery's step
            # went out on the BRPOP connection as the delivery was read, before the task).
            super().ack(delivery_tag)
            return
        self.riders.append(("ZREM", self.unacked_index_key, delivery_tag))
        self.riders.append(("HDEL", self.unacked_key, delivery_tag))
        redis.virtual.QoS.ack(self, delivery_tag)

    def write_riders(self, connection: Any) -> None:
        """Write the queued steps on ``connection`` (the BRPOP's, idle), replies unread."""
        packed = self.take_riders(connection)
        try:
            connection.send_packed_command([packed])
        except BaseException:
            self.riding = 0
            raise

    def take_riders(self, connection: Any) -> bytes:
        """The queued steps, packed for ``connection`` (the BRPOP's), which now carries them:
        the bytes to write (ahead of its BRPOP, if it sends one), in one piece so that
        they go out in one ``send`` with whatever follows."""
        riders, self.riders = self.riders, []
        if not riders:
            return b""
        self.riding += len(riders)
        self._riding_on = connection._sock
        return b"".join(chunk for command in riders for chunk in connection.pack_command(*command))

    def read_riding(self, connection: Any) -> None:
        """Read the replies of the steps written on ``connection`` (before a BRPOP's own)."""
        if self.riding and connection._sock is not self._riding_on:
            # The connection was lost since: so were the replies, and perhaps the steps (an
            # ack not written is delivered again after the visibility timeout).
            log.warning(
                "the broker connection closed before %d step(s) of its unacked bookkeeping "
                "were confirmed",
                self.riding,
            )
            self.riding = 0
        while self.riding:
            self.riding -= 1
            try:
                connection.read_response()
            except redis.redis.ResponseError as exc:
                log.warning("Redis refused a step of the broker's unacked bookkeeping: %s", exc)
            except BaseException:
                self.riding = 0  # the connection is gone, and the other replies with it
                raise

    def send_riders(self) -> None:
        """Send what did not ride on a BRPOP as one pipeline, as kombu would (after reading
        what the BRPOP's connection carried, when no BRPOP waits on it)."""
        if not self.riders:
            return
        self._read_if_idle()
        riders, self.riders = self.riders, []
        with self.pipe_or_acquire() as pipe:
            for command in riders:
                pipe.execute_command(*command)
            pipe.execute()

    def settle(self) -> None:
        """Every queued step written and every reply read: the hash is up to date. Only on the
        loop's thread, which owns the riders and the BRPOP connection (elsewhere there is
        nothing of this thread's to settle)."""
        if not self._on_loop():
            return
        self._read_if_idle()
        self.send_riders()

    def _read_if_idle(self) -> None:
        # With a BRPOP in flight its reply may come in the same read as theirs, where the
        # loop would never see it: the BRPOP's read takes them first (transport.py).
        if self.riding and not self.channel._in_poll:
            self.read_riding(self.channel.client.connection)

    @contextmanager
    def pipe_or_acquire(self, pipe: Any = None, client: Any = None) -> Iterator[Any]:
        if pipe:
            yield pipe
        else:
            with self.channel.conn_or_acquire(client) as client:
                yield client.pipeline(transaction=False)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        self.settle()
        super().reject(delivery_tag, requeue=requeue)

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        # kombu's restore_by_tag, with the entry checked before it is parsed for good
        # (see the module docstring). Kept in step with kombu 5.7.
        self.settle()
        refused: list[tuple[bytes, str]] = []

        def restore_transaction(pipe: Any) -> None:
            refused.clear()  # redis-py runs this again when the WATCHed hash changed
            raw = pipe.hget(self.unacked_key, tag)
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            if not raw:
                return
            problem = unacked_problem(raw, self.channel.decode_body)
            if problem is not None:
                refused.append((raw, problem))
                return
            envelope, exchange, routing_key = loads(bytes_to_str(raw))
            self.channel._do_restore_message(envelope, exchange, routing_key, pipe, leftmost)

        with self.channel.conn_or_acquire(client) as client:
            client.transaction(restore_transaction, self.unacked_key)
        for raw, problem in refused:
            # After EXEC: only the transaction that removed the entry sets it aside.
            name = bytes_to_str(tag) if isinstance(tag, bytes) else str(tag)
            set_aside(
                raw,
                f"kombu's unacked entry {name[:80]!r} cannot be restored: {problem}; "
                "it was removed from the hash and its index",
                UNACKED_QUEUE,
                self.channel.rejected_store,
            )

    def restore_unacked(self, client: Any = None) -> None:
        self.settle()
        super().restore_unacked(client=client)

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        self.settle()
        try:
            super().restore_visible(*args, **kwargs)
        except redis.redis.ResponseError as exc:
            # A key of the wrong type (`SET unacked_index x`): nothing here can be restored
            # until an operator removes it, but the worker goes on (its next try logs again).
            log.error(
                "kombu's unacked bookkeeping cannot be read (%s); the broker's Redis holds "
                "something else under %s or %s: delete it (messages it held are lost)",
                exc,
                self.unacked_key,
                self.unacked_index_key,
            )


class RidingPoller(redis.MultiChannelPoller):
    """kombu's poller of a transport's channels, which, at each tick of an event loop,
    writes the acks no BRPOP carried on the channel's idle BRPOP connection, and reads
    the replies when they come (see the module docstring)."""

    loop_thread: int | None = None
    """The thread of the event loop the transport is registered with, if any."""

    def on_poll_start(self) -> None:
        super().on_poll_start()
        for channel in self._channels:
            qos = channel.qos
            if not qos.riders:
                continue
            connection = self._idle_brpop_connection(channel)
            if connection is None:
                qos.send_riders()
                continue
            qos.write_riders(connection)

    def _idle_brpop_connection(self, channel: Any) -> Any:
        """The channel's BRPOP connection, if it is polled and has no BRPOP in flight."""
        if channel._in_poll:
            return None
        sock = self._chan_to_sock.get((channel, channel.client, "BRPOP"))
        connection = channel.client.connection
        if sock is None or connection is None or connection._sock is not sock:
            return None
        if sock.fileno() in self._paused_brpop:
            return None
        return connection

    def on_readable(self, fileno: int) -> Any:
        chan_type = self._fd_to_chan.get(fileno)
        if chan_type is not None and fileno not in self._paused_brpop:
            channel, kind = chan_type
            if kind == "BRPOP" and not channel._in_poll and channel.qos.riding:
                # Replies of bookkeeping written with no BRPOP after it.
                connection = channel.client.connection
                try:
                    channel.qos.read_riding(connection)
                except channel.connection_errors:
                    connection.disconnect()
                    raise
                return None
        return super().on_readable(fileno)
