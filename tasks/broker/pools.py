"""An app's broker pools, made once per process, under a lock, before a send uses them."""

from __future__ import annotations

import os
import threading
from typing import Any, Final

_MADE_IN: Final = "_ratchet_pools_made_in"
"""The app attribute naming the process that made its pools."""
_making = threading.Lock()


def pools_made(app: Any) -> Any:
    """``app``, with its connection pool and its producer pool made in this process.

    Celery makes both on first use without a lock (``app.pool``,
    ``app.amqp.producer_pool``), and kombu's registry makes the pool of a broker it
    has none for the same way. Threads sending through an app for the first time at
    once each made a pool, and the pools the app did not keep were dropped with the
    connections their threads had opened: sockets to RabbitMQ left open until the
    garbage collector found them. Made here first, under one lock, every thread gets
    the pool the app keeps. A forked child makes its own (Celery and kombu drop the
    parent's pools at a fork).
    """
    pid = os.getpid()
    if app.__dict__.get(_MADE_IN) != pid:
        with _making:
            if app.__dict__.get(_MADE_IN) != pid:
                app.pool  # noqa: B018  (made on first use: the point)
                app.amqp.producer_pool  # noqa: B018
                app.__dict__[_MADE_IN] = pid
    return app
