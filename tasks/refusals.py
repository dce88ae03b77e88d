"""A worker's refusals: a message it cannot or must not act on, set aside for an operator.

The store is the broker's own rejected-message store (:mod:`store.rejected`), opened
once per process and broker; setting a message aside never raises: if the store
itself is down, :func:`set_aside` logs the reason at ERROR (the message is then
gone, but not silently).
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store import open_rejected
from store.rejected import Rejected, RejectedStore
from store.rejected.folder import FolderRejected

log = logging.getLogger("ratchet.rejected")

_stores: dict[tuple[int, str, str], RejectedStore] = {}


def store_for_app(app: Any) -> RejectedStore:
    """The store beside the broker ``app`` (a Celery app) uses; one per process and broker.

    Follows the app's own ``broker_url`` (a test or an embedding application may
    change it after the app was built), not the environment.
    """
    url = str(app.conf.broker_url or "")
    folder = str((app.conf.broker_transport_options or {}).get("rejected_folder") or "")
    key = (os.getpid(), url, folder)
    store = _stores.get(key)
    if store is None:
        if url.startswith("filesystem://") and folder:
            store = FolderRejected(Path(folder))
        else:
            from tasks.settings import get_settings

            store = open_rejected(
                url, get_settings().resolved_data_dir, app.conf.broker_transport_options
            )
        _stores[key] = store
    return store


def set_aside(
    raw: bytes, reason: str, queue: str, store: RejectedStore | Callable[[], RejectedStore]
) -> Rejected | None:
    """Keep a refused message and log one WARNING line; never raises. The entry, or None."""
    entry = Rejected.new(raw, " ".join(reason.split()), queue)
    try:
        target = store() if callable(store) else store
        target.add(entry)
    except Exception as exc:  # the store is the last resort: it must not take the worker down
        log.error(
            "%s: message refused (%s) and could not be set aside (%s: %s); %s bytes dropped",
            queue,
            entry.reason,
            type(exc).__name__,
            exc,
            entry.size,
        )
        return None
    log.warning(
        "%s: message refused: %s; set aside as %s (`ratchet rejected show %s`)",
        queue,
        entry.reason,
        entry.id,
        entry.id,
    )
    return entry


def message_bytes(message: Any) -> bytes:
    """A received kombu message as it was on the broker, as far as it can be told.

    The virtual transports (Redis, filesystem) keep the envelope they read; for
    RabbitMQ, the body and its headers and properties are put in the same shape.
    """
    raw = getattr(message, "_raw", None)
    if isinstance(raw, dict):
        return json.dumps(raw, sort_keys=True, default=repr).encode()
    body = message.body
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogateescape")
    envelope = {
        "body": base64.b64encode(body or b"").decode("ascii"),
        "content-encoding": message.content_encoding,
        "content-type": message.content_type,
        "headers": message.headers,
        "properties": {**(message.properties or {}), "body_encoding": "base64"},
    }
    return json.dumps(envelope, sort_keys=True, default=repr).encode()
