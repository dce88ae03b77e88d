"""The stores on Redis Cluster: ``redis+cluster://`` URLs, one slot per script, a shard
count the cluster holds, and the AOF check on every node.

The conformance suites run on the session's cluster too (the ``redis-cluster`` backend of
tests/contract/conftest.py); real workers on it: tests/integration/test_cluster_fleet.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis.crc import key_slot

from runtime.errors import ConfigInvalid, StoreUrlInvalid
from runtime.models import RunStatus
from store import open_limit_store, open_run_store, open_snapshot_store
from store.cluster_url import ClusterUrl
from store.conformance.records import LEASE_S, event, new_run, record
from store.conformance.snapshots import make_state
from store.conformance.support import T0_MS
from store.keyspace import DEFAULT_SHARDS, shard_of
from store.snapshots.redis import where
from tasks.settings import Settings, load_settings
from tests.cluster_servers import RedisClusterServers, cluster_client
from tests.redis_server import HOST, _client, replica_caught_up
from tests.workers import wait_for

FULL = "rediss+cluster://ana:s%40cret@10.0.0.1:7000,10.0.0.2,[fd00::3]:7001/0?shards=32"


def test_a_cluster_url_names_its_nodes_credentials_and_shards() -> None:
    parsed = ClusterUrl.parse(FULL)

    assert parsed.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("fd00::3", 7001))
    assert (parsed.username, parsed.password, parsed.shards, parsed.tls) == (
        "ana", "s@cret", 32, True,
    )  # fmt: skip
    assert ClusterUrl.parse("redis+cluster://h").shards == DEFAULT_SHARDS
    assert where(FULL) == (
        "rediss+cluster://ana:***@10.0.0.1:7000,10.0.0.2:6379,[fd00::3]:7001?shards=32"
    )


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis+cluster://ana:s3cret@h:1/1", "only database 0, not `1`"),
        ("redis+cluster://ana:s3cret@", "name at least one node"),
        ("redis+cluster://ana:s3cret@h:port", "the port is not a number"),
        ("redis+cluster://ana:s3cret@h?shards=0", "shards `0`: use a whole number from 1"),
        ("redis+cluster://ana:s3cret@h?db=1", "unknown parameter(s) db"),
    ],
)
def test_a_malformed_cluster_url_is_refused_in_one_line_without_its_password(
    url: str, fragment: str
) -> None:
    with pytest.raises(StoreUrlInvalid) as refused:
        open_run_store(url)

    message = str(refused.value)
    assert fragment in message
    assert "s3cret" not in message and "\n" not in message


def test_a_cluster_is_refused_as_the_broker_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_BROKER_URL", "redis+cluster://h:7000")
    with pytest.raises(ConfigInvalid) as refused:
        load_settings()

    assert "kombu has no Redis Cluster transport" in str(refused.value)


def test_a_bad_cluster_store_url_is_refused_with_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_RUN_STORE", "redis+cluster://h:7000/3")
    with pytest.raises(ConfigInvalid) as refused:
        load_settings()

    assert "RATCHET_RUN_STORE" in str(refused.value)
    assert "only database 0" in str(refused.value)


def test_a_cluster_store_url_with_min_replicas_is_accepted_by_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The URL both stores are documented to share (docs/stores.md): min_replicas is ratchet's
    url = "redis+cluster://h:7000,h:7001?min_replicas=1&replica_timeout_ms=500"
    monkeypatch.setenv("RATCHET_RUN_STORE", url)
    monkeypatch.setenv("RATCHET_SNAPSHOT_STORE", url)
    settings = load_settings()
    assert settings.resolved_run_store == url
    # And a bad value of it is refused there, in one line
    monkeypatch.setenv("RATCHET_RUN_STORE", "redis+cluster://h:7000?min_replicas=lots")
    with pytest.raises(ConfigInvalid) as refused:
        load_settings()
    assert "min_replicas" in str(refused.value) and "\n" not in str(refused.value)


def _keys(client: Any, prefix: str) -> list[bytes]:
    """Every key of the stores under ``prefix``, on every primary."""
    return list(client.scan_iter(match=f"*{{{prefix}[:}}]*", count=1000))


def test_every_key_a_script_touches_is_in_the_slot_of_its_runs_shard(
    redis_cluster: RedisClusterServers, cluster_prefix: str
) -> None:
    # Given runs on a cluster store of 8 shards, each leased, moved on, snapshotted
    url = redis_cluster.url(shards=8)
    runs = open_run_store(url, redis_prefix=cluster_prefix)
    snapshots = open_snapshot_store(url, redis_prefix=cluster_prefix)
    ids = [f"run-{n}" for n in range(12)]
    for run_id in ids:
        new_run(runs, run_id)
        assert runs.acquire_lease(run_id, f"host:1:t/{run_id}", LEASE_S)
        moved = record(run_id, last_seq=2, status=RunStatus.TOOLS, due_at_ms=T0_MS + 60_000)
        runs.append(moved, [event(2)], owner=None)
        snapshots.save(make_state(run_id=run_id, seq=2), None)
    runs.renew_liveness("host:1:t", 5.0)
    client = cluster_client(redis_cluster)

    # Then every key is under one shard's tag, and the runs' keys with their index entries
    shards_used = set()
    for key in _keys(client, cluster_prefix):
        tag = key.decode().split("}", 1)[0] + "}"
        if tag == f"{{{cluster_prefix}}}":
            # The shard count, read when a store opens
            assert key.decode() == f"{{{cluster_prefix}}}:keyspace"
            continue
        assert tag.startswith(f"{{{cluster_prefix}:"), key  # no key outside the shards
        assert key_slot(key) == key_slot(tag.encode())
    for run_id in ids:
        shard = shard_of(run_id, 8)
        shards_used.add(shard)
        tag = f"{{{cluster_prefix}:{shard}}}"
        for index in ("runs:by_created", "runs:due", f"runs:status:{RunStatus.TOOLS.value}"):
            assert client.zscore(f"{tag}:{index}", run_id) is not None, (run_id, index)
        assert client.sismember(f"{tag}:snapshots", run_id)
        assert client.sismember(f"{tag}:proc:host:1:t:leases", run_id)
    # And the runs spread over several shards, whose indexes the store reads together
    assert len(shards_used) > 2
    assert {r.run_id for r in runs.list(RunStatus.TOOLS)} == set(ids)
    assert set(snapshots.list()) == set(ids)
    # And no transition pushes the next turn itself: the broker is never the cluster
    assert runs.commits_with(snapshots) and not runs.pushes_to({"host": HOST})
    client.close()
    runs.close()
    snapshots.close()


def test_a_store_given_another_shard_count_than_the_cluster_holds_refuses(
    redis_cluster: RedisClusterServers, cluster_prefix: str
) -> None:
    open_run_store(redis_cluster.url(shards=16), redis_prefix=cluster_prefix).close()

    with pytest.raises(StoreUrlInvalid) as refused:
        open_snapshot_store(redis_cluster.url(), redis_prefix=cluster_prefix)

    assert "keeps the `" + cluster_prefix + "` keys in 16 shards" in str(refused.value)
    assert f"this URL says shards={DEFAULT_SHARDS}" in str(refused.value)
    # Another prefix is another deployment, with a count of its own
    open_run_store(redis_cluster.url(), redis_prefix=f"{cluster_prefix}-b").close()


def test_a_limit_on_the_cluster_keeps_its_keys_in_one_slot(
    redis_cluster: RedisClusterServers, cluster_prefix: str
) -> None:
    runs = open_run_store(redis_cluster.url(), redis_prefix=cluster_prefix)
    limits = open_limit_store(runs, cluster_prefix)
    limits.block("openai", 1_000)
    limits.admit("openai", "run-1", 1, 2, [], [], 0, True)
    assert limits.acquire("cap", "run-1", 1).held
    client = cluster_client(redis_cluster)

    per_limit: dict[str, set[int]] = {}
    for key in client.scan_iter(match=f"{cluster_prefix}:*", count=1000):
        if b":limit:" in key or b":cap:" in key:
            name = key.decode().split("{", 1)[1].split("}", 1)[0]
            per_limit.setdefault(name, set()).add(key_slot(key))
    assert set(per_limit) == {"openai", "cap"}
    assert all(len(slots) == 1 for slots in per_limit.values())
    client.close()
    runs.close()


def _role(port: int) -> str:
    with _client(port) as client:
        return str(client.info("replication").get("role"))


def test_a_worker_refuses_a_cluster_whose_any_node_keeps_no_aof(
    redis_cluster: RedisClusterServers, cluster_prefix: str
) -> None:
    from worker.checks import store_persistence_problem

    settings = Settings(run_store=redis_cluster.url(), snapshot_store=redis_cluster.url())
    assert store_persistence_problem(settings) is None
    # A replica counts: after a failover it is a primary
    replica = next(node for node in redis_cluster.nodes if _role(node.port) == "slave")
    with _client(replica.port) as node:
        node.config_set("appendonly", "no")
        try:
            problem = store_persistence_problem(settings)
        finally:
            node.config_set("appendonly", "yes")

    assert problem is not None
    assert f"(node {HOST}:{replica.port})" in problem and "keeps no append-only file" in problem


def test_a_plain_redis_client_is_refused_a_cross_slot_script_the_cluster_never_gets(
    redis_cluster: RedisClusterServers,
) -> None:
    # The reason for the shards: the layout of one server puts a run's keys and the global
    # indexes in different slots, which a cluster refuses in one script.
    client = cluster_client(redis_cluster)
    with pytest.raises(redis.exceptions.RedisClusterException):
        client.eval("return 1", 2, "ratchet:run:{run-1}:record", "ratchet:runs:due")
    client.close()


# --- min_replicas: the append and its WAIT on the node that owns the run's slot ---------


def _waits(port: int) -> int:
    with _client(port) as client:
        return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_a_replicated_append_on_a_cluster_waits_on_the_primary_that_owns_the_runs_slot(
    redis_cluster: RedisClusterServers, cluster_prefix: str
) -> None:
    # Given a cluster store whose URL asks for one replica, and a run on it
    runs = open_run_store(f"{redis_cluster.url()}?min_replicas=1", redis_prefix=cluster_prefix)
    new_run(runs, "run-1")
    events_key = f"{{{cluster_prefix}:{shard_of('run-1', DEFAULT_SHARDS)}}}:run:{{run-1}}:events"
    owner = redis_cluster.owner(events_key)
    replica = redis_cluster.replica_of(owner)
    wait_for("the run's replica is in sync", lambda: replica_caught_up(owner, replica))
    before = {node.port: _waits(node.port) for node in redis_cluster.nodes}

    # When the journal of a call that is not idempotent is appended
    runs.append_replicated(
        record("run-1", last_seq=2, status=RunStatus.TOOLS),
        [event(2, "tool.requested", call_id="c1", name="issue_refund")],
        owner=None,
    )

    # Then the WAIT went to the run's primary, and to no other node
    after = {node.port: _waits(node.port) for node in redis_cluster.nodes}
    assert {port: after[port] - before[port] for port in after if after[port] != before[port]} == {
        owner.port: 1
    }
    # And it returned once the primary's replica held the event
    with _client(replica.port) as node:
        node.execute_command("READONLY")
        assert node.llen(events_key) == 2
    runs.close()


def test_a_replicated_append_whose_slot_table_is_out_of_date_follows_the_moved_reply(
    redis_cluster: RedisClusterServers, cluster_prefix: str
) -> None:
    # Given a cluster store that believes another primary owns the run's slot (as a client
    # does after a failover until a node tells it otherwise)
    runs = open_run_store(
        f"{redis_cluster.url()}?min_replicas=1&replica_timeout_ms=1000",
        redis_prefix=cluster_prefix,
    )
    new_run(runs, "run-1")
    cluster: Any = runs._client  # type: ignore[attr-defined]
    key = f"{{{cluster_prefix}:{shard_of('run-1', DEFAULT_SHARDS)}}}:run:{{run-1}}:events"
    owner = cluster.get_node_from_key(key)
    other = next(node for node in cluster.get_primaries() if node.name != owner.name)
    slot = cluster.keyslot(key)
    cluster.nodes_manager.slots_cache[slot] = [other]
    wrong = _waits(other.port)

    # When the journal of a call that is not idempotent is appended
    runs.append_replicated(
        record("run-1", last_seq=2, status=RunStatus.TOOLS),
        [event(2, "tool.requested", call_id="c1", name="issue_refund")],
        owner=None,
    )

    # Then the other primary answered MOVED (its WAIT ran too, counting nothing of ours),
    # and the append and its WAIT went to the owner: written once, the table put right
    assert _waits(other.port) == wrong + 1
    assert [e.seq for e in runs.events("run-1")] == [1, 2]
    assert cluster.get_node_from_key(key).name == owner.name
    runs.close()
