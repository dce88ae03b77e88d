"""One HTTP client per process, shared by every model provider and thread.

Sized from the worker's slots (``size_http_pool``, called at ``worker_init`` by
tasks/pool.py) and split into shards so that httpcore's pool stays cheap to scan.

**A call's deadline.** Inside ``with call_deadline(seconds):`` every request of the
calling thread (greenlet, in a gevent worker) ends by that time: each connect, write and
read on its sockets is given at most the time left (httpcore's network backend, the
seam it offers for this), a request waiting for a pooled connection waits at most that
long, and once it has passed the next socket operation raises :class:`DeadlineExceeded`.
A server that trickles its answer a byte at a time cannot hold the call longer, so a
provider can bound a whole call — retries and their pauses included — on the caller's
own thread, instead of handing it to another thread that is abandoned at the timeout.
One wait is not a socket's: a host name resolved for a new connection waits as long as
the system's resolver does.
"""

from __future__ import annotations

import math
import os
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import certifi
import httpcore
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
_proxied: dict[int, bool] = {}
"""By process: whether the environment named a proxy when its client was made."""
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
        _proxied.pop(os.getpid(), None)  # decided again with the next client
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
        _proxied[pid] = any(scheme != "no" for scheme in urllib.request.getproxies())
        clients = _clients[pid] = [
            httpx.Client(
                limits=limits,
                verify=tls,
                cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
                transport=_DeadlineTransport(tls, limits),
            )
            for _ in range(count)
        ]
    return clients


# --- a call's deadline ------------------------------------------------------------


class DeadlineExceeded(Exception):
    """The time :func:`call_deadline` gave a call ran out (its requests were cut off)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no answer within {seconds:g} s")
        self.seconds = seconds


_deadline = threading.local()  # greenlet-local in a gevent worker: threading is patched


@contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """Every request this thread makes in the block ends within ``seconds`` of its start
    (the module docstring); one past it raises :class:`DeadlineExceeded`. Nested, the
    sooner deadline holds."""
    outer: tuple[float, float] | None = getattr(_deadline, "current", None)
    mine = (time.monotonic() + seconds, seconds)
    _deadline.current = mine if outer is None or mine[0] < outer[0] else outer
    try:
        yield
    finally:
        _deadline.current = outer


def time_left() -> float | None:
    """Seconds left of this thread's :func:`call_deadline` (None: none is set); raises
    :class:`DeadlineExceeded` once it has passed."""
    current: tuple[float, float] | None = getattr(_deadline, "current", None)
    if current is None:
        return None
    left = current[0] - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(current[1])
    return left


def pause(seconds: float) -> None:
    """``time.sleep(seconds)``, ended by this thread's :func:`call_deadline` if that comes
    first (DeadlineExceeded, at the deadline): a provider's wait between attempts."""
    left = time_left()
    if left is None or seconds < left:
        time.sleep(seconds)
        return
    while True:  # time_left raises once the deadline has passed
        time.sleep(left)
        left = time_left() or 0.0


def bounds_calls() -> bool:
    """Whether :func:`call_deadline` bounds this process's requests: not when the
    environment named a proxy as the process's client was made, whose connections httpx
    makes without this module's network backend. httpx reads the proxies once, as a
    client is made, so this is decided then too, and not on every call (reading the
    environment's proxies costs ~40 µs)."""
    pid = os.getpid()
    proxied = _proxied.get(pid)
    if proxied is None:  # no client made yet in this process: make it, and so decide
        with _clients_lock:
            _process_clients(pid)
            proxied = _proxied[pid]
    return not proxied


def _within(timeout: float | None) -> float | None:
    left = time_left()
    return left if timeout is None or (left is not None and left < timeout) else timeout


class _Stream(httpcore.NetworkStream):
    """A socket stream whose every operation waits at most the deadline's time left."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _within(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _within(timeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        return _Stream(self._stream.start_tls(ssl_context, server_hostname, _within(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """httpcore's own synchronous backend, its streams bounded by the call's deadline."""

    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._backend.connect_tcp(
            host, port, _within(timeout), local_address, socket_options
        )
        return _Stream(stream)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        return _Stream(self._backend.connect_unix_socket(path, _within(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


_HTTPX_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    # Most specific first: httpx's own transport maps httpcore's errors the same way.
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextmanager
def _as_httpx() -> Iterator[None]:
    """httpcore's errors raised as the httpx errors they stand for (what callers catch)."""
    try:
        yield
    except Exception as exc:
        for theirs, ours in _HTTPX_ERRORS:
            if isinstance(exc, theirs):
                raise ours(str(exc)) from exc
        raise


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Iterable[bytes]) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx():
            yield from self._stream

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if callable(close):
            close()


class _DeadlineTransport(httpx.BaseTransport):
    """httpx's transport over httpcore's connection pool (a custom transport, the seam
    httpx offers), its network backend bounded by the call's deadline."""

    def __init__(self, tls: ssl.SSLContext, limits: httpx.Limits) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=tls,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        extensions = dict(request.extensions)
        left = time_left()
        if left is not None:
            # Waiting for a pooled connection is not a socket's wait: bounded here.
            timeouts = dict(extensions.get("timeout") or {})
            pool = timeouts.get("pool")
            timeouts["pool"] = left if pool is None else min(pool, left)
            extensions["timeout"] = timeouts
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=extensions,
        )
        with _as_httpx():
            answer = self._pool.handle_request(core)
        assert isinstance(answer.stream, Iterable)
        return httpx.Response(
            status_code=answer.status,
            headers=answer.headers,
            stream=_Body(answer.stream),
            extensions=answer.extensions,
        )

    def close(self) -> None:
        self._pool.close()
