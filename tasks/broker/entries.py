# mypy: disable-error-code="attr-defined,no-untyped-call"
# (SafeEntries is a mixin of kombu's virtual channels and uses their attributes; kombu is untyped.)
"""The check ratchet's broker channels make on every queue entry they read.

Kombu's Redis and filesystem transports parse each queue entry (a JSON
envelope: ``body``, ``headers``, ``properties``…) inside the worker's consumer
loop, before Celery or ratchet sees it; one entry that is not an envelope
(``redis-cli LPUSH ratchet.turns garbage``, ``[1,2,3]``, a body that is not
valid base64, a zero-byte file left by a full disk) raises there and the
worker exits with ``Unrecoverable error``. :class:`SafeEntries` checks an entry
where a channel reads it — Redis ``BRPOP``/``RPOP`` (tasks/broker/transport.py), a
``*.msg`` file (tasks/broker/embedded.py) — and hands a bad one to the
rejected-message store (:mod:`store.rejected`) instead, so the channel goes on with
the next entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from store.rejected import MAX_MESSAGE_BYTES, RejectedStore
from tasks.refusals import set_aside


def envelope_problem(payload: Any, decode_body: Any) -> str | None:
    """Why ``payload`` is not an envelope kombu's virtual transports can deliver; None if it is.

    Mirrors what kombu reads from it: ``properties.delivery_tag`` and
    ``properties.delivery_info.{exchange, routing_key}`` (the Redis transport
    keeps them for acks), the optional strings and headers, and a body its
    ``body_encoding`` decodes.
    """
    if not isinstance(payload, dict):
        return f"the entry is a JSON {type(payload).__name__}, not a kombu envelope (an object)"
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        return "the envelope has no `properties` object"
    tag = properties.get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        return "`properties.delivery_tag` must be a non-empty string"
    info = properties.get("delivery_info")
    if not (
        isinstance(info, dict)
        and isinstance(info.get("exchange"), str)
        and isinstance(info.get("routing_key"), str)
    ):
        return "`properties.delivery_info` must be an object with an exchange and a routing_key"
    for key in ("content-type", "content-encoding"):
        if not isinstance(payload.get(key), str | None):
            return f"`{key}` must be a string"
    if not isinstance(payload.get("headers"), dict | None):
        return "`headers` must be an object"
    body, encoding = payload.get("body"), properties.get("body_encoding")
    if not isinstance(body, str | None):
        return "`body` must be a string"
    if not isinstance(encoding, str | None):
        return "`properties.body_encoding` must be a string"
    if body:
        try:
            decode_body(body, encoding)
        except Exception as exc:  # bad base64 (binascii.Error), an unknown codec, …
            return f"the body cannot be decoded as {encoding!r} ({type(exc).__name__}: {exc})"
    return None


class SafeEntries:
    """The check both channels make on an entry they have taken off a queue."""

    decode_body: Callable[..., Any]
    """kombu's virtual.Channel provides it (an annotation only: the mixin must not shadow it)."""

    def rejected_store(self) -> RejectedStore:
        raise NotImplementedError

    def accept_entry(self, raw: bytes | str, queue: str) -> dict[str, Any] | None:
        """The envelope in ``raw``, or None after setting the entry aside with the reason."""
        data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
        problem: str | None
        payload: Any = None
        if len(data) > MAX_MESSAGE_BYTES:
            problem = f"the entry is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit"
        elif not data.strip():
            problem = "the entry is empty (a write that never finished, e.g. on a full disk)"
        else:
            try:
                payload = loads(bytes_to_str(data))
                problem = envelope_problem(payload, self.decode_body)
            except (ValueError, TypeError, RecursionError) as exc:
                problem = f"the entry is not JSON ({type(exc).__name__}: {str(exc)[:200]})"
        if problem is None:
            return payload  # type: ignore[no-any-return]
        set_aside(data, f"not a kombu message: {problem}", queue, self.rejected_store)
        return None
