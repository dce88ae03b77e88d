"""Persistence: the SnapshotStore and RunStore contracts and their backends.

Both are opened from a URL, so one setting picks the backend:

=====================  ==========================  ==========================
scheme                 snapshot store              run store
=====================  ==========================  ==========================
``memory://``          MemorySnapshotStore         MemoryRunStore
``file:///dir``        FileSnapshotStore           —
``sqlite:///path``     SqliteSnapshotStore         SqliteRunStore
``redis://`` …         RedisSnapshotStore          RedisRunStore
``redis+cluster://`` …  RedisSnapshotStore          RedisRunStore
``s3://bucket/prefix``  S3SnapshotStore (extra s3)   —
=====================  ==========================  ==========================

Redis URLs take every form redis-py does — ``redis://[[user]:password@]host:port/db``,
``rediss://`` (TLS; ``?ssl_cert_reqs=…&ssl_ca_certs=…``), ``unix:///path?db=0`` —
or name a primary behind Sentinel, ``redis+sentinel://host:port,host:port/service/db``
(:mod:`store.sentinel`), each with ``?min_replicas=N&replica_timeout_ms=T`` if a
non-idempotent call must wait for replicas (:mod:`store.replicas`), or a Redis Cluster,
``redis+cluster://host:port,host:port[?shards=64]`` (``rediss+cluster://`` for TLS;
:mod:`store.redis_cluster`, whose keys are spread over hash-tagged shards,
:mod:`store.keyspace`) — and the keys of both Redis stores start with
``redis_prefix`` (setting ``RATCHET_REDIS_PREFIX``, default ``ratchet``), so
several deployments can share one server. The limit store and the live streams are
on the run store's Redis, cluster or not.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from runtime.errors import RatchetError, StoreUrlInvalid
from store.limits import LimitStore
from store.rejected import RejectedStore, rejected_folder
from store.runs import RunStore
from store.snapshots import SnapshotStore


def _path_of(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise StoreUrlInvalid(url, f"use three slashes for a path (`{parts.scheme}:///abs/path`)")
    return Path(unquote(parts.path))


@contextmanager
def _opening(url: str) -> Iterator[None]:
    """A backend's ValueError about its URL (a database number, a key prefix) as StoreUrlInvalid."""
    try:
        yield
    except StoreUrlInvalid:
        raise
    except ValueError as exc:
        raise StoreUrlInvalid(url, str(exc)) from exc


_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster", "rediss+cluster")
_FORMS = {
    "memory": "memory://",
    "file": "file:///dir",
    "sqlite": "sqlite:///path",
    "redis": "redis://host:port/db",
    "s3": "s3://bucket/prefix",
}
"""How a store URL of each scheme is written (the redis form stands for all six)."""
_SNAPSHOT_STORES = {
    "memory": "store.snapshots.memory:MemorySnapshotStore",
    "file": "store.snapshots.file:FileSnapshotStore",
    "sqlite": "store.snapshots.sqlite:SqliteSnapshotStore",
    "redis": "store.snapshots.redis:RedisSnapshotStore",
    "s3": "store.snapshots.s3:S3SnapshotStore",
}
_RUN_STORES = {
    "memory": "store.runs.memory:MemoryRunStore",
    "sqlite": "store.runs.sqlite:SqliteRunStore",
    "redis": "store.runs.redis:RedisRunStore",
}


def _open(
    kind: str, backends: dict[str, str], url: str, redis_prefix: str, max_connections: int | None
) -> Any:
    """The backend of ``backends`` for ``url``'s scheme, imported only now (a backend's
    client library costs only the processes that use it), opened on ``url``."""
    scheme = urlsplit(url).scheme
    family = "redis" if scheme in _REDIS_SCHEMES else scheme
    if family not in backends:
        accepted = ", ".join(_FORMS[name] for name in backends)
        raise StoreUrlInvalid(url, f"a {kind} URL `{scheme}://…` is not one of {accepted}")
    module, _, name = backends[family].partition(":")
    backend = getattr(importlib.import_module(module), name)
    if family == "memory":
        return backend()
    if family in ("file", "sqlite"):
        return backend(_path_of(url))
    with _opening(url):
        if family == "s3":
            return backend.from_url(url)
        return backend.from_url(url, prefix=redis_prefix, max_connections=max_connections)


