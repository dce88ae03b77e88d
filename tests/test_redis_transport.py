"""What ratchet's Redis transport (``ratchet-redis``, tasks/broker/transport.py) says to Redis.

It packs a BRPOP once per order of its queues and writes kombu's unacked bookkeeping
without waiting for it: the commands a real Redis receives (read with MONITOR) are
shown to be kombu's own, less the MULTI/EXEC around each pair — in an event loop
written on the BRPOP's connection, ahead of the next BRPOP or on their own
(tasks/broker/unacked.py) — and a message a consumer never acknowledged still comes back.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kombu
import pytest
import redis
from kombu import Exchange, Queue

from tasks.broker.transport import RatchetConnection, RedisTransport
from tasks.delivery import MAX_PRIORITY
from tests.redis_server import running_redis_server

STEPS = {"priority_steps": list(range(MAX_PRIORITY + 1))}
DONE = "test-monitor-done"
BOOKKEEPING = ("ZADD", "HSET", "ZREM", "HDEL")


class Monitor:
    """The commands Redis received for database ``db`` until :meth:`stop`, as lists."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.db = self.client.connection_pool.connection_kwargs.get("db", 0)
        self.commands: list[list[str]] = []
        self.senders: list[str] = []
        self._monitor = self.client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        for entry in self._monitor.listen():
            words = entry["command"].split(" ")
            if words == ["ECHO", DONE]:
                return
            if int(entry["db"]) == self.db:
                self.commands.append(words)
                self.senders.append(f"{entry['client_address']}:{entry['client_port']}")

    def stop(self) -> list[list[str]]:
        self.client.echo(DONE)
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "MONITOR did not see the last command"
        self._monitor.__exit__(None, None, None)
        self.client.close()
        return self.commands

    def named(self, *names: str) -> list[list[str]]:
        return [c for c in self.commands if c[0].upper() in names]

    def clients(self, *names: str) -> set[str]:
        """The clients (address:port) that sent commands named ``names``."""
        return {
            who for who, c in zip(self.senders, self.commands, strict=True) if c[0].upper() in names
        }


@contextmanager
def monitored(url: str) -> Iterator[Monitor]:
    monitor = Monitor(url)
    try:
        yield monitor
    finally:
        if monitor._thread.is_alive():
            monitor.stop()


def queues(prefix: str) -> list[Any]:
    return [
        Queue(name, Exchange(name, type="direct"), routing_key=name)
        for name in (f"{prefix}.a", f"{prefix}.b")
    ]


def take(connection: Any, wanted: list[Any], count: int, ack: bool = True) -> list[Any]:
    """``count`` messages off ``wanted`` queues, in the order the broker handed them over."""
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        if ack:
            message.ack()

    with connection.Consumer(wanted, callbacks=[on_message], accept=["json"]):
        while len(got) < count:
            connection.drain_events(timeout=10)
    return got


def brpops(url: str, connection: Any, prefix: str) -> list[list[str]]:
    """The BRPOP commands ``connection`` sends to take three messages off two queues."""
    wanted = queues(prefix)
    with connection.Producer() as producer:
        for i in range(3):
            queue = wanted[i % 2]
            producer.publish(
                {"n": i}, exchange=queue.exchange, routing_key=queue.routing_key,
                declare=[queue], priority=i * 3, serializer="json",
            )  # fmt: skip
    with monitored(url) as monitor:
        take(connection, wanted, 3)
        monitor.stop()
    return [c[1:] for c in monitor.named("BRPOP")]


