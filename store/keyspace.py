"""Where the Redis stores' keys are: one keyspace on a single server, S shards on a cluster.

On one server (or a primary behind Sentinel) the layout is the one
:mod:`store.runs.redis` and :mod:`store.snapshots.redis` draw, under ``prefix``::

    ratchet:run:{<id>}:record   ratchet:runs:due   ratchet:procs   ratchet:snapshots …

On Redis Cluster the same layout is kept once per shard, each under its own prefix
``{<prefix>:<n>}``::

    {ratchet:17}:run:{<id>}:record   {ratchet:17}:runs:due   {ratchet:17}:procs …

The first ``{…}`` of a key is its hash tag, so every key of shard ``n`` — a run's own
keys and its entries in each index — hashes to one slot, and every Lua script, which
touches one run and the indexes beside it, touches one slot. The scripts are the same
text on both layouts: they are handed the shard's key names. A run's shard is
``crc32(run id) mod S``: stable across processes, hosts and Python versions (Python's
``hash()`` is salted per process).

What spans shards — listing runs, finding overdue and orphaned runs, purging — reads
every shard, pipelined (one round trip per node a batch), and merges. With S = 64
(:data:`DEFAULT_SHARDS`) an index's traffic spreads over 64 keys, enough for a cluster
of up to a few dozen primaries to get several each, while a sweep's fixed cost stays
64 small reads. S is fixed per deployment: the cluster records it under
:meth:`Keyspace.meta_key`, and a client given another count refuses to start (it
would look for runs in shards where they are not).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

DEFAULT_SHARDS = 64
MAX_SHARDS = 1024


def shard_of(run_id: str, shards: int) -> int:
    """The shard of ``run_id`` among ``shards``: crc32 of its UTF-8 bytes, mod ``shards``."""
    return zlib.crc32(run_id.encode()) % shards


@dataclass(frozen=True)
class Shard:
    """The key names of one shard (of the only one, on a single server)."""

    prefix: str
    """What every key of the shard starts with: ``ratchet``, or ``{ratchet:17}`` on a cluster."""

    @property
    def run_head(self) -> str:
        """A run key up to its id (``<prefix>:run:{``): the scripts that walk runs build
        their keys from it."""
        return f"{self.prefix}:run:{{"

    def run_key(self, run_id: str, part: str) -> str:
        return f"{self.prefix}:run:{{{run_id}}}:{part}"

    @property
    def by_created(self) -> str:
        return f"{self.prefix}:runs:by_created"

    @property
    def status_prefix(self) -> str:
        return f"{self.prefix}:runs:status:"

    @property
    def due(self) -> str:
        return f"{self.prefix}:runs:due"

    @property
    def finished(self) -> str:
        return f"{self.prefix}:runs:finished"

    @property
    def procs(self) -> str:
        return f"{self.prefix}:procs"

    @property
    def proc_prefix(self) -> str:
        return f"{self.prefix}:proc:"

    @property
    def snapshots(self) -> str:
        return f"{self.prefix}:snapshots"


class Keyspace:
    """The shards of one deployment's keys: one (the plain layout) or ``shards`` tagged ones."""

    def __init__(self, prefix: str, shards: int | None = None) -> None:
        self.prefix = prefix
        self.sharded = shards is not None
        if shards is None:
            self.shards: tuple[Shard, ...] = (Shard(prefix),)
        else:
            if not 1 <= shards <= MAX_SHARDS:
                raise ValueError(f"shards {shards}: use a whole number from 1 to {MAX_SHARDS}")
            self.shards = tuple(Shard(f"{{{prefix}:{n}}}") for n in range(shards))

    def of(self, run_id: str) -> Shard:
        """The shard holding ``run_id``'s keys and its index entries."""
        if len(self.shards) == 1:
            return self.shards[0]
        return self.shards[shard_of(run_id, len(self.shards))]

    @property
    def meta_key(self) -> str:
        """Where a cluster records its shard count (a hash, field ``shards``)."""
        return f"{{{self.prefix}}}:keyspace"

    def identity(self) -> tuple[Any, ...]:
        return (self.prefix, len(self.shards) if self.sharded else None)

    def claim(self, client: Any) -> int:
        """Record this keyspace's shard count on ``client``'s cluster if none is yet; the
        count recorded (which the caller compares with its own)."""
        client.hsetnx(self.meta_key, "shards", len(self.shards))
        return int(client.hget(self.meta_key, "shards"))
