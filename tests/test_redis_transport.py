"""What ratchet's Redis transport (``ratchet-redis``, worker/transport.py) says to Redis.

It packs a BRPOP once per order of its queues and keeps kombu's unacked bookkeeping
in plain pipelines: the commands a real Redis receives (read with MONITOR) are shown
to be kombu's own, less the MULTI/EXEC around each pair, and a message a consumer
never acknowledged still comes back.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kombu
import redis
from kombu import Exchange, Queue

from worker.priorities import MAX_PRIORITY
from worker.transport import RatchetConnection, RedisTransport

STEPS = {"priority_steps": list(range(MAX_PRIORITY + 1))}
DONE = "test-monitor-done"


class Monitor:
    """The commands Redis received for database ``db`` until :meth:`stop`, as lists."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.db = self.client.connection_pool.connection_kwargs.get("db", 0)
        self.commands: list[list[str]] = []
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

    def stop(self) -> list[list[str]]:
        self.client.echo(DONE)
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "MONITOR did not see the last command"
        self._monitor.__exit__(None, None, None)
        self.client.close()
        return self.commands

    def named(self, *names: str) -> list[list[str]]:
        return [c for c in self.commands if c[0].upper() in names]


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