def open_snapshot_store(
    url: str, *, redis_prefix: str = "ratchet", max_connections: int | None = None
) -> SnapshotStore:
    """Open the snapshot store a URL names; StoreUrlInvalid names the URL and what is accepted.

    ``max_connections``: how many calls this process may make to the store at once
    (a worker passes its slots plus headroom); sizes the connection pool of the
    backends that have one. ImportError for ``s3://`` without the ``s3`` extra says
    what to install.
    """
    store: SnapshotStore = _open(
        "snapshot store", _SNAPSHOT_STORES, url, redis_prefix, max_connections
    )
    return store


def open_run_store(
    url: str, *, redis_prefix: str = "ratchet", max_connections: int | None = None
) -> RunStore:
    """Open the run store a URL names; StoreUrlInvalid names the URL and what is accepted.

    ``max_connections`` as for :func:`open_snapshot_store`.
    """
    store: RunStore = _open("run store", _RUN_STORES, url, redis_prefix, max_connections)
    return store


def open_limit_store(runs: Any, redis_prefix: str = "ratchet") -> LimitStore:
    """The limit store beside run store ``runs``: its Redis (or cluster: a limit's keys share
    one hash tag, and each script decides for one limit), a SQLite file beside it, or memory."""
    import sys

    # Looked up, not imported: a run store of a backend never imported is not of it, and
    # importing redis-py costs what the embedded default should not pay (and more, with
    # opentelemetry installed, which redis-py then loads).
    redis_backend = sys.modules.get("store.runs.redis")
    sqlite_backend = sys.modules.get("store.runs.sqlite")
    if redis_backend is not None and isinstance(runs, redis_backend.RedisRunStore):
        from store.limits.redis import RedisLimitStore

        return RedisLimitStore(runs._client, redis_prefix)
    if sqlite_backend is not None and isinstance(runs, sqlite_backend.SqliteRunStore):
        from store.limits.sqlite import SqliteLimitStore

        path = Path(runs.path)
        return SqliteLimitStore(path.with_name(path.stem + ".limits.sqlite3"))
    from store.limits.memory import MemoryLimitStore

    return MemoryLimitStore()


_REJECTED_STORES = {
    "redis": "store.rejected.redis:RedisRejected",
    "amqp": "store.rejected.amqp:AmqpRejected",
    "folder": "store.rejected.folder:FolderRejected",
}


def _rejected(kind: str) -> Any:
    """The rejected-message store class of ``kind``, imported only now."""
    module, _, name = _REJECTED_STORES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def open_rejected(
    broker_url: str, data_dir: Path, transport_options: dict[str, Any] | None = None
) -> RejectedStore:
    """The rejected-message store beside the broker at ``broker_url`` (``transport_options``:
    the app's, which name the service of kombu's ``sentinel://`` form)."""
    store: RejectedStore
    if broker_url.startswith(("redis://", "rediss://", "unix://")):
        import redis

        store = _rejected("redis")(redis.Redis.from_url(broker_url), owned=True)
    elif broker_url.startswith(("redis+sentinel://", "sentinel://")):
        from store.sentinel import SentinelUrl, is_sentinel
        from store.snapshots.redis import connect

        if is_sentinel(broker_url):
            parsed = SentinelUrl.parse(broker_url)
        else:
            parsed = SentinelUrl.from_kombu(broker_url, transport_options or {})
        store = _rejected("redis")(connect(parsed.url(), max_connections=2), owned=True)
    elif broker_url.startswith(("amqp://", "amqps://", "pyamqp://")):
        store = _rejected("amqp")(broker_url)
    elif broker_url.startswith("filesystem://"):
        store = _rejected("folder")(rejected_folder(data_dir))
    else:
        raise RatchetError(
            f"no rejected-message store for the broker {broker_url.split('://', 1)[0]}://; "
            "ratchet keeps refused messages on Redis, RabbitMQ and filesystem:// brokers"
        )
    return store


__all__ = [
    "LimitStore",
    "RunStore",
    "SnapshotStore",
    "open_limit_store",
    "open_rejected",
    "open_run_store",
    "open_snapshot_store",
]
