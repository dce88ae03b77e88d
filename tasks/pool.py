"""What the worker's pool lets one process do at once, and the resources sized from it.

A prefork or solo process runs one turn at a time; a threads, gevent or eventlet
worker runs ``--concurrency`` turns in its one process. Every per-process
resource a turn uses at the same time as the others — the Redis stores'
connection pools, the OpenAI-compatible provider's HTTP client — is sized from
that number, never from a library's default (redis-py fails at once past 100
connections; httpx waits for one of 100).

``worker_init`` records the worker; the stores are opened later, lazily, at the
first task (tasks.context), and read :func:`connections_per_process` then. A
process that is not a worker (the CLI, an application calling the API) keeps
the defaults: pools that block for a free connection rather than fail.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery.signals import worker_init, worker_ready

log = logging.getLogger("ratchet.pool")

HEADROOM = 8
"""Connections beyond one per slot: the heartbeat, the continuation consumer, sweeps, the API."""
ONE_AT_A_TIME_POOLS = ("prefork", "solo")
"""Pools whose processes each run one task at a time."""
GREEN_POOLS = ("gevent", "eventlet")
"""Pools that only work once the standard library is monkey-patched."""

_slots: int | None = None


def slots_for(pool: str, concurrency: Any) -> int | None:
    """Turns one process of this pool runs at once; None if the concurrency is not known yet."""
    if pool in ONE_AT_A_TIME_POOLS:
        return 1
    return concurrency if isinstance(concurrency, int) and concurrency > 0 else None


def slots_per_process() -> int | None:
    """Turns this process runs at once, if it is a worker whose pool said so."""
    return _slots


def connections_per_process() -> int | None:
    """What to size this process's store and HTTP pools to: a slot each plus headroom."""
    return None if _slots is None else _slots + HEADROOM


def configure(slots: int) -> None:
    """Size this process's pools for ``slots`` turns at once (a worker does it at start)."""
    global _slots
    from runtime_io.providers import http

    _slots = slots
    http.size_http_pool(slots + HEADROOM)
    log.info("sized for %d turns at once per process (%d connections)", slots, slots + HEADROOM)


def green_pool_problem(pool: str) -> str | None:
    """Why a gevent/eventlet worker must not start: its sockets are not cooperative."""
    if pool != "gevent":
        return None
    from gevent import monkey

    if monkey.is_module_patched("socket") and monkey.is_module_patched("threading"):
        return None
    return (
        "ratchet: refusing to start: the gevent pool is selected but the standard library "
        "is not monkey-patched, so every Redis and HTTP call would block all turns; pass "
        "the pool on the command line (`celery -A worker worker -P gevent`), which patches "
        "before anything is imported"
    )


def pool_name(pool_cls: Any) -> str:
    """``prefork``, ``threads``, ``solo``, … from a name or a pool class."""
    if isinstance(pool_cls, str):
        return pool_cls
    module = getattr(pool_cls, "__module__", "")
    return {"thread": "threads", "asynpool": "prefork"}.get(
        module.rsplit(".", 1)[-1], module.rsplit(".", 1)[-1]
    )


def size_broker_pool(conf: Any, slots: int) -> None:
    """Let a Redis broker's channel open a connection per slot (kombu's default is 10).

    A threads or gevent worker acknowledges each turn (``acks_late``) from the
    slot that ran it, so hundreds of acks can be in flight at once; past the
    channel's pool kombu fails them with MaxConnectionsError ("Couldn't ack") and
    the message is delivered again after the visibility timeout. An operator's own
    ``max_connections`` transport option is kept.
    """
    broker_url = str(conf.broker_url or "")
    if slots <= 1 or not broker_url.startswith(("redis", "rediss", "sentinel")):
        return
    options = dict(conf.broker_transport_options or {})
    options.setdefault("max_connections", slots + HEADROOM)
    conf.broker_transport_options = options


def _configure_from(worker: Any) -> bool:
    pool = pool_name(getattr(worker, "pool_cls", "prefork"))
    slots = slots_for(pool, getattr(worker, "concurrency", None))
    if slots is None:
        return False
    configure(slots)
    app = getattr(worker, "app", None)
    if app is not None:
        size_broker_pool(app.conf, slots)
    return True


@worker_init.connect
def _size_at_worker_start(sender: Any = None, **_: Any) -> None:
    pool = pool_name(getattr(sender, "pool_cls", "prefork"))
    problem = green_pool_problem(pool)
    if problem is not None:
        # SystemExit passes through Celery's signal dispatch (it catches Exception only).
        print(problem, file=sys.stderr, flush=True)
        raise SystemExit(2)
    global _pending
    _pending = None if _configure_from(sender) else sender


_pending: Any = None
"""A worker whose concurrency was ``auto`` at worker_init (Celery resolves it afterwards)."""


@worker_ready.connect
def _size_when_ready(**_: Any) -> None:
    # Only a threads/gevent worker can still be pending, and it runs its turns in this
    # process, so sizing here (before the first message is consumed) is in time.
    if _pending is not None:
        _configure_from(_pending)
