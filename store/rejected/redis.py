"""Rejected messages on a Redis broker: a capped list on the broker's database, newest first."""

from __future__ import annotations

from typing import Any

from store.rejected import MAX_ENTRIES, REDIS_KEY, Rejected, RejectedStore, read_entries


class RedisRejected(RejectedStore):
    def __init__(self, client: Any, owned: bool = False) -> None:
        self.client = client
        self.owned = owned
        kwargs = client.connection_pool.connection_kwargs
        self.where = f"the Redis list {REDIS_KEY} (db {kwargs.get('db', 0)})"

    def add(self, entry: Rejected) -> None:
        with self.client.pipeline() as pipe:
            pipe.lpush(REDIS_KEY, entry.dumps())
            pipe.ltrim(REDIS_KEY, 0, MAX_ENTRIES - 1)
            pipe.execute()

    def list(self, limit: int = 50) -> list[Rejected]:
        return read_entries(self.client.lrange(REDIS_KEY, 0, limit - 1))

    def purge(self) -> int:
        with self.client.pipeline() as pipe:
            pipe.llen(REDIS_KEY)
            pipe.delete(REDIS_KEY)
            count, _ = pipe.execute()
        return int(count)

    def close(self) -> None:
        if self.owned:
            self.client.close()
