"""Rejected messages on a RabbitMQ broker: a durable queue capped at MAX_ENTRIES."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from store.rejected import AMQP_QUEUE, MAX_ENTRIES, Rejected, RejectedStore, read_entries


class AmqpRejected(RejectedStore):
    """A durable RabbitMQ queue; reading it takes every entry and gives them all back."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = f"the RabbitMQ queue {AMQP_QUEUE}"

    def _queue(self) -> Any:
        from kombu import Queue

        return Queue(  # type: ignore[no-untyped-call]
            AMQP_QUEUE,
            durable=True,
            queue_arguments={"x-max-length": MAX_ENTRIES, "x-overflow": "drop-head"},
        )

    def _with_channel(self, fn: Callable[[Any], Any]) -> Any:
        from kombu import Connection

        with Connection(self.url) as connection:  # type: ignore[no-untyped-call]
            channel = connection.channel()
            try:
                bound = self._queue()(channel)
                bound.declare()
                return fn(bound)
            finally:
                # Closing the channel hands every message read but not acknowledged back.
                channel.close()

    def add(self, entry: Rejected) -> None:
        from kombu import Connection

        with Connection(self.url) as connection:  # type: ignore[no-untyped-call]
            producer = connection.Producer()
            producer.publish(
                entry.dumps(),
                exchange="",
                routing_key=AMQP_QUEUE,
                declare=[self._queue()],
                content_type="application/json",
                content_encoding="utf-8",
                delivery_mode=2,
            )

    def list(self, limit: int = 50) -> list[Rejected]:
        def read(queue: Any) -> list[Rejected]:
            entries: list[Rejected] = []
            while True:
                message = queue.get(no_ack=False)
                if message is None:
                    break
                entries.extend(read_entries([message.body]))
            return entries

        entries: list[Rejected] = self._with_channel(read)
        return list(reversed(entries))[:limit]

    def purge(self) -> int:
        return int(self._with_channel(lambda queue: queue.purge() or 0))
