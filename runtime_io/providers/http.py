"""One HTTP client per process, shared by every model provider and thread.

Sized from the worker's slots (``size_http_pool``, called at ``worker_init`` by
tasks/pool.py) and split into shards so that httpcore's pool stays cheap to scan.
"""

from __future__ import annotations

import math
import os
import ssl
import threading
from http.cookiejar import CookieJar, DefaultCookiePolicy

import certifi
import httpx

DEFAULT_HTTP_CONNECTIONS = 100
"""Connections the shared client opens at most unless a worker sized it (httpx's default)."""
SHARD_CONNECTIONS = 32
"""Connections per shard of the process's client. httpcore's pool rescans every
connection (twice, nested, with a poll of each idle socket) whenever a request
starts or ends: at 500 connections in one pool that cost more CPU than the turn.
Shards of 32 keep the scan small; each thread keeps to one shard."""

_http_size = DEFAULT_HTTP_CONNECTIONS
_clients: dict[int, list[httpx.Client]] = {}
_clients_lock = threading.Lock()
_shard_of_thread = threading.local()
_next_shard = 0


def size_http_pool(max_connections: int) -> None:
    """Let this process's shared client open ``max_connections`` at once (a worker: a slot
    each plus headroom). Call it before model calls start: a client made before is closed."""
    global _http_size
    if max_connections < 1:
        raise ValueError(f"max_connections must be 1 or more, not {max_connections}")
    with _clients_lock:
        _http_size = max_connections
        old = _clients.pop(os.getpid(), [])
    for client in old:
        client.close()


def pool_size() -> int:
    """Connections this process's shared client may open at once."""
    return _http_size


def shared_client() -> httpx.Client:
    """This process's HTTP client, shared by every provider and thread (a fork makes its own).

    One client keeps connections alive across turns instead of a TCP (and TLS)
    handshake per model call. It holds no secret — headers and timeouts go with
    each request — and keeps no cookies, so nothing a server sets reaches another run.
    Past SHARD_CONNECTIONS it is split into shards of that many connections (the
    limit, ``size_http_pool``, is shared out between them); a thread keeps to the
    shard it first drew, round-robin, so the shards fill evenly.
    """
    global _next_shard
    pid = os.getpid()
    shard = getattr(_shard_of_thread, "shard", None)
    with _clients_lock:
        clients = _process_clients(pid)
        if shard is None or shard[0] != pid:
            shard = (pid, _next_shard)
            _next_shard += 1
            _shard_of_thread.shard = shard
        return clients[shard[1] % len(clients)]


def build_shared_client() -> None:
    """Build this process's client now, if it is not built yet, without drawing a shard.

    A fresh process's first build loads the CA certificates (0.3-0.9 s on a loaded
    machine): done before a rate limit admits a call, so the admitted request goes at once.
    """
    with _clients_lock:
        _process_clients(os.getpid())


def _process_clients(pid: int) -> list[httpx.Client]:
    """The shards of ``pid``'s client, built on first use; call with ``_clients_lock`` held."""
    clients = _clients.get(pid)
    if clients is None:
        count = max(1, math.ceil(_http_size / SHARD_CONNECTIONS))
        # A share each, plus a little: threads draw shards evenly but not exactly.
        each = math.ceil(_http_size / count) + (SHARD_CONNECTIONS // 4 if count > 1 else 0)
        limits = httpx.Limits(max_connections=each, max_keepalive_connections=each)
        # One TLS context for every shard: each costs ~1 MiB of loaded CA certificates.
        tls = ssl.create_default_context(cafile=certifi.where())
        clients = _clients[pid] = [
            httpx.Client(
                limits=limits,
                verify=tls,
                cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            )
            for _ in range(count)
        ]
    return clients