def test_the_brpop_names_the_same_lists_in_the_same_order_as_kombus_own(redis_url: str) -> None:
    # Given a plain kombu connection and a ratchet one, ten priority steps each
    prefix = f"t{uuid.uuid4().hex[:6]}"
    with kombu.Connection(redis_url, transport_options=STEPS) as plain:
        # When each takes three messages off the same two queues (the order rotates)
        expected = brpops(redis_url, plain, prefix)
    with RatchetConnection(redis_url, transport_options=STEPS) as ours:
        assert isinstance(ours.transport, RedisTransport)
        sent = brpops(redis_url, ours, prefix)
    # Then ratchet's BRPOPs are kombu's: every list of both queues, ten steps, same timeout
    assert expected and len(expected[0]) == 2 * (MAX_PRIORITY + 1) + 1
    assert sent == expected


def test_messages_come_highest_priority_first_across_queues_round_after_round(
    redis_url: str,
) -> None:
    prefix = f"t{uuid.uuid4().hex[:6]}"
    wanted = queues(prefix)
    with RatchetConnection(redis_url, transport_options=STEPS) as connection:
        for round_ in range(3):
            # Given messages of steps 9, 5 and 0 on two queues (Redis serves step 0 first)
            with connection.Producer() as producer:
                for step, queue in ((9, wanted[round_ % 2]), (5, wanted[1]), (0, wanted[0])):
                    producer.publish(
                        {"step": step, "round": round_}, exchange=queue.exchange,
                        routing_key=queue.routing_key, declare=[queue], priority=step,
                        serializer="json",
                    )  # fmt: skip
            # When a consumer takes them one at a time (each BRPOP a new order of the queues)
            got = [take(connection, wanted, 1)[0]["step"] for _ in range(3)]
            # Then step 0 comes first, then 5, then 9
            assert got == [0, 5, 9]


def test_a_delivery_and_its_ack_are_two_commands_each_without_multi_exec(redis_url: str) -> None:
    # Given a message on a queue
    prefix = f"t{uuid.uuid4().hex[:6]}"
    wanted = queues(prefix)
    with RatchetConnection(redis_url, transport_options=STEPS) as connection:
        with connection.Producer() as producer:
            producer.publish(
                {"n": 1}, exchange=wanted[0].exchange, routing_key=wanted[0].routing_key,
                declare=[wanted[0]], serializer="json",
            )  # fmt: skip
        client = redis.Redis.from_url(redis_url)
        held: list[Any] = []
        with connection.Consumer(wanted, callbacks=[lambda _b, m: held.append(m)]):
            # When a consumer takes the message, then acknowledges it
            with monitored(redis_url) as monitor:
                connection.drain_events(timeout=10)
                # (while delivered and not acknowledged, kombu holds it)
                assert client.hlen("unacked") == 1 and client.zcard("unacked_index") == 1
                held[0].ack()
                monitor.stop()
        # Once acknowledged, neither holds it
        assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
        client.close()
    # Then Redis got a ZADD and an HSET, a ZREM and an HDEL, and no transaction
    names = [c[0].upper() for c in monitor.commands]
    assert "MULTI" not in names and "EXEC" not in names
    assert [n for n in names if n in ("ZADD", "HSET", "ZREM", "HDEL")] == [
        "ZADD", "HSET", "ZREM", "HDEL",
    ]  # fmt: skip


def test_a_message_never_acknowledged_is_restored_once_past_the_visibility_timeout(
    redis_url: str,
) -> None:
    prefix = f"t{uuid.uuid4().hex[:6]}"
    wanted = queues(prefix)
    options = {**STEPS, "visibility_timeout": 3600}
    client = redis.Redis.from_url(redis_url)
    # Given a message a consumer took and never acknowledged (its process died: the
    # channel is dropped without kombu's restore at shutdown)
    dead = RatchetConnection(redis_url, transport_options=options)
    with dead.Producer() as producer:
        producer.publish(
            {"n": 7}, exchange=wanted[0].exchange, routing_key=wanted[0].routing_key,
            declare=[wanted[0]], serializer="json",
        )  # fmt: skip
    assert take(dead, wanted, 1, ack=False) == [{"n": 7}]
    assert client.llen(wanted[0].name) == 0 and client.hlen("unacked") == 1
    # When its delivery is older than the visibility timeout and another worker looks
    tags: Any = client.zrange("unacked_index", 0, -1)
    tag = tags[0]
    client.zadd("unacked_index", {tag: 1.0})
    with RatchetConnection(redis_url, transport_options=options) as other:
        other.default_channel.qos.restore_visible(interval=1)
        # Then the message is back on its queue, and the other worker takes it
        assert take(other, wanted, 1) == [{"n": 7}]
    assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
    client.close()
    dead.default_channel.qos._delivered.clear()  # nothing of its to restore at close
    dead.release()


