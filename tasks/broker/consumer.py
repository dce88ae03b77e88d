"""The worker's Celery consumer (``worker_consumer``), :class:`RatchetConsumer`.

The messages Celery itself refuses before any task runs (a body it cannot decode, a
pickle, a message that is not a task, a task it does not know) are set aside in the
rejected-message store (:mod:`store.rejected`), with one log line instead of a traceback.
The plain-JSON continuations consumer is :mod:`tasks.continuations`.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from celery import signals
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.common import ignore_errors

from store.rejected import RejectedStore
from tasks.refusals import message_bytes, set_aside, store_for_app

log = logging.getLogger("ratchet.continuations")

EVENTS_FLUSH_S = 0.05
"""How long the worker holds its task events before publishing them in one message.

Celery buffers task events (received, started, succeeded…) and publishes the buffer
on the next turn of the event loop: about three ``PUBLISH`` round trips for every
task (measured: 3.1 a turn, the largest share of the broker's commands). Waiting this
long gathers the events of several tasks into one ``task.multi`` message, which
Flower and ``celery events`` read like single events; they see a task at most this
much later. A full buffer (Celery's ``buffer_limit``) is still published at once,
and a stopping worker publishes what it holds first."""


def _why(exc: Exception) -> str:
    """The exception on one line, cut short for the rejected store."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _queue_of(message: Any) -> str:
    return str((message.delivery_info or {}).get("routing_key") or "?")


def task_message_problem(message: Any) -> str | None:
    """Why a protocol-2 task message cannot become a Celery request; None if it can (or if
    Celery's own checks — content type, decoding — should decide)."""
    headers = message.headers
    if not isinstance(headers, dict) or "task" not in headers:
        return None  # not protocol 2: Celery's own path refuses it
    problem = _headers_problem(headers)
    if problem is not None:
        return problem
    if message.errors:
        # kombu decompressed the body as it built the message (bounded: tasks/broker/compression.py).
        return f"its body cannot be read ({_why(message.errors[0][1])})"
    try:
        body = message.decode()
    except Exception:
        return None  # undecodable or not accepted: Celery's on_decode_error / on_invalid_task
    return _body_problem(body)


def _headers_problem(headers: dict[str, Any]) -> str | None:
    if not isinstance(headers.get("task"), str):
        return "the `task` header must be a task name"
    if not isinstance(headers.get("id"), str) or not headers["id"]:
        return "the `id` header must be a non-empty string (the task id)"
    for key in ("eta", "expires"):
        value = headers.get(key)
        if value is not None and not isinstance(value, str | int | float):
            return f"the `{key}` header must be an ISO 8601 time or a number"
        if isinstance(value, str):
            try:
                dt.datetime.fromisoformat(value)
            except ValueError:
                return f"the `{key}` header {value[:40]!r} is not an ISO 8601 time"
    return None


def _body_problem(body: Any) -> str | None:
    if not (isinstance(body, list | tuple) and len(body) == 3):
        return "the body must be a JSON array [args, kwargs, embed] (Celery's protocol 2)"
    args, kwargs, embed = body
    if not isinstance(args, list | tuple):
        return "the body's args must be a JSON array"
    if not isinstance(kwargs, dict):
        return "the body's kwargs must be a JSON object"
    if not isinstance(embed, dict | None):
        return "the body's embed (callbacks, errbacks, chain, chord) must be a JSON object"
    return None


class RatchetConsumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's worker consumer; what it refuses goes to the rejected-message store, in one line."""

    _events_flush_due: float | None = None
    """When the pending delayed flush of task events runs (monotonic); None: none pending."""

    def rejected_store(self) -> RejectedStore:
        return store_for_app(self.app)

    def on_send_event_buffered(self) -> None:
        # Celery's: flush on the loop's next turn (one PUBLISH per task event, nearly).
        # Here: one flush EVENTS_FLUSH_S after the first event buffered since the last.
        if not self.hub:
            return
        now = time.monotonic()
        due = self._events_flush_due
        # A timer lost with the hub (a consumer restart) is never waited for long.
        if due is not None and now < due + EVENTS_FLUSH_S:
            return
        self._events_flush_due = now + EVENTS_FLUSH_S
        self.hub.call_later(EVENTS_FLUSH_S, self._flush_events_later)

    def _flush_events_later(self) -> None:
        self._events_flush_due = None
        self._flush_events()

    def _flush_events_now(self) -> None:
        self._events_flush_due = None
        if self.event_dispatcher:
            ignore_errors(self, self.event_dispatcher.flush)  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        self._flush_events_now()  # before the worker-offline event, not lost with the buffer
        super().stop()

    def shutdown(self) -> None:
        self._flush_events_now()
        super().shutdown()

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().create_task_handler(*args, **kwargs)

        def on_task_received(message: Any) -> Any:
            # Celery turns a task message into a request in this (the consumer's) loop;
            # a body of the wrong shape raised there and ended the worker, and since the
            # message was never acknowledged it came back to end the next one too.
            problem = task_message_problem(message)
            if problem is None:
                try:
                    return handle(message)
                except (ValueError, TypeError, KeyError, AttributeError) as exc:
                    problem = f"Celery cannot read it ({type(exc).__name__}: {exc})"
            self._reject(message, f"not a valid Celery task message: {problem}")
            return None

        return on_task_received

    def _set_aside(self, message: Any, reason: str) -> None:
        """Keep the message's bytes and why in the rejected store (``ratchet rejected``)."""
        set_aside(message_bytes(message), reason, _queue_of(message), self.rejected_store)

    def _reject(self, message: Any, reason: str, exc: Exception | None = None) -> None:
        """Set the message aside and reject it (never redelivered), as Celery's own
        refusals do: logged, with the ``task_rejected`` signal."""
        self._set_aside(message, reason)
        message.reject_log_error(log, self.connection_errors)
        signals.task_rejected.send(sender=self, message=message, exc=exc)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._set_aside(
            message, f"the body cannot be decoded as {message.content_type!r} ({_why(exc)})"
        )
        message.ack()

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self._reject(
            message,
            "not a Celery task message (no `task` header); send tasks with Celery's protocol 2",
        )

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        headers = message.headers or {}
        name = headers.get("task")
        self._set_aside(
            message, f"unknown task {name!r}: this worker runs the ratchet.* tasks only"
        )
        message.reject_log_error(log, self.connection_errors)
        signals.task_unknown.send(
            sender=self, message=message, exc=exc, name=name, id=headers.get("id")
        )

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._reject(message, f"invalid task message ({_why(exc)})", exc)
