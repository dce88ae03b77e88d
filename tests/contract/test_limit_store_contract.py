"""The LimitStore contract (:mod:`store.conformance.limits`) on every backend: memory,
SQLite, and Redis's Lua scripts, held to the same answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from store.conformance import LimitStoreContract
from store.limits import LimitStore
from store.limits.memory import MemoryLimitStore
from store.limits.redis import RedisLimitStore
from store.limits.sqlite import SqliteLimitStore


class TestLimitStores(LimitStoreContract):
    """Every test of the contract, once per backend."""

    @pytest.fixture(params=["memory", "sqlite", "redis", "redis-cluster"])
    def limit_store(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LimitStore]:
        if request.param == "memory":
            yield MemoryLimitStore()
        elif request.param == "sqlite":
            yield SqliteLimitStore(tmp_path / "limits.sqlite3")
        elif request.param == "redis":
            import redis

            client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
            yield RedisLimitStore(client, "t")
            client.close()
        else:
            # The limit store beside a run store on the cluster, as a worker opens it.
            from store import open_limit_store, open_run_store
            from tests.contract.conftest import cluster_prefix, cluster_url

            prefix = cluster_prefix(request)
            runs = open_run_store(cluster_url(request), redis_prefix=prefix)
            yield open_limit_store(runs, prefix)
            runs.close()