class Loop:
    """A kombu event loop (Hub) driving ``connection``, a tick at a time, as a worker's does."""

    def __init__(self, connection: Any, wanted: list[Any], prefetch: int = 0) -> None:
        from kombu.asynchronous import Hub

        self.hub = Hub()
        self.held: list[Any] = []
        connection.register_with_event_loop(self.hub)
        self.consumer = connection.Consumer(
            wanted, callbacks=[lambda _b, m: self.held.append(m)], accept=["json"]
        )
        if prefetch:
            self.consumer.qos(prefetch_count=prefetch)
        self.consumer.consume()
        self.ticks = self.hub.create_loop()

    def tick(self) -> None:
        next(self.ticks)

    def close(self) -> None:
        self.ticks.close()
        self.hub.close()

    def until(self, done: Any, ticks: int = 400) -> None:
        for _ in range(ticks):
            if done():
                return
            self.tick()
        raise AssertionError("the loop never got there")


def publish(connection: Any, queue: Any, *bodies: Any) -> None:
    with connection.Producer() as producer:
        for body in bodies:
            producer.publish(
                body, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue],
                serializer="json",
            )  # fmt: skip


def test_in_an_event_loop_the_bookkeeping_rides_ahead_of_the_next_brpop(redis_url: str) -> None:
    # Given two messages and a consumer in an event loop that acks each as it comes
    wanted = queues(f"t{uuid.uuid4().hex[:6]}")
    client = redis.Redis.from_url(redis_url)
    with RatchetConnection(redis_url, transport_options=STEPS) as connection:
        publish(connection, wanted[0], {"n": 1}, {"n": 2})
        loop = Loop(connection, wanted)
        with monitored(redis_url) as monitor:
            # When the loop takes both and acks them
            def acked_both() -> bool:
                for message in loop.held:
                    if not message.acknowledged:
                        message.ack()
                return len(loop.held) == 2 and len(monitor.named("HDEL")) == 2

            loop.until(acked_both)
            monitor.stop()
        loop.close()
    client.close()
    # Then each delivery's and each ack's commands went out on the BRPOP's connection, in
    # the same write as the next BRPOP and ahead of it, with no pipeline of their own
    steps = [c[0].upper() for c in monitor.commands if c[0].upper() in BOOKKEEPING + ("BRPOP",)]
    assert steps[:1] == ["BRPOP"]
    assert steps[1:] == ["ZADD", "HSET", "ZREM", "HDEL", "BRPOP"] * 2
    assert len(monitor.clients(*BOOKKEEPING, "BRPOP")) == 1


def test_a_delivery_is_written_at_once_even_with_no_brpop_to_carry_it(redis_url: str) -> None:
    # Given a consumer in an event loop that may hold one message at a time
    wanted = queues(f"t{uuid.uuid4().hex[:6]}")
    client = redis.Redis.from_url(redis_url)
    with RatchetConnection(redis_url, transport_options=STEPS) as connection:
        publish(connection, wanted[0], {"n": 1}, {"n": 2})
        loop = Loop(connection, wanted, prefetch=1)
        with monitored(redis_url) as monitor:
            loop.until(lambda: loop.held)
            # When the loop ticks after the delivery (it sends no BRPOP: it holds one)
            loop.until(lambda: client.hlen("unacked") == 1, ticks=3)
            # Then the message is in kombu's unacked hash (a worker dying now gives it
            # back), written on the idle BRPOP connection, with no pipeline waited for
            assert client.zcard("unacked_index") == 1
            # And once acknowledged, the next BRPOP carries the ack and the next message comes
            loop.held[0].ack()
            loop.until(lambda: len(loop.held) == 2)
            loop.until(lambda: client.hlen("unacked") == 1 and len(monitor.named("HDEL")) == 1)
            monitor.stop()
        assert monitor.clients(*BOOKKEEPING) == monitor.clients("BRPOP")
        assert len(monitor.clients("BRPOP")) == 1
        loop.held[1].ack()
        loop.close()
    # And closing the channel writes the ack no BRPOP carried
    assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
    client.close()


