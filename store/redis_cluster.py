"""Redis Cluster for the stores: the client's side (its URL: :mod:`store.cluster_url`).

The Celery broker cannot be a cluster: kombu has no Redis Cluster transport. Run the
broker on its own Redis (or RabbitMQ) beside a cluster that holds the stores.

``min_replicas`` (store/replicas.py) works on a cluster as on one server: the append
script and its ``WAIT`` go to the primary that owns the run's slot, on one connection
(:func:`on_slot_owner`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

OWNER_ATTEMPTS = 6
"""Tries of :func:`on_slot_owner` in all: enough to outlast a failover's moment of
refused connections and ``CLUSTERDOWN`` (store.retry then retries the whole call)."""
_OWNER_BACKOFF = ExponentialBackoff(cap=0.5, base=0.05)
_REFRESHING = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ClusterDownError)


def on_slot_owner(
    client: redis.cluster.RedisCluster, key: str, commands: Sequence[Sequence[Any]]
) -> list[Any]:
    """``commands`` in one pipeline, on one connection to the primary that owns ``key``'s
    slot; their answers, in order (the first error answer raised).

    For a command that must follow another on its connection, such as ``WAIT`` (it counts
    the replicas that acknowledged the writes of the connection it is sent on): a cluster
    pipeline sends a keyless command to any node. Each command touches ``key``'s slot or
    no key at all.

    Across a failover or a moved slot it does what the cluster client does for one
    command, at most OWNER_ATTEMPTS times: a MOVED patches the slot table and goes to the
    node named; an ASK (a slot being migrated) goes there once, after ``ASKING``; a
    refused or lost connection, ``CLUSTERDOWN`` or ``TRYAGAIN`` refreshes the table after a
    short backoff. The last error is raised. The commands must be safe to send again: a
    connection lost after the node ran them runs them twice (the append script's fence
    refuses its second write).
    """
    cluster: Any = client  # redis-py's cluster module is untyped
    asked: Any = None
    for attempt in range(1, OWNER_ATTEMPTS + 1):
        node = asked or cluster.get_node_from_key(key)
        pipe: Any = cluster.get_redis_connection(node).pipeline(transaction=False)
        if asked is not None:
            pipe.execute_command("ASKING")
        for command in commands:
            pipe.execute_command(*command)
        try:
            answers: list[Any] = pipe.execute()
            return answers[1:] if asked is not None else answers
        except MovedError as exc:  # before AskError: a MOVED is an AskError to redis-py
            error: Exception = exc
            asked = None
            exc.host = exc.host or node.host  # a node may name the port alone
            cluster.nodes_manager.move_slot(exc)
        except AskError as exc:
            error = exc
            host = exc.host or node.host
            asked = cluster.get_node(host, exc.port) or _node(host, exc.port)
        except (*_REFRESHING, TryAgainError) as exc:
            error, asked = exc, None
            if attempt < OWNER_ATTEMPTS:
                time.sleep(_OWNER_BACKOFF.compute(attempt))
                refresh_layout(cluster)
    raise error


def _node(host: str, port: int) -> Any:
    return redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]


def refresh_layout(client: Any) -> None:
    """Ask the nodes of ``client`` (a ``RedisCluster``) for the slot table again; keep the
    old one if none answers.

    redis-py asks for a refresh after a refused connection and runs it later, once due;
    measured on redis-py 8.2, a client whose primary was killed and replaced kept sending
    to the dead node for the whole of store.retry's ~2 s (tests/integration/test_cluster_failover.py). A
    store's retry after a connection error so always finds the layout read again."""
    try:
        client.nodes_manager.initialize()
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
        pass  # the next attempt's error says what is wrong
