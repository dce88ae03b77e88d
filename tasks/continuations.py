"""Plain-JSON continuations for producers that do not speak Celery.

A worker consumes the queue ``ratchet.continuations`` (``RATCHET_CONTINUATIONS_QUEUE``)
on its own broker, Redis or RabbitMQ: ratchet's own workers, and those of a team's app
ratchet is installed on (:func:`tasks.install` adds this bootstep). Each message is a
JSON object::

    {"run_id": "…", "input": "…", "continuation_id": "…"}     # a question or a blocker
    {"run_id": "…", "approve": true, "continuation_id": "…"}  # a tool awaiting approval
    {"run_id": "…", "deny": "reason", "continuation_id": "…"}

with an optional ``suspension_seq`` (the suspension it answers). A well-formed
message is handed to ``ratchet.continue`` on the control queue — the one
handler every continuation goes through, with its checks and exactly-once
rules — and then acknowledged. A malformed one (not JSON, not an object, no
``run_id``, a wrong type, an unknown key) is set aside in the rejected-message store
(:mod:`store.rejected`) with a logged reason; it never stops the consumer.

If the worker dies after handing a message on but before acknowledging it,
the broker delivers it again: with a ``continuation_id`` the second copy is a
recognised duplicate; without one, the first answer has already been recorded
and the second is refused as a second answer to the same suspension.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from kombu import Consumer
from kombu.common import ignore_errors

from runtime.continuation import parse_message
from runtime.errors import MalformedContinuation, MessageRefused
from store.rejected import RejectedStore
from tasks.messages import VERSION, decode, send
from tasks.queues import continuations_queue
from tasks.refusals import message_bytes, set_aside, store_for_app

log = logging.getLogger("ratchet.continuations")

PREFETCH = 16
"""Messages fetched ahead: handing one on takes a publish, so a small batch suffices."""


class ContinuationConsumer(bootsteps.ConsumerStep):  # type: ignore[misc]
    """A worker bootstep consuming the plain-JSON continuations queue."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.app = parent.app
        self.queue_name: str = parent.app.conf.get(
            "ratchet_continuations_queue", "ratchet.continuations"
        )
        self.queue_type: str = parent.app.conf.get("ratchet_queue_type") or "classic"

    def get_consumers(self, channel: Any) -> list[Any]:
        return [
            Consumer(  # type: ignore[no-untyped-call]
                channel,
                queues=[continuations_queue(self.queue_name, self.queue_type)],
                callbacks=[self.on_message],
                accept=["json"],
                on_decode_error=self.on_decode_error,
                prefetch_count=PREFETCH,
            )
        ]

    def rejected_store(self) -> RejectedStore:
        return store_for_app(self.app)

    def stop(self, parent: Any) -> None:
        self._close_consumers(parent, cancel=True)

    def shutdown(self, parent: Any) -> None:
        self._close_consumers(parent, cancel=False)

    def _close_consumers(self, parent: Any, cancel: bool) -> None:
        # Celery's ConsumerStep._close passes `parent.connection` to ignore_errors; after a
        # lost connection Celery has already set that to None, so every reconnect logged
        # "Error on restarting ContinuationConsumer: AttributeError(... connection_errors)".
        # The consumer itself carries the connection and channel error classes (Celery's
        # own Tasks step passes it the same way).
        channels = set()
        consumers: list[Any] = getattr(self, "consumers", None) or []
        for consumer in consumers:
            if cancel:
                ignore_errors(parent, consumer.cancel)  # type: ignore[no-untyped-call]
            if consumer.channel:
                channels.add(consumer.channel)
        for channel in channels:
            ignore_errors(parent, channel.close)  # type: ignore[no-untyped-call]
        self.consumers = None

    def on_message(self, body: Any, message: Any) -> None:
        try:
            fields = parse_message(body)
            continuation = decode("ratchet.continue", (), fields, VERSION)
        except (MalformedContinuation, MessageRefused) as exc:
            set_aside(message_bytes(message), str(exc), self.queue_name, self.rejected_store)
            message.reject(requeue=False)
            return
        try:
            send(continuation, app=self.app)
        except Exception:
            # The broker refused the hand-over: keep the message for another try.
            log.exception(
                "%s: could not hand run %s's continuation on", self.queue_name, fields.get("run_id")
            )
            message.requeue()
            return
        message.ack()

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        set_aside(
            message_bytes(message),
            f"continuation message refused: not a JSON message ({type(exc).__name__}: {exc})",
            self.queue_name,
            self.rejected_store,
        )
        message.reject(requeue=False)
