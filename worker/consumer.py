"""Plain-JSON continuations for producers that do not speak Celery.

A worker consumes the queue ``ratchet.continuations`` (``RATCHET_CONTINUATIONS_QUEUE``)
on its own broker, Redis or RabbitMQ. Each message is a JSON object::

    {"run_id": "…", "input": "…", "continuation_id": "…"}     # a question or a blocker
    {"run_id": "…", "approve": true, "continuation_id": "…"}  # a tool awaiting approval
    {"run_id": "…", "deny": "reason", "continuation_id": "…"}

with an optional ``suspension_seq`` (the suspension it answers). A well-formed
message is handed to ``ratchet.continue`` on the control queue — the one
handler every continuation goes through, with its checks and exactly-once
rules — and then acknowledged. A malformed one (not JSON, not an object, no
``run_id``, a wrong type, an unknown key) is dropped with a logged reason; it
never stops the consumer.

If the worker dies after handing a message on but before acknowledging it,
the broker delivers it again: with a ``continuation_id`` the second copy is a
recognised duplicate; without one, the first answer has already been recorded
and the second is refused as a second answer to the same suspension.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from kombu import Consumer, Queue  # type: ignore[attr-defined]

from runtime.continuation import parse_message
from runtime.errors import MalformedContinuation

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

    def get_consumers(self, channel: Any) -> list[Any]:
        return [
            Consumer(  # type: ignore[no-untyped-call]
                channel,
                queues=[Queue(self.queue_name)],  # type: ignore[no-untyped-call]
                callbacks=[self.on_message],
                accept=["json"],
                on_decode_error=self.on_decode_error,
                prefetch_count=PREFETCH,
            )
        ]

    def on_message(self, body: Any, message: Any) -> None:
        try:
            fields = parse_message(body)
        except MalformedContinuation as exc:
            log.warning("%s: %s; message dropped", self.queue_name, exc)
            message.reject(requeue=False)
            return
        try:
            self.app.send_task("ratchet.continue", kwargs=fields)
        except Exception:
            # The broker refused the hand-over: keep the message for another try.
            log.exception(
                "%s: could not hand run %s's continuation on", self.queue_name, fields.get("run_id")
            )
            message.requeue()
            return
        message.ack()

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        log.warning(
            "%s: continuation message refused: not a JSON message (%s: %s); message dropped",
            self.queue_name,
            type(exc).__name__,
            exc,
        )
        message.reject(requeue=False)
