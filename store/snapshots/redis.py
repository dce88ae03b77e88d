"""Snapshots in Redis: a head per run plus its transcript, appended by a compare-and-set script.

Key layout (``prefix`` defaults to ``ratchet``, setting ``RATCHET_REDIS_PREFIX``)::

    {prefix}:run:{<run_id>}:snapshot    hash  seq    stored seq
                                              head   the document with an empty transcript
                                              n, size, chain   the transcript's tip
                                              (or doc: a whole document, see below)
    {prefix}:run:{<run_id>}:transcript  list  one fragment per message, in order
    {prefix}:snapshots                  set   ids of the runs that have a snapshot
    {prefix}:quarantine:{<run_id>}:<UTC time>:snapshot / :transcript
                                        an unusable snapshot moved aside, kept for a person

On Redis Cluster (``redis+cluster://``, :mod:`store.redis_cluster`) the same keys are
kept once per shard, ``{prefix}`` standing for the shard's ``{<prefix>:<n>}``
(:mod:`store.keyspace`): a run's keys and its entry in the index share one slot.

A save sends the head and only the messages added since the stored seq, so
the bytes a checkpoint writes stay flat however long the transcript grows;
``load_document`` joins them back into the document, byte-identical to
:func:`store.snapshots.format.encode`. Heads and fragments are zlib-packed
(:mod:`store.packing`). A document written whole (``doc``: by the previous
layout, or by a test standing in for a bad writer) is read as it is and
replaced whole by the next save.

The ``{<run_id>}`` hash tag puts every key of a run, in this store and in
:mod:`store.runs.redis`, in one Cluster slot. The compare-and-set (seq, and
for an append the stored transcript's length and hash chain) and the writes
run server-side in one Lua script, so two workers racing on a run cannot both
win, and a snapshot is replaced whole or not at all.

The client is fork-safe: redis-py's connection pool notices a changed pid and
opens new sockets in the child, so Celery's prefork pool may inherit a store.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from queue import Empty, LifoQueue
from typing import Any, cast
from urllib.parse import urlsplit

import redis
from hiredis import pack_command
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from runtime.errors import (
    SnapshotMalformed,
    StaleWrite,
    StoreBusy,
    StoreError,
    StoreUnavailable,
)
from runtime.models import RunState
from store.cluster_url import ClusterUrl, is_cluster
from store.keyspace import Keyspace, Shard
from store.packing import pack, unpack
from store.redis_cluster import refresh_layout
from store.redis_connection import connection_class
from store.replicas import split_replica_wait
from store.sentinel import SentinelUrl, is_sentinel
from store.snapshots import Parts, Prefetched, SnapshotStore, TranscriptMoved, TranscriptTip
from store.snapshots import format as snapshot_format

SOCKET_TIMEOUT_S = 5.0
"""Longest wait for one reply; a 16 MiB document crosses a LAN well within it."""
HEALTH_CHECK_INTERVAL_S = 15
"""A pooled connection idle this long is PINGed before use (it may have died in a failover)."""
DEFAULT_MAX_CONNECTIONS = 100
"""Connections one store opens at most when its opener did not size it (redis-py's own default).
A worker sizes its stores from its pool's concurrency instead (tasks.pool)."""
POOL_WAIT_S = 2 * SOCKET_TIMEOUT_S
"""How long a call waits for a free pooled connection before StoreBusy. Longer than any one
reply may take, so a wait this long means the pool is too small, not briefly full."""

CLUSTER_RETRIES = 3
"""Attempts a cluster client makes past the first when a node fails or a slot moved."""

DEFAULT_PREFIX = "ratchet"
PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def lua(package: str, name: str) -> str:
    """The source of a Lua script kept beside its backend, in ``<package>/lua/<name>``.

    Read once, when the backend's module is imported; redis-py sends it by SHA
    (EVALSHA) and loads it into a server that does not know it yet.
    """
    return resources.files(package).joinpath("lua", name).read_text(encoding="utf-8")


def run_script(script: Script, keys: Sequence[str], args: Sequence[str | bytes]) -> Any:
    """``script(keys=keys, args=args)`` on the client it was registered with, one EVALSHA.

    What redis-py's ``Script.__call__`` sends, without its per-call preamble (copying
    the arguments, an isinstance check against a typing Protocol, an import), which
    was a few microseconds of every transition. A server that does not know the
    script yet gets it through ``Script.__call__``, which loads it.
    """
    client: Any = script.registered_client
    try:
        if type(client) is redis.Redis and client.connection is None:
            packed = _packed_evalsha(script.sha, keys, args)
            if packed is not None:
                return _send(client.connection_pool, packed)
        return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        return script(keys=keys, args=args)


def _packed_evalsha(sha: str, keys: Sequence[str], args: Sequence[str | bytes]) -> Any:
    """The EVALSHA as redis-py would put it on the wire, packed by hiredis in one C call
    (redis-py encodes each argument in Python first: a transition has twenty); None for
    what hiredis will not pack, which redis-py then packs, or refuses saying why."""
    command: Any = (b"EVALSHA", sha, len(keys), *keys, *args)  # hiredis's stub says 1-tuple
    try:
        return [pack_command(command)]
    except (TypeError, UnicodeEncodeError):
        return None


def _send(pool: Any, packed: list[bytes]) -> Any:
    """One packed command on a connection of ``pool``, and its answer: what
    ``Redis.execute_command`` does for ``connect``'s client (no retries of its own; a
    connection that fails on its socket drops itself, and redis-py's error is raised),
    less its per-command wrapping (the retry call, redis-py's own OpenTelemetry
    records). EVALSHA has no response callback to apply."""
    answer = _send_all(pool, packed, 1)[0]
    if isinstance(answer, Exception):
        raise answer
    return answer


def run_script_pair(
    first: tuple[Script, Sequence[str], Sequence[str | bytes]],
    second: tuple[Script, Sequence[str], Sequence[str | bytes]],
) -> list[Any]:
    """Two scripts of one client, one after the other on one connection, in one round trip:
    both answers, each as it came or the ResponseError it was (not raised: the second runs
    whatever the first answered). Both must be safe to run again: a server that does not
    know either yet is given both, and both are sent again."""
    client: Any = first[0].registered_client
    packed = [
        _packed_evalsha(script.sha, keys, args) if type(client) is redis.Redis else None
        for script, keys, args in (first, second)
    ]
    if client.connection is not None or packed[0] is None or packed[1] is None:
        answers = []
        for script, keys, args in (first, second):
            try:
                answers.append(run_script(script, keys, args))
            except redis.exceptions.ResponseError as exc:
                answers.append(exc)
        return answers
    answers = _send_all(client.connection_pool, [*packed[0], *packed[1]], 2)
    if any(isinstance(answer, redis.exceptions.NoScriptError) for answer in answers):
        for script, _, _ in (first, second):
            client.script_load(script.script)
        answers = _send_all(client.connection_pool, [*packed[0], *packed[1]], 2)
    return answers


def _send_all(pool: Any, packed: list[bytes], count: int) -> list[Any]:
    """:func:`_send` for ``count`` packed commands: every answer read, an error one as the
    ResponseError it is (the connection stays in step with its replies)."""
    connection = pool.get_connection()
    try:
        connection.send_packed_command(packed)
        answers: list[Any] = []
        for _ in range(count):
            try:
                answers.append(connection.read_response())
            except redis.exceptions.ResponseError as exc:
                answers.append(exc)
        return answers
    finally:
        pool.release(connection)


def run_scripts(script: Script, calls: Sequence[tuple[Sequence[str], Sequence[str]]]) -> list[Any]:
    """``script`` once per ``(keys, args)``, pipelined (a cluster pipeline sends each node
    its share); the answers in order. A node that does not know the script yet is given
    it, and only the calls it refused are sent again."""
    client: Any = script.registered_client

    def send(batch: Sequence[tuple[Sequence[str], Sequence[str]]]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for keys, args in batch:
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return cast("list[Any]", pipe.execute(raise_on_error=False))

    found = send(calls)
    missing = [
        i for i, answer in enumerate(found) if isinstance(answer, redis.exceptions.NoScriptError)
    ]
    if missing:
        client.script_load(script.script)
        for i, answer in zip(missing, send([calls[i] for i in missing]), strict=True):
            found[i] = answer
    for answer in found:
        if isinstance(answer, Exception):
            raise answer
    return found


_PUT = lua(__package__ or "store.snapshots", "put.lua")
_PUT_PARTS = lua(__package__ or "store.snapshots", "put_parts.lua")
_QUARANTINE = lua(__package__ or "store.snapshots", "quarantine.lua")

TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError (a restarted server)
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a primary demoted to replica by a failover
    # A cluster's: no node answered (the client's own retries and slot refreshes
    # exhausted), a slot with no primary yet, CLUSTERDOWN or TRYAGAIN while a primary
    # fails over. None of them is an answer to the command: what it did is unknown or
    # nothing, as with a connection lost, and the fences make a write tried again safe.
    redis.exceptions.RedisClusterUnreachableError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
)


class PoolExhausted(redis.exceptions.ConnectionError):
    """No pooled connection came free within the pool's wait (translated to StoreBusy)."""

    def __init__(self, max_connections: int, waited_s: float) -> None:
        super().__init__(f"all {max_connections} pooled connections busy for {waited_s:g} s")
        self.max_connections, self.waited_s = max_connections, waited_s


class _WaitingQueue(LifoQueue[Any]):
    """The free-connection queue of a BlockingConnectionPool, saying why a wait ended.

    redis-py turns the timeout into a bare ``ConnectionError("No connection
    available.")``, which reads like a dead server; this says the pool was full.
    """

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        try:
            return super().get(block, timeout)
        except Empty:
            if not block:
                raise
            raise PoolExhausted(self.maxsize, timeout or 0.0) from None


class _Cluster(redis.cluster.RedisCluster):
    """redis-py's cluster client, knowing the URL it was opened from (its keyspace's
    identity and shard count)."""

    def __init__(self, url: ClusterUrl, **kwargs: Any) -> None:
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in url.nodes]  # type: ignore[no-untyped-call]
        super().__init__(startup_nodes=nodes, **kwargs)
        self.url = url


