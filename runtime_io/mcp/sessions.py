"""MCP sessions that outlive turns: one per server per worker process, on one event loop.

The ``mcp`` SDK is asynchronous; a turn is not. Each process runs one asyncio loop
on a native thread of its own, started at the first MCP call, and keeps there one
:class:`mcp.Client` per server (started lazily, reused by every turn and thread,
started again when its server died, closed when the process exits). A call from
a turn is a coroutine handed to that loop; the caller waits for it:

- **prefork and threads pools**: the caller blocks on a native lock (a thread of
  its own: the turn's tool caller, tasks/threads.py), bounded by the call's timeout;
- **gevent**: Celery patched ``threading`` before anything of ours loaded, so the loop
  thread is started with the *original* ``_thread`` and uses the original epoll
  selector (a patched one would look for a gevent hub on that thread), and a
  greenlet waits in gevent's native thread pool (``hub.threadpool``), so the
  hub keeps serving every other greenlet meanwhile.

A stdio server is spawned with the original ``os.posix_spawn`` on every pool
(gevent's ``Popen`` would need a child watcher on the loop thread, which only the main
thread's hub has), and spoken to through :mod:`runtime_io.mcp.pipes`. A forked pool
child makes its own loop and sessions (the pid is checked), never sharing its
parent's pipes or sockets.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from runtime.errors import CallNotSent

T = TypeVar("T")


class ServerUnavailable(CallNotSent):
    """The MCP server could not be reached, started or spoken to; the message names it."""


def _originals() -> tuple[Callable[..., Any], Callable[[], Any], Any]:
    """``start_new_thread``, ``allocate_lock`` and the epoll selector, as before any patching."""
    import _thread
    import selectors

    try:
        from gevent import monkey
    except ImportError:
        return _thread.start_new_thread, _thread.allocate_lock, selectors.DefaultSelector
    return (
        monkey.get_original("_thread", "start_new_thread"),
        monkey.get_original("_thread", "allocate_lock"),
        monkey.get_original("selectors", "DefaultSelector"),
    )


def _green() -> bool:
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey

    return bool(monkey.is_module_patched("threading"))


def _import_before_the_loop() -> None:
    """Import, on the caller's thread, what the loop imports lazily: under gevent an import
    on the loop thread runs patched code there (trio's, found by anyio and httpx2, spawns
    ``ldconfig`` through gevent's subprocess, which needs the main thread's hub)."""
    import importlib

    for name in (
        "anyio._backends._asyncio",
        "httpx2",
        "mcp.client.client",
        "mcp.client.streamable_http",
        "runtime_io.mcp.pipes",
        "trio",
    ):
        try:
            importlib.import_module(name)
        except ImportError:  # trio is optional: anyio only looks for it
            pass


class _Loop:
    """One asyncio loop on a native thread, and the sessions it holds."""

    def __init__(self) -> None:
        start_thread, self._lock_type, selector = _originals()
        _import_before_the_loop()

        self.loop = asyncio.SelectorEventLoop(selector())
        self.clients: dict[str, Any] = {}
        self.client_locks: dict[str, asyncio.Lock] = {}
        ready = self._lock_type()
        ready.acquire()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.release)
            self.loop.run_forever()

        start_thread(serve, ())
        ready.acquire()

    def run(self, make: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """Run ``make()`` on the loop; wait at most ``timeout_s`` (then ``TimeoutError``)."""
        done = self._lock_type()
        done.acquire()

        async def wrapped() -> T:
            return await asyncio.wait_for(make(), timeout_s)

        future = asyncio.run_coroutine_threadsafe(wrapped(), self.loop)
        future.add_done_callback(lambda _: done.release())
        if _green():
            import gevent

            gevent.get_hub().threadpool.apply(done.acquire, (True, timeout_s + 5.0))
        else:
            done.acquire(True, timeout_s + 5.0)
        if not future.done():
            future.cancel()
            raise TimeoutError(f"no answer within {timeout_s:g} s")
        return future.result()

    def close(self) -> None:
        async def close_all() -> None:
            for client in list(self.clients.values()):
                try:
                    await client.__aexit__(None, None, None)
                except Exception:  # a server already gone has nothing left to close
                    pass
            self.clients.clear()

        try:
            self.run(close_all, 5.0)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)


_loops: dict[int, _Loop] = {}
_loops_lock = threading.Lock()


def process_loop() -> _Loop:
    """This process's loop (a forked child starts its own)."""
    pid = os.getpid()
    loop = _loops.get(pid)
    if loop is None:
        with _loops_lock:
            loop = _loops.get(pid)
            if loop is None:
                loop = _loops[pid] = _Loop()
                atexit.register(loop.close)
    return loop


async def client_for(loop: _Loop, key: str, connect: Callable[[], Any]) -> Any:
    """The live client of server ``key`` on ``loop``, connecting it first if needed."""
    lock = loop.client_locks.setdefault(key, asyncio.Lock())
    async with lock:
        client = loop.clients.get(key)
        if client is None:
            client = connect()
            await client.__aenter__()
            loop.clients[key] = client
        return client


async def forget(loop: _Loop, key: str) -> None:
    """Drop server ``key``'s client (it failed): the next call connects afresh."""
    client = loop.clients.pop(key, None)
    if client is not None:
        try:
            await client.__aexit__(None, None, None)
        except Exception:  # a broken session's teardown may raise anything
            pass
