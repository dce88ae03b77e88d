"""A Redis Cluster URL, parsed once: the nodes, the credentials, the shards.

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
list of several follows ``redis+sentinel://`` (:mod:`store.sentinel`). Reading a URL
imports no redis-py: the settings check every store URL, and the embedded default
must not pay for a client it does not use (:mod:`store.redis_cluster` is the client's
side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from store.hosts import address, credentials, netloc
from store.keyspace import DEFAULT_SHARDS, MAX_SHARDS

SCHEMES = ("redis+cluster", "rediss+cluster")
FORM = "redis+cluster://[[user]:password@]host:port[,host:port…][/0][?shards=N]"
DEFAULT_PORT = 6379
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
