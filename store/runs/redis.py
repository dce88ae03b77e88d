"""Run records, event logs and leases in Redis.

Key layout (``prefix`` defaults to ``ratchet``; ``{<id>}`` is the run's hash tag,
so every key of one run lives in one Cluster slot, next to its snapshot)::

    {prefix}:run:{<id>}:record        hash  record -> RunRecord JSON, last_seq, status,
                                            due (as indexed), next (exact), fin (finished at)
    {prefix}:run:{<id>}:events        list  Event JSON at index seq - 1 (zlib-packed when that
                                            makes it shorter: see store.packing)
    {prefix}:run:{<id>}:lease         hash  owner, expires_at_ms (PX TTL: lease + grace)
    {prefix}:runs:by_created          zset  run id scored by created_at_ms   (list)
    {prefix}:runs:status:<status>     zset  run id scored by created_at_ms   (list by status)
    {prefix}:runs:due                 zset  live run id scored by due_at_ms  (overdue)
    {prefix}:runs:finished            zset  finished run id scored by updated_at_ms (purge)
    {prefix}:procs                    zset  worker process id scored by liveness expiry (ms)
    {prefix}:proc:<process>:leases    set   run ids whose lease the process claimed (orphaned)

Every write is one Lua script (``lua/*.lua``, read once at import), so the fences
(last seq, lease owner and expiry) are checked and the events, record and indexes
written atomically. An append writes an index only when what it indexes changed: the
status sets when the status does, the finished set when the run finishes or leaves a
finished status, the due set when the due time moves earlier, to none, or later by more
than a second (``DUE_SLACK`` in append.lua, at most half the time left): a run taking
quick turns is re-indexed about once a second, not at every append. The index may so
hold a due time a little early, never late; the sweeper skips a run whose exact due
time (the record's ``next``) has not come. With a
:class:`~store.snapshots.redis.RedisSnapshotStore` on the same server, database and
prefix, the same script also saves the snapshot and may release the lease: one round
trip per transition (:meth:`RunStore.commit`); and the lease's script reads the
snapshot with the record, one round trip to open a turn (:meth:`RunStore.acquire_and_read`).
On one server (or Sentinel) the four ``runs:*`` indexes and ``procs`` are one key each.
On Redis Cluster (``redis+cluster://``) the whole layout above is kept once per shard,
``{prefix}`` standing for the shard's ``{<prefix>:<n>}`` (:mod:`store.keyspace`): a run's
keys and its entries in every index share one slot, so each script, unchanged, touches
one slot. What spans runs reads every shard, pipelined, and merges (:meth:`_list`,
:meth:`_overdue`, :meth:`_orphaned`, :meth:`_purge`); a process's liveness is written to
every shard, since a claim reads it beside the run's lease.

Lease expiry is compared with the ``now_ms`` the base class takes from its
clock, never with Redis's own time, so an injected clock drives it. The PX
TTL only sweeps away leases long dead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

import redis

from runtime import json_values
from runtime.errors import LeaseLost, StaleWrite, StoreError
from runtime.models import Event, RunStatus, validate_run_id
from store.keyspace import Shard
from store.live.redis import RedisLiveStream
from store.packing import pack, unpack
from store.redis_cluster import on_slot_owner
from store.replicas import ReplicaWait, split_replica_wait
from store.retry import with_retries
from store.runs import (
    Claim,
    Lease,
    Orphan,
    RunRecord,
    RunStore,
    Transition,
    checked_batch,
    owner_process,
)
from store.snapshots import Prefetched, SnapshotStore, TranscriptMoved, TranscriptTip
from store.snapshots.redis import (
    DEFAULT_PREFIX,
    RedisSnapshotStore,
    connect,
    disconnect,
    keyspace_of,
    lua,
    run_script,
    run_script_pair,
    run_scripts,
    server,
    translated,
    where,
)

MAX_EVENT_BYTES = 64 * 1024 * 1024
"""An event inflating past this is refused as corrupt (a guard, not a format limit)."""
LEASE_TTL_GRACE_MS = 60_000
"""A lease key outlives its expiry by this much, so clock skew between workers
and Redis never deletes a lease its owner still holds."""
OVERDUE_BATCH = 200
"""Overdue run ids read per round trip while skipping those with a live lease."""
RENEW_BATCH = 1000
"""Leases renewed per pipeline: a heartbeat round of up to this many is one round trip."""

_USES = {
    "acquire": ("hold_lease",),
    "acquire_read": ("hold_lease",),
    "claim": ("owner_process", "hold_lease"),
    "orphaned": ("owner_process",),
}
"""The Lua functions, each a file of its own, prepended to the scripts that call them."""
_SCRIPTS = {
    name: "".join(
        lua(__package__ or "store.runs", f"{part}.lua") for part in (*_USES.get(name, ()), name)
    )
    for name in (
        "create",
        "append",  # one transition: events, record, indexes; optionally snapshot and release
        "acquire",  # takes the lease and reads the record in one call
        "acquire_read",  # the same, and reads the snapshot too
        "extend",
        "release",
        "purge",
        "claim",  # takes the lease, also from a holder whose process is dead
        "postpone",
        "beat",
        "orphaned",
    )
}
"""Each script's source (its contract in the file's header), read once at import."""


def _packed(event: Event) -> bytes:
    # A tool result of a few KiB is most of a turn's bytes; the event log keeps every one.
    # The codec every store writes with (runtime/json_values.py): what it writes, it reads.
    document = {"seq": event.seq, "type": event.type, "at_ms": event.at_ms, "data": event.data}
    return pack(json_values.dumps(document))


def _unpacked(data: bytes, store: str) -> Event:
    try:
        return Event.model_validate(json_values.loads(unpack(data, MAX_EVENT_BYTES)))
    except ValueError as exc:
        raise StoreError(
            f"{store} holds an unreadable event ({exc}); the log is damaged — restore the "
            "server from a backup"
        ) from exc


class RedisRunStore(RunStore):
    name = "redis run store"

    def __init__(
        self,
        client: Any,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], int] | None = None,
        url: str = "redis",
        replica_wait: ReplicaWait | None = None,
    ) -> None:
        super().__init__(clock)
        self._client = client
        if replica_wait is not None:
            self.replica_wait = replica_wait
        self._server = server(client)  # asked on every checkpoint: a pool's kwargs stay put
        self._where = f"run store {where(url)}"
        self._keys = keyspace_of(client, prefix, self._where)
        self._prefix = self._keys.prefix
        self._scripts = {name: client.register_script(src) for name, src in _SCRIPTS.items()}
        self._append_loaded = False
        """Whether :meth:`_script_then_wait` has loaded the append script (once a store)."""
        self._live = RedisLiveStream(client, self._keys, where(url))

    def live(self) -> RedisLiveStream:
        return self._live

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], int] | None = None,
        max_connections: int | None = None,
    ) -> RedisRunStore:
        """Open ``redis://host:port/db`` (or ``rediss://``, ``unix://``, ``redis+sentinel://``:
        connects lazily; ``redis+cluster://``: asks the cluster for its layout now).

        ``max_connections``: the most calls this process makes at once (see
        :func:`store.snapshots.redis.connect`). ``?min_replicas=N&replica_timeout_ms=T``:
        what :meth:`append_replicated` waits for (store/replicas.py).
        """
        plain, replica_wait = split_replica_wait(url)
        return cls(connect(plain, max_connections), prefix, clock, url, replica_wait)

    def shown(self) -> str:
        return self._where

    def _run_key(self, run_id: str, part: str) -> str:
        return self._keys.of(run_id).run_key(run_id, part)

    @staticmethod
    def _status_key(shard: Shard, status: RunStatus) -> str:
        return f"{shard.status_prefix}{status.value}"

    @staticmethod
    def _record_args(record: RunRecord) -> list[str]:
        return [
            record.run_id,
            record.model_dump_json(),
            str(record.last_seq),
            record.status.value,
            str(record.created_at_ms),
            "" if record.due_at_ms is None else str(record.due_at_ms),
        ]

    @staticmethod
    def _finished_at(record: RunRecord) -> str:
        return str(record.updated_at_ms) if record.finished else ""

    # --- records and events -------------------------------------------------

    def _create(self, record: RunRecord, first: Event) -> None:
        run_id = record.run_id
        shard = self._keys.of(run_id)
        keys = [
            shard.run_key(run_id, "record"),
            shard.run_key(run_id, "events"),
            shard.by_created,
            self._status_key(shard, record.status),
            shard.due,
            shard.finished,
        ]
        args: list[str | bytes] = [
            *self._record_args(record),
            str(first.seq),
            _packed(first),
            self._finished_at(record),
        ]
        with translated(self._where, self._client):
            found = cast("bytes | None", self._scripts["create"](keys=keys, args=args))
        if found is not None:
            raise StaleWrite(run_id, 0, int(found))

    def _append(
        self, record: RunRecord, events: list[Event], owner: str | None, now_ms: int
    ) -> None:
        self._transition(record, events, owner, now_ms)

    def _append_waiting(
        self, record: RunRecord, events: list[Event], owner: str | None, now_ms: int
    ) -> int:
        return self._transition(record, events, owner, now_ms, waits=True)

    def commits_with(self, snapshots: SnapshotStore) -> bool:
        """True for a Redis snapshot store on this store's server, database and prefix."""
        return isinstance(snapshots, RedisSnapshotStore) and snapshots.keyspace() == (
            self._server,
            self._keys.identity(),
        )

    def pushes_to(self, server: dict[str, Any]) -> bool:
        """True for a client of this store's server, as the same user (any database); never
        on a cluster, which no broker is (kombu has no Redis Cluster transport)."""
        if self._keys.sharded:
            return False
        mine = self._client.connection_pool.connection_kwargs
        keys = ("host", "port", "path", "username", "password")
        return all(server.get(k) == mine.get(k) for k in keys)

    def _commit(self, whole: Transition, now_ms: int) -> None:
        assert isinstance(whole.snapshots, RedisSnapshotStore)
        self._transition(whole.record, whole.events, whole.owner, now_ms, whole)

    def _transition(
        self,
        record: RunRecord,
        events: list[Event],
        owner: str | None,
        now_ms: int,
        whole: Transition | None = None,
        waits: bool = False,
    ) -> int:
        """The append script: the events and record, and the snapshot and release if given.

        ``waits``: then ``WAIT`` for the replicas :attr:`replica_wait` asks for; how many
        acknowledged it (0 when not asked to wait)."""
        keys, args, written = self._append_call(record, events, owner, now_ms, whole)
        with translated(self._where, self._client):
            if waits:
                refused, acked = self._script_then_wait(keys, args)
            else:
                acked = 0
                refused = cast(
                    "list[bytes] | None", run_script(self._scripts["append"], keys, args)
                )
        if whole is not None and refused is None:
            assert isinstance(whole.snapshots, RedisSnapshotStore)
            whole.snapshots.bytes_written += written
        if refused is not None:
            self._refused(refused, record.run_id, events[0].seq - 1, owner, whole)
        return acked

    def _append_call(
        self,
        record: RunRecord,
        events: list[Event],
        owner: str | None,
        now_ms: int,
        whole: Transition | None = None,
        was: RunRecord | None = None,
    ) -> tuple[list[str], list[str | bytes], int]:
        """The append script's keys and arguments for :meth:`_transition` (``was``: the
        record the run must still have), and the snapshot bytes it writes."""
        run_id = record.run_id
        expected = events[0].seq - 1
        release = whole is not None and whole.release
        shard = self._keys.of(run_id)
        lease = shard.run_key(run_id, "lease")
        keys = [
            shard.run_key(run_id, "record"),
            shard.run_key(run_id, "events"),
            lease,
            self._status_key(shard, record.status),
            shard.due,
            shard.finished,
            shard.run_key(run_id, "snapshot"),
            shard.snapshots,
            shard.run_key(run_id, "transcript"),
            self._held_key(shard, owner or "", lease),
        ]
        # The scalars in one argument (append.lua splits it at spaces, which none holds): the
        # framing redis-py gives each argument was most of the cost of sending a transition.
        fields = [
            run_id,
            str(record.last_seq),
            record.status.value,
            str(record.created_at_ms),
            "" if record.due_at_ms is None else str(record.due_at_ms),
            str(expected),
            "0" if owner is None else "1",
            str(now_ms),
            shard.status_prefix,
            self._finished_at(record),
            "1" if release else "0",
        ]
        mode, head = "", b""
        fragments: list[bytes] = []
        if whole is None or whole.parts is None:
            mode = "" if whole is None else "drop"
            fields += ["", "", "", "", "", ""]
        else:
            parts = whole.parts
            base = parts.base
            mode = "replace" if base is None else "append"
            head = pack(parts.head)
            fragments = [pack(f) for f in parts.fragments]
            fields += [
                "" if whole.expected_seq is None else str(whole.expected_seq),
                "" if base is None else str(base.length),
                "" if base is None else base.chain,
                str(parts.tip.length),
                str(parts.tip.size),
                parts.tip.chain,
            ]
        fields.append(str(len(events)))
        outbox = whole.outbox if whole is not None else None
        if outbox is not None and (" " in outbox.key or not outbox.key):
            raise ValueError(f"outbox list {outbox.key!r}: a name without spaces, please")
        if outbox is None:
            fields += ["", "", ""]
        else:
            own_db = self._client.connection_pool.connection_kwargs.get("db") or 0
            fields += [str(int(outbox.db)), outbox.key, str(int(own_db))]
        args: list[str | bytes] = [" ".join(fields), record.model_dump_json(), owner or "", mode]
        args += [head, "" if was is None else was.model_dump_json()]
        args += [_packed(event) for event in events]
        args += fragments
        if outbox is not None:
            args.append(outbox.payload)
        return keys, args, len(head) + sum(len(f) for f in fragments)

    def _refused(
        self,
        refused: list[bytes],
        run_id: str,
        expected: int,
        owner: str | None,
        whole: Transition | None = None,
    ) -> NoReturn:
        """The error for the append script's refusal."""
        if refused[0] == b"stale":
            found = refused[1].decode()
            raise StaleWrite(run_id, expected, int(found) if found else None)
        if refused[0] == b"record":
            raise StaleWrite(run_id, expected, expected)
        if refused[0] == b"snapshot":
            found = refused[1].decode()
            seen = whole.expected_seq if whole is not None else None
            raise StaleWrite(run_id, seen, int(found) if found else None)
        if refused[0] == b"moved":
            raise TranscriptMoved(run_id)
        raise LeaseLost(run_id, str(owner))

    def _script_then_wait(
        self, keys: list[str], args: list[str | bytes]
    ) -> tuple[list[bytes] | None, int]:
        """The append script, then ``WAIT min_replicas timeout_ms``: what the script
        answered, and how many replicas acknowledged.

        One pipeline, so both go on one connection in one round trip: WAIT counts the
        replicas that acknowledged the writes of the connection it is sent on — the
        script's, and with them every write the primary took before it (replication is one
        stream). Not a transaction: inside MULTI, WAIT answers at once without waiting; nor
        in the script: Lua may not call WAIT. On Redis Cluster the pair goes to the primary
        that owns the run's slot (:func:`~store.redis_cluster.on_slot_owner`, which follows
        a failover or a moved slot); a retry that finds its own append landed is refused
        by the script's fence and so counted as not replicated (:meth:`append_replicated`).
        """
        script, wait = self._scripts["append"], self.replica_wait
        commands = [
            ("EVALSHA", script.sha, len(keys), *keys, *args),
            ("WAIT", wait.min_replicas, wait.timeout_ms),
        ]

        def pipelined() -> tuple[list[bytes] | None, int]:
            pipe: Any
            if isinstance(self._client, redis.cluster.RedisCluster):
                refused, acked = on_slot_owner(self._client, keys[0], commands)
            else:
                with self._client.pipeline(transaction=False) as pipe:
                    for command in commands:
                        pipe.execute_command(*command)
                    refused, acked = pipe.execute()
            return cast("list[bytes] | None", refused), int(acked)

        if not self._append_loaded:
            # A server that does not know the script answers the EVALSHA NoScript but still
            # runs the WAIT behind it in the pipeline: the first replicated append of a
            # store (a fresh server, a new cluster primary) would wait twice. SCRIPT LOAD
            # goes to every primary of a cluster.
            self._client.script_load(script.script)
            self._append_loaded = True
        try:
            return pipelined()
        except redis.exceptions.NoScriptError:
            # The server forgot its scripts since (a restart, a failover): nothing was written.
            self._client.script_load(script.script)
            return pipelined()

    def _get(self, run_id: str) -> RunRecord | None:
        with translated(self._where, self._client):
            data = cast(
                "bytes | None", self._client.hget(self._run_key(run_id, "record"), "record")
            )
        return RunRecord.model_validate_json(data) if data is not None else None

    def _list(self, status: RunStatus | None, limit: int) -> list[RunRecord]:
        if limit <= 0:
            return []
        with translated(self._where, self._client):
            if self._keys.sharded:
                run_ids = self._newest(status, limit)
            else:
                shard = self._keys.shards[0]
                index = shard.by_created if status is None else self._status_key(shard, status)
                # Equal scores come back in reverse member order: newest first, then id descending.
                run_ids = cast("list[bytes]", self._client.zrevrange(index, 0, limit - 1))
            pipe = self._client.pipeline(transaction=False)
            for run_id in run_ids:
                pipe.hget(self._run_key(run_id.decode(), "record"), "record")
            found = cast("list[bytes | None]", pipe.execute())
        return [RunRecord.model_validate_json(data) for data in found if data is not None]

    def _newest(self, status: RunStatus | None, limit: int) -> list[bytes]:
        """The ``limit`` newest run ids of every shard's index, merged in the order one
        index gives them (newest first, then id descending)."""
        pipe = self._client.pipeline(transaction=False)
        for shard in self._keys.shards:
            index = shard.by_created if status is None else self._status_key(shard, status)
            pipe.zrevrange(index, 0, limit - 1, withscores=True)
        pages = cast("list[list[tuple[bytes, float]]]", pipe.execute())
        merged = sorted((entry for page in pages for entry in page), key=lambda e: (e[1], e[0]))
        return [member for member, _ in reversed(merged[-limit:])]

    def _events(self, run_id: str, after_seq: int, limit: int | None) -> list[Event]:
        if limit is not None and limit <= 0:
            return []
        key = self._run_key(run_id, "events")
        with translated(self._where, self._client):
            stop = -1 if limit is None else max(after_seq, 0) + limit - 1
            found = self._client.lrange(key, max(after_seq, 0), stop)
        return [_unpacked(data, self._where) for data in cast("list[bytes]", found)]

    # --- leases -------------------------------------------------------------

    def _acquire(self, run_id: str, owner: str, lease_ms: int, now_ms: int) -> bool:
        return self._acquire_and_get(run_id, owner, lease_ms, now_ms)[0]

    def _acquire_and_get(
        self, run_id: str, owner: str, lease_ms: int, now_ms: int
    ) -> tuple[bool, RunRecord | None]:
        ttl_ms = max(lease_ms, 0) + LEASE_TTL_GRACE_MS
        shard = self._keys.of(run_id)
        lease = shard.run_key(run_id, "lease")
        args = [owner, str(now_ms), str(now_ms + lease_ms), str(ttl_ms), run_id]
        keys = [lease, shard.run_key(run_id, "record"), self._held_key(shard, owner, lease)]
        with translated(self._where, self._client):
            found = cast("list[Any]", run_script(self._scripts["acquire"], keys, args))
        if not found[0]:
            return False, None
        data = found[1] if len(found) > 1 else None
        return True, RunRecord.model_validate_json(data) if data else None

    def reads_with(self, snapshots: SnapshotStore) -> bool:
        """True where this store :meth:`commits_with` ``snapshots``: the snapshot's keys
        are in this server, database and run's slot."""
        return self.commits_with(snapshots)

    def _acquire_and_read(
        self,
        run_id: str,
        owner: str,
        lease_ms: int,
        now_ms: int,
        snapshots: SnapshotStore,
        base: TranscriptTip | None,
        unless_at: int | None,
    ) -> tuple[bool, RunRecord | None, Prefetched | None]:
        keys, args = self._acquire_read_call(run_id, owner, lease_ms, now_ms, base, unless_at)
        with translated(self._where, self._client):
            found = cast("list[Any]", run_script(self._scripts["acquire_read"], keys, args))
        return self._acquired_read(found, run_id, snapshots, base)

    def _acquire_read_call(
        self,
        run_id: str,
        owner: str,
        lease_ms: int,
        now_ms: int,
        base: TranscriptTip | None,
        unless_at: int | None,
    ) -> tuple[list[str], list[str]]:
        """The acquire_read script's keys and arguments (:meth:`_acquire_and_read`)."""
        ttl_ms = max(lease_ms, 0) + LEASE_TTL_GRACE_MS
        shard = self._keys.of(run_id)
        lease = shard.run_key(run_id, "lease")
        start = 0 if base is None else base.length
        unless = "" if unless_at is None else str(unless_at)
        args = [owner, str(now_ms), str(now_ms + lease_ms), str(ttl_ms), run_id, str(start), unless]
        keys = [
            lease,
            shard.run_key(run_id, "record"),
            self._held_key(shard, owner, lease),
            shard.run_key(run_id, "snapshot"),
            shard.run_key(run_id, "transcript"),
        ]
        return keys, args

    @staticmethod
    def _acquired_read(
        found: list[Any], run_id: str, snapshots: SnapshotStore, base: TranscriptTip | None
    ) -> tuple[bool, RunRecord | None, Prefetched | None]:
        """What the acquire_read script answered, as :meth:`_acquire_and_read` returns it."""
        assert isinstance(snapshots, RedisSnapshotStore)
        if not found[0]:
            return False, None, None
        data = found[1] if len(found) > 1 else None
        record = RunRecord.model_validate_json(data) if data else None
        if len(found) < 4:
            return True, record, None  # the caller remembers the state the log ends at
        return True, record, snapshots.prefetched(run_id, base, found[2], found[3])

    def acquire_and_append(
        self,
        run_id: str,
        owner: str,
        lease_s: float,
        snapshots: SnapshotStore,
        was: RunRecord,
        record: RunRecord,
        events: Sequence[Event],
    ) -> tuple[bool, RunRecord | None, Prefetched | None, bool]:
        """One round trip on one server: the acquire_read script, then the append script
        fenced by the lease it took, the seq and ``was`` (append.lua). Both are safe to send
        again: a retry whose append landed the first time finds its own events."""
        if not self.reads_with(snapshots) or type(self._client) is not redis.Redis:
            return super().acquire_and_append(
                run_id, owner, lease_s, snapshots, was, record, events
            )
        run_id = validate_run_id(run_id)
        mine = checked_batch(record, events)
        lease_ms = int(lease_s * 1000)
        base = snapshots.read_base(run_id)

        def attempt() -> tuple[bool, RunRecord | None, Prefetched | None, bool]:
            now_ms = self.clock()
            read = self._acquire_read_call(run_id, owner, lease_ms, now_ms, base, was.last_seq)
            keys, args, _ = self._append_call(record, mine, owner, now_ms, was=was)
            with translated(self._where, self._client):
                found, refused = run_script_pair(
                    (self._scripts["acquire_read"], *read), (self._scripts["append"], keys, args)
                )
                for answer in (found, refused):
                    if isinstance(answer, Exception):
                        raise answer
            taken, now, prefetched = self._acquired_read(found, run_id, snapshots, base)
            if refused is None:
                return True, record, None, True
            if refused[0] == b"stale":
                stale = StaleWrite(run_id, was.last_seq, int(refused[1]) if refused[1] else None)
                if self._landed(stale, mine):
                    return True, record, None, True
            return taken, now, prefetched, False

        return with_retries(attempt, run_id)

    def _extend(self, run_id: str, owner: str, lease_ms: int, now_ms: int) -> bool:
        return self._renew([(run_id, owner)], lease_ms, now_ms)[0]

    def _renew(self, leases: list[tuple[str, str]], lease_ms: int, now_ms: int) -> list[bool]:
        # The extend script per lease, pipelined: one round trip per RENEW_BATCH leases,
        # and each lease's key stays in its run's slot (a Cluster pipeline splits by slot).
        ttl_ms = str(max(lease_ms, 0) + LEASE_TTL_GRACE_MS)
        expires = str(now_ms + lease_ms)
        extend = self._scripts["extend"]
        extended: list[bool] = []

        def batch(part: list[tuple[str, str]]) -> list[int]:
            # Bare EVALSHAs: a Script called on a pipeline sends SCRIPT EXISTS first, every round.
            pipe: Any = self._client.pipeline(transaction=False)
            for run_id, owner in part:
                key = self._run_key(run_id, "lease")
                pipe.execute_command("EVALSHA", extend.sha, 1, key, owner, expires, ttl_ms)
            return cast("list[int]", pipe.execute())

        with translated(self._where, self._client):
            for start in range(0, len(leases), RENEW_BATCH):
                part = leases[start : start + RENEW_BATCH]
                try:
                    found = batch(part)
                except redis.exceptions.NoScriptError:
                    # The server forgot its scripts (a restart, a failover): load it, go again
                    # (an extension is idempotent).
                    self._client.script_load(extend.script)
                    found = batch(part)
                extended += [bool(held) for held in found]
        return extended

    def _release(self, run_id: str, owner: str) -> None:
        shard = self._keys.of(run_id)
        lease = shard.run_key(run_id, "lease")
        with translated(self._where, self._client):
            self._scripts["release"](
                keys=[lease, self._held_key(shard, owner, lease)], args=[owner, run_id]
            )

    @staticmethod
    def _held_key(shard: Shard, owner: str, otherwise: str) -> str:
        """The set of runs ``owner``'s process claimed in ``shard``; ``otherwise`` if it
        names none."""
        process = owner_process(owner)
        return otherwise if process is None else f"{shard.proc_prefix}{process}:leases"

    def _postpone(self, run_id: str, seen_seq: int, due_at_ms: int) -> bool:
        shard = self._keys.of(run_id)
        keys = [shard.run_key(run_id, "record"), shard.due]
        with translated(self._where, self._client):
            moved = self._scripts["postpone"](
                keys=keys, args=[run_id, str(seen_seq), str(due_at_ms)]
            )
        return bool(moved)

    def _claim(
        self, run_id: str, owner: str, process: str | None, lease_ms: int, now_ms: int
    ) -> Claim:
        shard = self._keys.of(run_id)
        lease = shard.run_key(run_id, "lease")
        ttl_ms = max(lease_ms, 0) + LEASE_TTL_GRACE_MS
        keys = [lease, shard.procs, self._held_key(shard, owner, lease)]
        args = [owner, str(now_ms), str(now_ms + lease_ms), str(ttl_ms), run_id, shard.proc_prefix]
        with translated(self._where, self._client):
            found = cast("list[int | bytes]", self._scripts["claim"](keys=keys, args=args))
        if found[0] == 1:
            took = cast("bytes", found[1]).decode()
            return Claim(True, took_from=took or None)
        alive = cast("bytes", found[2]).decode()
        return Claim(False, cast("bytes", found[1]).decode(), int(float(alive)) if alive else None)

    def _beat(self, process: str, expires_at_ms: int, now_ms: int) -> bool:
        args = [process, str(expires_at_ms), str(now_ms)]
        with translated(self._where, self._client):
            if not self._keys.sharded:
                was = self._scripts["beat"](keys=[self._keys.shards[0].procs], args=args)
                return bool(was)
            # A claim reads the holder's liveness beside the run's lease, in the run's
            # shard: every shard keeps it (one pipelined call per node a beat).
            calls = [([shard.procs], args) for shard in self._keys.shards]
            return all(run_scripts(self._scripts["beat"], calls))

    clock_source = "Redis TIME"

    def _server_ms(self) -> int | None:
        with translated(self._where, self._client):
            seconds, micros = self._client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def _liveness(self, process: str) -> int | None:
        with translated(self._where, self._client):
            pipe = self._client.pipeline(transaction=False)
            for shard in self._keys.shards:
                pipe.zscore(shard.procs, process)
            # A shard may have forgotten a dead process the others still hold leases of.
            scores = [s for s in cast("list[float | None]", pipe.execute()) if s is not None]
        return int(max(scores)) if scores else None

    def _orphaned(self, now_ms: int, limit: int) -> list[Orphan]:
        calls = [
            ([shard.procs], [str(now_ms), str(limit), shard.proc_prefix, shard.run_head])
            for shard in self._keys.shards
        ]
        with translated(self._where, self._client):
            if self._keys.sharded:
                found = [x for got in run_scripts(self._scripts["orphaned"], calls) for x in got]
            else:
                keys, args = calls[0]
                found = cast("list[bytes]", self._scripts["orphaned"](keys=keys, args=args))
        pairs = zip(found[::2], found[1::2], strict=True)
        return [Orphan(run_id.decode(), owner.decode()) for run_id, owner in pairs][:limit]

    def _lease(self, run_id: str, now_ms: int) -> Lease | None:
        with translated(self._where, self._client):
            owner, expires = cast(
                "list[bytes | None]",
                self._client.hmget(self._run_key(run_id, "lease"), ["owner", "expires_at_ms"]),
            )
        if owner is None or expires is None or int(expires) <= now_ms:
            return None
        return Lease(owner=owner.decode(), expires_at_ms=int(expires))

    def _overdue(self, now_ms: int, limit: int) -> list[str]:
        """Walk the due index from the most overdue run, skipping runs whose lease is live.

        Reads only runs already past due (plus one lease per run), so the cost
        grows with the overdue runs, not with every run ever made. On a cluster every
        shard's index is walked so, in step (a batch of each per round trip), until no
        shard can hold a run more overdue than the ``limit`` found; then merged by due time.
        """
        free: list[tuple[float, str]] = []
        seen: set[str] = set()
        offsets = dict.fromkeys(self._keys.shards, 0)
        with translated(self._where, self._client):
            while offsets:
                shards = list(offsets)
                pipe = self._client.pipeline(transaction=False)
                for shard in shards:
                    pipe.zrangebyscore(
                        shard.due, "-inf", now_ms, start=offsets[shard], num=OVERDUE_BATCH,
                        withscores=True,
                    )  # fmt: skip
                pages = cast("list[list[tuple[bytes, float]]]", pipe.execute())
                for due, run_id in self._past_due([e for page in pages for e in page], now_ms):
                    # Paging by offset while sweepers and workers move runs may show
                    # one twice; a sweep enqueues each run once.
                    if run_id not in seen:
                        free.append((due, run_id))
                    seen.add(run_id)
                # The limit-th most overdue run so far: a shard whose page ended past it
                # has nothing left that would come before it.
                bound = sorted(free)[limit - 1] if len(free) >= limit else None
                for shard, page in zip(shards, pages, strict=True):
                    offsets[shard] += len(page)
                    last = page[-1] if page else None
                    ended = len(page) < OVERDUE_BATCH
                    if ended or (bound and last and (last[1], last[0].decode()) >= bound):
                        del offsets[shard]
        return [run_id for _, run_id in sorted(free)[:limit]]

    def _past_due(self, batch: list[tuple[bytes, float]], now_ms: int) -> list[tuple[float, str]]:
        """The runs of ``batch`` (index entries) that are due by the record's exact due time,
        with no live lease: (due time as indexed, run id); one pipelined read of each."""
        pipe = self._client.pipeline(transaction=False)
        for member, _ in batch:
            pipe.hget(self._run_key(member.decode(), "lease"), "expires_at_ms")
            # The exact due time: the index may hold one up to DUE_SLACK early
            # (append.lua); a record written before 'next' existed has none.
            pipe.hget(self._run_key(member.decode(), "record"), "next")
        found = cast("list[bytes | None]", pipe.execute()) if batch else []
        due_now = []
        for (member, score), expires, due in zip(batch, found[::2], found[1::2], strict=True):
            if due is not None and (due == b"" or int(due) > now_ms):
                continue  # it moved on since the index was written: not overdue yet
            if expires is None or int(expires) <= now_ms:
                due_now.append((score, member.decode()))
        return due_now

    def _purge(self, before_ms: int, limit: int) -> list[str]:
        shards = self._keys.shards
        calls = [
            (
                [shard.finished, shard.by_created, shard.due],
                [str(before_ms), str(limit), shard.run_head, shard.status_prefix],
            )
            for shard in shards
        ]
        with translated(self._where, self._client):
            if not self._keys.sharded:
                keys, args = calls[0]
                purged = cast("list[bytes]", self._scripts["purge"](keys=keys, args=args))
                return [run_id.decode() for run_id in purged]
            # The oldest `limit` across the shards first; then each shard purges its share
            # of them (its own oldest, which they are).
            pipe = self._client.pipeline(transaction=False)
            for shard in shards:
                pipe.zrangebyscore(
                    shard.finished, "-inf", f"({before_ms}", start=0, num=limit, withscores=True
                )
            pages = cast("list[list[tuple[bytes, float]]]", pipe.execute())
            oldest = sorted((score, n) for n, page in enumerate(pages) for _, score in page)
            shares = Counter(n for _, n in oldest[:limit])
            mine = [
                (calls[n][0], [str(before_ms), str(k), *calls[n][1][2:]]) for n, k in shares.items()
            ]
            answers = run_scripts(self._scripts["purge"], mine) if mine else []
        return [run_id.decode() for got in answers for run_id in got]

    def close(self) -> None:
        with translated(self._where, self._client):
            disconnect(self._client)
