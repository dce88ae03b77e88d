"""Persistence: the SnapshotStore and RunStore contracts and their backends.

Both are opened from a URL, so one setting picks the backend:

=====================  ==========================  ==========================
scheme                 snapshot store              run store
=====================  ==========================  ==========================
``memory://``          MemorySnapshotStore         MemoryRunStore
``file:///dir``        FileSnapshotStore           —
``sqlite:///path``     SqliteSnapshotStore         SqliteRunStore
``redis://`` …         RedisSnapshotStore          RedisRunStore
``s3://bucket/prefix``  S3SnapshotStore (extra s3)   —
=====================  ==========================  ==========================

Redis URLs take every form redis-py does — ``redis://[[user]:password@]host:port/db``,
``rediss://`` (TLS; ``?ssl_cert_reqs=…&ssl_ca_certs=…``), ``unix:///path?db=0`` —
and the keys of both Redis stores start with ``redis_prefix`` (setting
``RATCHET_REDIS_PREFIX``, default ``ratchet``), so several deployments can
share one server.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from store.runs import RunStore
from store.snapshots import SnapshotStore


def _path_of(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{url}: use three slashes for a path (`{parts.scheme}:///abs/path`)")
    return Path(unquote(parts.path))


def open_snapshot_store(
    url: str, *, redis_prefix: str = "ratchet", max_connections: int | None = None
) -> SnapshotStore:
    """Open the snapshot store a URL names; ValueError names the URL and what is accepted.

    ``max_connections``: how many calls this process may make to the store at once
    (a worker passes its slots plus headroom); sizes the connection pool of the
    backends that have one. ImportError for ``s3://`` without the ``s3`` extra says
    what to install.
    """
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        from store.snapshots.memory import MemorySnapshotStore

        return MemorySnapshotStore()
    if scheme == "file":
        from store.snapshots.file import FileSnapshotStore

        return FileSnapshotStore(_path_of(url))
    if scheme == "sqlite":
        from store.snapshots.sqlite import SqliteSnapshotStore

        return SqliteSnapshotStore(_path_of(url))
    if scheme in ("redis", "rediss", "unix"):
        from store.snapshots.redis import RedisSnapshotStore

        return RedisSnapshotStore.from_url(
            url, prefix=redis_prefix, max_connections=max_connections
        )
    if scheme == "s3":
        from store.snapshots.s3 import S3SnapshotStore

        return S3SnapshotStore.from_url(url)
    raise ValueError(
        f"snapshot store URL `{scheme}://…` is not one of memory://, file:///dir, "
        "sqlite:///path, redis://host:port/db, s3://bucket/prefix"
    )


def open_run_store(
    url: str, *, redis_prefix: str = "ratchet", max_connections: int | None = None
) -> RunStore:
    """Open the run store a URL names; ValueError names the URL and what is accepted.

    ``max_connections`` as for :func:`open_snapshot_store`.
    """
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        from store.runs.memory import MemoryRunStore

        return MemoryRunStore()
    if scheme == "sqlite":
        from store.runs.sqlite import SqliteRunStore

        return SqliteRunStore(_path_of(url))
    if scheme in ("redis", "rediss", "unix"):
        from store.runs.redis import RedisRunStore

        return RedisRunStore.from_url(url, prefix=redis_prefix, max_connections=max_connections)
    raise ValueError(
        f"run store URL `{scheme}://…` is not one of memory://, sqlite:///path, redis://host:port/db"
    )


__all__ = ["RunStore", "SnapshotStore", "open_run_store", "open_snapshot_store"]