class _BlockingSentinelPool(redis.sentinel.SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's pool of connections to the primary a Sentinel names, blocking when full
    as :func:`connect`'s pool does: each connection asks the sentinels for the primary's
    address when it connects, so one made after a failover reaches the promoted replica."""

    def __init__(self, url: SentinelUrl, sentinel: redis.sentinel.Sentinel, **kwargs: Any) -> None:
        super().__init__(url.service, sentinel, **kwargs)  # type: ignore[no-untyped-call]
        self.url = url


def connect(url: str, max_connections: int | None = None) -> Any:
    """A client with the timeouts every ratchet Redis store uses.

    redis-py's own retries are off: ``store.retry`` is the one retry policy, so
    a dead server costs its bounded ~2 s, not redis-py's ten backoffs on top.

    The pool holds at most ``max_connections`` (default DEFAULT_MAX_CONNECTIONS;
    ``?max_connections=N`` in the URL wins) and *blocks*: a call that finds every
    connection in use waits up to POOL_WAIT_S for one, then raises StoreBusy.
    redis-py's default pool instead fails at once past 100 connections, which a
    threads or gevent worker with hundreds of slots turns into a burst of errors.

    ``redis+sentinel://`` URLs (:mod:`store.sentinel`) get the same pool of connections
    to whichever server the sentinels name as the primary. ``redis+cluster://`` URLs
    (:mod:`store.redis_cluster`) get a ``RedisCluster`` with such a pool per node; it asks
    the nodes for the cluster's layout now (StoreUnavailable when none answers).
    ``min_replicas`` and ``replica_timeout_ms`` are ratchet's (store/replicas.py): redis-py
    never sees them.
    """
    url, _ = split_replica_wait(url)
    options: dict[str, Any] = {
        "max_connections": max_connections or DEFAULT_MAX_CONNECTIONS,
        "timeout": POOL_WAIT_S,
        "queue_class": _WaitingQueue,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SOCKET_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "retry": Retry(NoBackoff(), 0),
        "client_name": "ratchet",
    }
    if is_cluster(url):
        cluster = ClusterUrl.parse(url)
        # A few retries of its own: redis-py re-learns the layout between them, which is
        # what carries a call across a failover or a moved slot (store.retry then sees
        # only what outlasts that).
        options["retry"] = Retry(ExponentialBackoff(cap=0.5, base=0.05), CLUSTER_RETRIES)
        with translated(f"store {where(url)}"):
            return _Cluster(
                cluster,
                connection_pool_class=redis.BlockingConnectionPool,
                **options,
                **cluster.client_kwargs(),
            )
    if is_sentinel(url):
        parsed = SentinelUrl.parse(url)
        sentinel = redis.sentinel.Sentinel(
            parsed.sentinels,
            sentinel_kwargs=parsed.sentinel_kwargs(
                socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
            ),
        )
        pool: redis.ConnectionPool = _BlockingSentinelPool(
            parsed, sentinel, **options, **parsed.primary_kwargs()
        )
    else:
        pool = redis.BlockingConnectionPool.from_url(url, **options, **connection_class(url))
    return redis.Redis(connection_pool=pool)


def disconnect(client: Any) -> None:
    """Close every connection of ``client``'s pool (and to its sentinels, if any; to every
    node, on a cluster)."""
    if isinstance(client, _Cluster):
        client.close()
        return
    pool = client.connection_pool
    pool.disconnect()
    if isinstance(pool, _BlockingSentinelPool):
        pool.sentinel_manager.close()


def server(client: Any) -> tuple[Any, ...]:
    """Which server and database a client talks to, as its connections are made (behind
    Sentinel: which service, through which sentinels; on a cluster: which nodes)."""
    if isinstance(client, _Cluster):
        return client.url.identity()
    pool = client.connection_pool
    if isinstance(pool, _BlockingSentinelPool):
        return pool.url.identity()
    kwargs = pool.connection_kwargs
    return tuple(kwargs.get(k) for k in ("host", "port", "path", "db", "username"))


@contextmanager
def translated(store: str, client: Any = None) -> Iterator[None]:
    """Turn redis-py errors into the store errors the contract promises.

    ``client``: the store's client; a cluster's reads its slot table again after a
    transient error, so that the retry (store.retry) reaches a promoted replica."""
    try:
        yield
    except PoolExhausted as exc:
        raise StoreBusy(store, exc.max_connections, exc.waited_s) from exc
    except TRANSIENT_ERRORS as exc:
        if isinstance(client, _Cluster):
            refresh_layout(client)
        raise StoreUnavailable(store, str(exc) or type(exc).__name__) from exc
    except redis.exceptions.RedisError as exc:
        raise StoreError(
            f"{store} refused a command: {exc}; check the server's logs and its maxmemory setting"
        ) from exc


def where(url: str) -> str:
    """The URL without its password, fit for an error message."""
    if is_cluster(url):
        try:
            return ClusterUrl.parse(split_replica_wait(url)[0]).shown()
        except ValueError:
            return url.split("://", 1)[0] + "://…"
    if is_sentinel(url):
        try:
            return SentinelUrl.parse(split_replica_wait(url)[0]).shown()
        except ValueError:
            return "redis+sentinel://…"
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    query = "&".join(q for q in parts.query.split("&") if not q.startswith("password="))
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def checked_prefix(prefix: str) -> str:
    """``prefix`` if it can start every key of ours; ValueError saying what is accepted."""
    if not PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(
            f"Redis key prefix {prefix!r}: use 1-64 letters, digits, `_`, `.`, `:` or `-` "
            "(no braces: they would change which Cluster slot a run's keys hash to)"
        )
    return prefix


def keyspace_of(client: Any, prefix: str, shown: str) -> Keyspace:
    """The keyspace of ``prefix`` on ``client``'s server: the plain one, or on a cluster the
    sharded one, whose shard count the cluster then holds (ValueError if it holds another).
    """
    if not isinstance(client, _Cluster):
        return Keyspace(checked_prefix(prefix))
    keys = Keyspace(checked_prefix(prefix), client.url.shards)
    with translated(shown):
        recorded = keys.claim(client)
    if recorded != client.url.shards:
        raise ValueError(
            f"the cluster keeps the `{prefix}` keys in {recorded} shards (key {keys.meta_key}), "
            f"this URL says shards={client.url.shards}: give every worker and tool the same "
            f"count (shards={recorded}); another would look for runs where they are not"
        )
    return keys


class RedisSnapshotStore(SnapshotStore):
    name = "redis snapshot store"
    appends_transcript = True

    def __init__(self, client: Any, prefix: str = DEFAULT_PREFIX, url: str = "redis") -> None:
        super().__init__()
        self._client = client
        self._server = server(client)  # asked on every checkpoint: a pool's kwargs stay put
        self._where = f"snapshot store {where(url)}"
        self._keys = keyspace_of(client, prefix, self._where)
        self._prefix = self._keys.prefix
        self._put_script = client.register_script(_PUT)
        self._put_parts_script = client.register_script(_PUT_PARTS)
        self._quarantine_script = client.register_script(_QUARANTINE)
        self.bytes_written = 0
        """Payload bytes sent by saves (heads and fragments, packed): what a checkpoint costs."""

    @classmethod
    def from_url(
        cls, url: str, prefix: str = DEFAULT_PREFIX, max_connections: int | None = None
    ) -> RedisSnapshotStore:
        """Open ``redis://[user:password@]host:port/db`` (or ``rediss://``, ``unix://``); connects lazily.

        ``max_connections``: the most calls this process makes at once (see :func:`connect`).
        """
        return cls(connect(url, max_connections), prefix, url)

    def keyspace(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The server and database this store's keys are in, and their prefix (and shards)."""
        return self._server, self._keys.identity()

    def _shard(self, run_id: str) -> Shard:
        return self._keys.of(run_id)

    def _key(self, run_id: str) -> str:
        return self._keys.of(run_id).run_key(run_id, "snapshot")

    def _transcript_key(self, run_id: str) -> str:
        return self._keys.of(run_id).run_key(run_id, "transcript")

    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        expected = "" if expected_seq is None else str(expected_seq)
        packed = pack(data)
        with translated(self._where, self._client):
            refused = cast(
                "list[bytes] | None",
                self._put_script(
                    keys=[
                        self._key(run_id),
                        self._shard(run_id).snapshots,
                        self._transcript_key(run_id),
                    ],
                    args=[expected, str(state.seq), packed, run_id],
                ),
            )
        self.bytes_written += len(packed)
        if refused is not None:
            found = refused[0].decode()
            raise StaleWrite(run_id, expected_seq, int(found) if found else None)

    def _put_parts(self, run_id: str, parts: Parts, expected_seq: int | None) -> None:
        base = parts.base
        head = pack(parts.head)
        fragments = [pack(f) for f in parts.fragments]
        args: list[str | bytes] = [
            "" if expected_seq is None else str(expected_seq),
            str(parts.seq),
            head,
            run_id,
            "replace" if base is None else "append",
            "" if base is None else str(base.length),
            "" if base is None else base.chain,
            str(parts.tip.length),
            str(parts.tip.size),
            parts.tip.chain,
            *fragments,
        ]
        with translated(self._where, self._client):
            refused = cast(
                "list[bytes] | None",
                self._put_parts_script(
                    keys=[
                        self._key(run_id),
                        self._shard(run_id).snapshots,
                        self._transcript_key(run_id),
                    ],
                    args=args,
                ),
            )
        self.bytes_written += len(head) + sum(len(f) for f in fragments)
        if refused is None:
            return
        if refused[0] == b"moved":
            raise TranscriptMoved(run_id)
        found = refused[1].decode()
        raise StaleWrite(run_id, expected_seq, int(found) if found else None)

    def _read_tip(self, run_id: str) -> tuple[int, TranscriptTip | None] | None:
        with translated(self._where, self._client):
            seq, n, size, chain = cast(
                "list[bytes | None]",
                self._client.hmget(self._key(run_id), ["seq", "n", "size", "chain"]),
            )
        if seq is None:
            return None
        if n is None or size is None or chain is None:
            return int(seq), None
        return int(seq), TranscriptTip(int(n), int(size), chain.decode())

    READ_FIELDS = ("doc", "head", "n", "size", "chain")
    """The snapshot hash's fields a read takes, in the order its parsers expect them."""

    def _read(self, run_id: str) -> tuple[bytes, TranscriptTip | None] | None:
        return self._parse_whole(run_id, *self._fetch(run_id, 0))

    def _read_after(
        self, run_id: str, base: TranscriptTip
    ) -> tuple[bytes, list[bytes], TranscriptTip] | None:
        # The head and only the fragments past ``base``: a turn on the other process of a
        # pool reads and unpacks two new messages, not the whole transcript. The base
        # class checks that they chain onto ``base`` (else it reads the whole).
        return self._parse_after(base, *self._fetch(run_id, base.length))

    def _fetch(self, run_id: str, start: int) -> tuple[list[bytes | None], list[bytes]]:
        """The hash's READ_FIELDS and the transcript's fragments from ``start``, together."""
        with translated(self._where, self._client):
            pipe = self._client.pipeline(transaction=True)
            pipe.hmget(self._key(run_id), list(self.READ_FIELDS))
            pipe.lrange(self._transcript_key(run_id), start, -1)
            fields, stored = cast("tuple[list[bytes | None], list[bytes]]", tuple(pipe.execute()))
        return fields, stored

    def prefetched(
        self,
        run_id: str,
        base: TranscriptTip | None,
        fields: list[bytes | None],
        stored: list[bytes],
    ) -> Prefetched:
        """What another store's script read of the run's snapshot (the hash's READ_FIELDS,
        the transcript from ``base``'s length, or all of it), for :meth:`load`."""
        if base is None:
            return Prefetched(run_id, None, lambda: self._parse_whole(run_id, fields, stored))
        return Prefetched(run_id, base, lambda: self._parse_after(base, fields, stored))

    def _parse_whole(
        self, run_id: str, fields: list[bytes | None], stored: list[bytes]
    ) -> tuple[bytes, TranscriptTip | None] | None:
        doc, head, n, size, chain = fields
        what = self.where(run_id)
        try:
            if doc is not None:
                return unpack(doc, self.max_bytes), None
            if head is None or n is None or size is None or chain is None:
                return None
            fragments = [unpack(f, self.max_bytes) for f in stored]
        except ValueError as exc:
            raise SnapshotMalformed(what, str(exc)) from exc
        tip = TranscriptTip(int(n), int(size), chain.decode())
        if (
            len(fragments) != tip.length
            or snapshot_format.chain(snapshot_format.GENESIS, fragments) != tip.chain
        ):
            raise SnapshotMalformed(
                what,
                f"its transcript holds {len(fragments)} messages that do not match the head's "
                f"{tip.length}; delete the snapshot and `ratchet runs resume {run_id}` rebuilds "
                "it from the run's events",
            )
        return snapshot_format.assemble(unpack(head, self.max_bytes), fragments), tip

    def _parse_after(
        self, base: TranscriptTip, fields: list[bytes | None], stored: list[bytes]
    ) -> tuple[bytes, list[bytes], TranscriptTip] | None:
        doc, head, n, size, chain = fields
        if doc is not None or head is None or n is None or size is None or chain is None:
            return None
        tip = TranscriptTip(int(n), int(size), chain.decode())
        if tip.length < base.length:
            return None
        fragments = [unpack(f, self.max_bytes) for f in stored]
        return unpack(head, self.max_bytes), fragments, tip

    def _get(self, run_id: str) -> bytes | None:
        found = self._read(run_id)
        return found[0] if found is not None else None

    def where(self, run_id: str) -> str:
        return f"snapshot of run {run_id} in {self._where}"

    def _quarantine(self, run_id: str, stamp: str) -> str | None:
        # The run's hash tag stays in the quarantined names: one Cluster slot, one script.
        aside = f"{self._shard(run_id).prefix}:quarantine:{{{run_id}}}:{stamp}"
        with translated(self._where, self._client):
            moved = self._quarantine_script(
                keys=[
                    self._key(run_id),
                    self._transcript_key(run_id),
                    f"{aside}:snapshot",
                    f"{aside}:transcript",
                    self._shard(run_id).snapshots,
                ],
                args=[run_id],
            )
        return f"{aside}:snapshot (and :transcript)" if moved else None

    def _delete(self, run_id: str) -> None:
        with translated(self._where, self._client):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._key(run_id), self._transcript_key(run_id))
            pipe.srem(self._shard(run_id).snapshots, run_id)
            pipe.execute()

    def _list(self) -> list[str]:
        with translated(self._where, self._client):
            pipe = self._client.pipeline(transaction=False)
            for shard in self._keys.shards:
                pipe.smembers(shard.snapshots)
            found = cast("list[set[bytes]]", pipe.execute())
        return [m.decode() for members in found for m in members]

    def close(self) -> None:
        with translated(self._where, self._client):
            disconnect(self._client)
