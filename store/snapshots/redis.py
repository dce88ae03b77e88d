"""Snapshots in Redis: one hash per run, written by a compare-and-set script.

Key layout (``prefix`` defaults to ``ratchet``)::

    {prefix}:run:{<run_id>}:snapshot   hash  seq -> stored seq, doc -> the JSON document
    {prefix}:snapshots                 set   ids of the runs that have a snapshot

The ``{<run_id>}`` hash tag puts every key of a run, in this store and in
:mod:`store.runs.redis`, in one Cluster slot. The compare-and-set runs
server-side in one Lua script, so two workers racing on a run cannot both
win, and a document is replaced whole or not at all.

The client is fork-safe: redis-py's connection pool notices a changed pid and
opens new sockets in the child, so Celery's prefork pool may inherit a store.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from runtime.errors import StaleWrite, StoreError, StoreUnavailable
from runtime.models import RunState
from store.snapshots import SnapshotStore

SOCKET_TIMEOUT_S = 5.0
"""Longest wait for one reply; a 16 MiB document crosses a LAN well within it."""
HEALTH_CHECK_INTERVAL_S = 15
"""A pooled connection idle this long is PINGed before use (it may have died in a failover)."""

# KEYS[1] the run's snapshot hash, KEYS[2] the index set.
# ARGV: expected seq ("" for none stored), new seq, document, run id.
# Returns nil when written, else {found seq or ""}.
# The index set is in another slot than the run's hash: on Redis Cluster the
# SADD would move out of the script into a second call (list() only reads it).
_PUT = """
local found = redis.call('HGET', KEYS[1], 'seq') or ''
if found ~= ARGV[1] then
  return {found}
end
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'doc', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return nil
"""

TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError (a restarted server)
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a primary demoted to replica by a failover
)


def connect(url: str) -> redis.Redis:
    """A client with the timeouts every ratchet Redis store uses.

    redis-py's own retries are off: ``store.retry`` is the one retry policy, so
    a dead server costs its bounded ~2 s, not redis-py's ten backoffs on top.
    """
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(NoBackoff(), 0),
        client_name="ratchet",
    )


@contextmanager
def translated(store: str) -> Iterator[None]:
    """Turn redis-py errors into the store errors the contract promises."""
    try:
        yield
    except TRANSIENT_ERRORS as exc:
        raise StoreUnavailable(store, str(exc) or type(exc).__name__) from exc
    except redis.exceptions.RedisError as exc:
        raise StoreError(
            f"{store} refused a command: {exc}; check the server's logs and its maxmemory setting"
        ) from exc


def where(url: str) -> str:
    """The URL without its password, fit for an error message."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    query = "&".join(q for q in parts.query.split("&") if not q.startswith("password="))
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


class RedisSnapshotStore(SnapshotStore):
    name = "redis snapshot store"

    def __init__(self, client: redis.Redis, prefix: str = "ratchet", url: str = "redis") -> None:
        self._client = client
        self._prefix = prefix
        self._where = f"snapshot store {where(url)}"
        self._index = f"{prefix}:snapshots"
        self._put_script = client.register_script(_PUT)

    @classmethod
    def from_url(cls, url: str, prefix: str = "ratchet") -> RedisSnapshotStore:
        """Open ``redis://host:port/db`` (or ``rediss://``, ``unix://``); connects lazily."""
        return cls(connect(url), prefix, url)

    def _key(self, run_id: str) -> str:
        return f"{self._prefix}:run:{{{run_id}}}:snapshot"

    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        expected = "" if expected_seq is None else str(expected_seq)
        with translated(self._where):
            refused = cast(
                "list[bytes] | None",
                self._put_script(
                    keys=[self._key(run_id), self._index],
                    args=[expected, str(state.seq), data, run_id],
                ),
            )
        if refused is not None:
            found = refused[0].decode()
            raise StaleWrite(run_id, expected_seq, int(found) if found else None)

    def _get(self, run_id: str) -> bytes | None:
        with translated(self._where):
            return cast("bytes | None", self._client.hget(self._key(run_id), "doc"))

    def _delete(self, run_id: str) -> None:
        with translated(self._where):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._key(run_id))
            pipe.srem(self._index, run_id)
            pipe.execute()

    def _list(self) -> list[str]:
        with translated(self._where):
            members = cast("set[bytes]", self._client.smembers(self._index))
        return [m.decode() for m in members]

    def close(self) -> None:
        with translated(self._where):
            self._client.connection_pool.disconnect()