def test_a_message_held_at_close_goes_back_on_its_queue_and_an_ack_from_a_thread_is_written(
    redis_url: str,
) -> None:
    wanted = queues(f"t{uuid.uuid4().hex[:6]}")
    client = redis.Redis.from_url(redis_url)
    with RatchetConnection(redis_url, transport_options=STEPS) as connection:
        publish(connection, wanted[0], {"n": 1}, {"n": 2})
        loop = Loop(connection, wanted, prefetch=2)
        # Given two messages delivered, the loop's bookkeeping not yet written
        loop.until(lambda: len(loop.held) == 2)
        assert client.hlen("unacked") == 2
        # When one is acknowledged from another thread (a threads pool's), it is written there
        acking = threading.Thread(target=loop.held[0].ack)
        acking.start()
        acking.join()
        assert client.hget("unacked", loop.held[0].delivery_tag) is None
        loop.close()
    # And when the channel closes holding the other, it is back on its queue, as in kombu
    assert client.llen(wanted[0].name) == 1
    assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
    client.close()


def test_an_ack_that_arrives_after_its_channel_closed_is_kombus_to_handle_not_a_crash(
    redis_url: str,
) -> None:
    # Given a message delivered on a channel that then closes, as a lost broker connection
    # closes it (kombu sets the channel's connection to None), with the task still running
    wanted = queues(f"t{uuid.uuid4().hex[:6]}")
    with RatchetConnection(redis_url, transport_options=STEPS) as connection:
        publish(connection, wanted[0], {"n": 1})
        loop = Loop(connection, wanted, prefetch=1)
        loop.until(lambda: len(loop.held) == 1)
        message = loop.held[0]
        channel = message.channel
        channel.close()
        assert channel.connection is None
        # When the task ends and Celery acknowledges the message (ack_log_error, which
        # logs the connection errors it is told of and lets anything else end the consumer)
        try:
            message.ack()
        except connection.connection_errors:
            pass  # kombu's own answer to an ack on a closed channel: logged, not fatal
        # Then nothing else was raised (a worker's consumer died of "'NoneType' object has no
        # attribute 'cycle'" so, after a broker crash: tests/integration/test_broker_restart.py)
        # And the message the channel held at its close is back on its queue, once
        client = redis.Redis.from_url(redis_url)
        assert client.llen(wanted[0].name) == 1
        client.close()
        loop.close()


def test_a_channel_whose_server_went_away_still_closes(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    wanted = queues(f"t{uuid.uuid4().hex[:6]}")
    with running_redis_server(tmp_path) as server:
        connection = RatchetConnection(server.url, transport_options=STEPS)
        publish(connection, wanted[0], {"n": 1})
        loop = Loop(connection, wanted)
        # Given a delivery acknowledged in the loop, its bookkeeping not yet written
        loop.until(lambda: loop.held)
        loop.held[0].ack()
        # When the server dies and the connection is closed (as Celery does when it reconnects)
        server.kill()
        with caplog.at_level(logging.WARNING, logger="ratchet.transport"):
            loop.close()
            connection.release()
    # Then the close goes through, saying what was not written
    assert "unacked bookkeeping was not written at close" in caplog.text
