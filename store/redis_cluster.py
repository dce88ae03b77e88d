"""Redis Cluster for the stores: one URL naming the cluster's nodes, parsed once.

::

    redis+cluster://[[user]:password@]host:port[,host:port…][/0][?shards=64]
    rediss+cluster://…  (TLS; ``&ssl_cert_reqs=…&ssl_ca_certs=…`` as redis-py reads them)

``host:port`` are nodes the client asks for the cluster's layout when it starts (port
6379 when left out); one is enough, several survive one being down. A cluster has only
database 0: ``/0`` may be written, any other number is refused. ``shards`` is how many
hash-tagged shards the stores spread their indexes over (:mod:`store.keyspace`); it is
fixed for a deployment (the cluster records it, and a client given another count
refuses to start).

redis-py's own ``RedisCluster.from_url`` takes one node (``redis://host:port``); the
list of several follows ``redis+sentinel://`` (:mod:`store.sentinel`). The Celery broker
cannot be a cluster: kombu has no Redis Cluster transport. Run the broker on its own
Redis (or RabbitMQ) beside a cluster that holds the stores.

``min_replicas`` (store/replicas.py) works on a cluster as on one server: the append
script and its ``WAIT`` go to the primary that owns the run's slot, on one connection
(:func:`on_slot_owner`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

from store.hosts import address, credentials, netloc
from store.keyspace import DEFAULT_SHARDS, MAX_SHARDS

SCHEMES = ("redis+cluster", "rediss+cluster")
FORM = "redis+cluster://[[user]:password@]host:port[,host:port…][/0][?shards=N]"
DEFAULT_PORT = 6379
OWNER_ATTEMPTS = 6
"""Tries of :func:`on_slot_owner` in all: enough to outlast a failover's moment of
refused connections and ``CLUSTERDOWN`` (store.retry then retries the whole call)."""
_OWNER_BACKOFF = ExponentialBackoff(cap=0.5, base=0.05)
_REFRESHING = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ClusterDownError)
_TLS_QUERY = ("ssl_cert_reqs", "ssl_ca_certs")
_CERT_REQS = ("none", "optional", "required")


def is_cluster(url: str) -> bool:
    return url.startswith(tuple(f"{scheme}://" for scheme in SCHEMES))


@dataclass(frozen=True)
class ClusterUrl:
    """A parsed ``redis+cluster://`` (or ``rediss+cluster://``) URL."""

    nodes: tuple[tuple[str, int], ...]
    """The nodes asked for the cluster's layout at start."""
    shards: int = DEFAULT_SHARDS
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ssl_cert_reqs: str | None = None
    ssl_ca_certs: str | None = None

    @classmethod
    def parse(cls, url: str) -> ClusterUrl:
        """ValueError naming what is wrong and the accepted form (never the password)."""
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"not a redis+cluster:// URL; use {FORM}")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        username, password = credentials(userinfo)
        nodes = tuple(address(h, "node", DEFAULT_PORT, FORM) for h in hosts.split(",") if h.strip())
        if not nodes:
            raise ValueError(f"name at least one node of the cluster (host:port); use {FORM}")
        path = [p for p in parts.path.split("/") if p]
        if path not in ([], ["0"]):
            raise ValueError(
                f"a Redis Cluster has only database 0, not `{'/'.join(path)}`; "
                f"keep deployments apart with RATCHET_REDIS_PREFIX; use {FORM}"
            )
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        tls = parts.scheme == "rediss+cluster"
        accepted = ("shards", *(_TLS_QUERY if tls else ()))
        unknown = sorted(set(query) - set(accepted))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}"
            )
        reqs = query.get("ssl_cert_reqs") or None
        if reqs is not None and reqs not in _CERT_REQS:
            raise ValueError(f"ssl_cert_reqs `{reqs}`: use one of {', '.join(_CERT_REQS)}")
        return cls(
            nodes,
            _shards(query.get("shards", str(DEFAULT_SHARDS))),
            username,
            password,
            tls,
            reqs,
            query.get("ssl_ca_certs") or None,
        )

    def client_kwargs(self) -> dict[str, Any]:
        """What redis-py's ``RedisCluster`` is given besides its nodes and socket options."""
        own: dict[str, Any] = {"username": self.username, "password": self.password}
        if self.tls:
            own.update(ssl=True, ssl_cert_reqs=self.ssl_cert_reqs, ssl_ca_certs=self.ssl_ca_certs)
        return {k: v for k, v in own.items() if v is not None}

    def shown(self) -> str:
        """The URL without its password, fit for a message."""
        user = f"{quote(self.username or '', safe='')}:***@" if self.password is not None else ""
        if self.username is not None and self.password is None:
            user = f"{quote(self.username, safe='')}@"
        hosts = ",".join(netloc(h, p) for h, p in self.nodes)
        scheme = SCHEMES[1] if self.tls else SCHEMES[0]
        return f"{scheme}://{user}{hosts}?shards={self.shards}"

    def identity(self) -> tuple[Any, ...]:
        """Which keyspace a client of this URL writes: the same for two URLs naming the
        same nodes (in any order), user and shards."""
        return ("cluster", frozenset(self.nodes), self.username, self.shards)


def _shards(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_SHARDS:
        raise ValueError(f"shards `{text}`: use a whole number from 1 to {MAX_SHARDS}")
    return int(text)


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
