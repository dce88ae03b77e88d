"""Threads a turn uses: callers that bound model and tool calls, and one heartbeat.

Both are per process (a forked pool child makes its own) and reused, because a
thread per call or per turn costs more than most tool calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tasks.context import Context

log = logging.getLogger("ratchet.turn")

T = TypeVar("T")

_lock = threading.Lock()


class CallTimedOut(Exception):
    """A model or tool call did not return in time and was abandoned."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} did not return within {timeout_s:g} s and was abandoned")
        self.timeout_s = timeout_s


class _Callers:
    """Daemon threads that run model and tool calls, so a turn can stop waiting for one.

    Reused across calls (a thread per call costs more than most tool calls). A
    call that times out is abandoned, not stopped — Python cannot stop a thread —
    and its thread is written off; a fresh one takes its place, so abandoned calls
    never starve the next turn. Daemon threads never hold the process open at exit.
    """

    def __init__(self) -> None:
        self._idle: list[tuple[threading.Event, list[Any]]] = []
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        with self._lock:
            slot = self._idle.pop() if self._idle else self._spawn()
        wake, box = slot
        done = threading.Event()
        box[:] = [fn, done, None, None]
        wake.set()
        if not done.wait(timeout_s):
            box[0] = None  # the thread exits when (if ever) the call returns
            raise CallTimedOut(what, timeout_s)
        value, error = box[2], box[3]
        with self._lock:
            self._idle.append(slot)
        if error is not None:
            raise error
        result: T = value
        return result

    @staticmethod
    def _spawn() -> tuple[threading.Event, list[Any]]:
        wake = threading.Event()
        box: list[Any] = [None, None, None, None]

        def serve() -> None:
            while True:
                wake.wait()
                wake.clear()
                fn, done = box[0], box[1]
                try:
                    box[2], box[3] = fn(), None
                except BaseException as exc:  # handed to the waiting thread as is
                    box[2], box[3] = None, exc
                abandoned = box[0] is None
                done.set()
                if abandoned:
                    return

        threading.Thread(target=serve, name="ratchet-call", daemon=True).start()
        return wake, box


_callers_by_pid: dict[int, _Callers] = {}


def bounded(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``call`` on a caller thread; raise CallTimedOut if it takes over ``timeout_s``."""
    pid = os.getpid()
    with _lock:
        callers = _callers_by_pid.get(pid)
        if callers is None:
            callers = _callers_by_pid[pid] = _Callers()
    return callers.call(call, timeout_s, what)


class _Heartbeats:
    """One thread per process renews the lease of every turn in progress.

    Most turns end long before their first renewal is due, so a thread per turn
    would be started and joined for nothing.
    """

    def __init__(self) -> None:
        self._due: dict[tuple[str, str], tuple[Context, float]] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="ratchet-heartbeats", daemon=True).start()

    def add(self, ctx: Context, run_id: str, owner: str) -> tuple[str, str]:
        key = (run_id, owner)
        with self._changed:
            self._due[key] = (ctx, time.monotonic() + ctx.settings.lease_s / 3)
            self._changed.notify()
        return key

    def remove(self, key: tuple[str, str]) -> None:
        with self._changed:
            self._due.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._changed:
                now = time.monotonic()
                due = [(key, ctx) for key, (ctx, at) in self._due.items() if at <= now]
                for key, ctx in due:
                    self._due[key] = (ctx, now + ctx.settings.lease_s / 3)
                if not due:
                    wake = min((at for _, at in self._due.values()), default=now + 1.0)
                    self._changed.wait(max(0.0, wake - now))
                    continue
            for (run_id, owner), ctx in due:
                try:
                    if not ctx.runs.acquire_lease(run_id, owner, ctx.settings.lease_s):
                        log.warning("run %s: lease lost during the turn", run_id)
                except Exception:
                    log.exception("run %s: heartbeat failed", run_id)


_heartbeats_by_pid: dict[int, _Heartbeats] = {}


def heartbeats() -> _Heartbeats:
    """This process's heartbeat thread (a forked pool child starts its own)."""
    pid = os.getpid()
    with _lock:
        beats = _heartbeats_by_pid.get(pid)
        if beats is None:
            beats = _heartbeats_by_pid[pid] = _Heartbeats()
    return beats
