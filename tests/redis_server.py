"""A real ``redis-server`` for the test session, on a free port of 127.0.0.1.

Fixtures:

- ``redis_server`` (session): the running server; a test may ``kill()`` it
  (SIGKILL, like a crashed host) and ``restart()`` it on the same port.
- ``redis_url`` (function): a URL naming a logical database of its own
  (1-15, round-robin), flushed before the test gets it and after it ends.

Tests that need a server nobody else uses open one with
:func:`running_redis_server`. Nothing here binds or connects anywhere but
127.0.0.1. Servers run with AOF on (``--appendonly yes``, no RDB saves), as a
production store must: a worker refuses to start on a store without it
(worker/checks.py). ``kill()`` discards the AOF, so a killed server still comes
back empty, as a host that lost its disk would; ``appendonly=False`` starts a
server that keeps nothing, for the tests of that refusal.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0
DATABASES = range(1, 16)
"""Database 0 is left alone: a person poking at the server with redis-cli lands there."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _client(port: int, db: int = 0) -> redis.Redis:
    return redis.Redis(host=HOST, port=port, db=db, socket_timeout=5, retry=Retry(NoBackoff(), 0))


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not on PATH: the Redis tests start a real server; "
            "install it (`apt-get install redis-server`, or `brew install redis`) and run again",
            pytrace=False,
        )
    return binary


class RedisServer:
    """One ``redis-server`` process the tests own."""

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        appendonly: bool = True,
        args: tuple[str, ...] = (),
    ) -> None:
        self.directory = directory
        self.appendonly = appendonly
        self.args = args
        """More arguments for ``redis-server`` (``--replicaof host port``)."""
        self.port = port if port is not None else _free_port()
        self.url = f"redis://{HOST}:{self.port}"
        self.log = directory / "redis.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int:
        """The server's process id (benches read its CPU time); it must have started."""
        assert self._process is not None, "the server has not started"
        return self._process.pid

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        command = [
            _binary(),
            "--port", str(self.port),
            "--bind", HOST,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--dir", str(self.directory),
            "--databases", "16",
            "--daemonize", "no",
            *self.args,
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if not self.running:
                raise RuntimeError(
                    f"redis-server on port {self.port} exited at start:\n{self.log.read_text()}"
                )
            if _answers_ping(self.port):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"redis-server on port {self.port} did not answer PING within "
                    f"{START_TIMEOUT_S:g} s:\n{self.log.read_text()}"
                )
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server, as a crashed host would, and discard its AOF: its data is gone."""
        if self._process is not None:
            if self._process.poll() is None:
                os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait()
            self._process = None
        # Redis 7 keeps the AOF in a directory, Redis 6 in one file.
        shutil.rmtree(self.directory / "appendonlydir", ignore_errors=True)
        (self.directory / "appendonly.aof").unlink(missing_ok=True)

    def crash(self) -> None:
        """SIGKILL the server and start it again on the same port from its AOF: a crashed
        process whose host kept its disk (what ``kill()`` leaves out)."""
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait()
            self._process = None
        self.start()

    def pause(self) -> None:
        """SIGSTOP the server: it answers nothing and reads nothing until :meth:`resume`."""
        assert self._process is not None
        os.kill(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a server :meth:`pause` stopped."""
        assert self._process is not None
        os.kill(self._process.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Start again on the same port (killing the server first if it still runs)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
            self._process = None

    def flush(self) -> None:
        """Empty every database."""
        with _client(self.port) as client:
            client.flushall()

    def flush_db(self, db: int) -> None:
        with _client(self.port, db) as client:
            client.flushdb()


@contextmanager
def running_redis_server(directory: Path, appendonly: bool = True) -> Iterator[RedisServer]:
    """A server of one's own, stopped on exit."""
    server = RedisServer(directory, appendonly=appendonly)
    server.start()
    try:
        yield server
    finally:
        server.stop()


QUICK_SYNC = ("--repl-diskless-sync-delay", "0")
"""For servers that replicate: a full sync starts at once. Redis otherwise waits 5 s for more
replicas to share it (``repl-diskless-sync-delay``), a replica's first sync included."""


def replica_caught_up(primary: RedisServer, replica: RedisServer) -> bool:
    """Whether ``replica`` is linked to ``primary`` and has applied everything it wrote."""
    with _client(primary.port) as client:
        offset = client.info("replication")["master_repl_offset"]
    with _client(replica.port) as client:
        state = client.info("replication")
    linked = state.get("master_link_status") == "up"
    return linked and int(state.get("slave_repl_offset", -1)) >= int(offset)


def cut_off(primary: RedisServer, replica: RedisServer) -> None:
    """Stop ``replica`` (SIGSTOP) and have ``primary`` drop its link, so that nothing the
    primary writes from now on reaches it.

    SIGSTOP alone is not enough: the primary's stream keeps arriving in the stopped
    replica's socket buffer (on loopback, all of it), and the replica applies it on SIGCONT.
    With its link dropped while it is stopped, it cannot reconnect until it is resumed.
    """
    replica.pause()
    with _client(primary.port) as client:
        client.client_kill_filter(_type="replica")
        deadline = time.monotonic() + START_TIMEOUT_S
        while client.info("replication")["connected_slaves"]:
            assert time.monotonic() < deadline, "the primary kept its replica's link"
            time.sleep(0.01)


@contextmanager
def running_replicated_pair(directory: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and a replica of it, linked and in sync; both stopped on exit."""
    primary = RedisServer(directory / "primary", args=QUICK_SYNC)
    primary.directory.mkdir(parents=True)
    replica = RedisServer(
        directory / "replica", args=("--replicaof", HOST, str(primary.port), *QUICK_SYNC)
    )
    replica.directory.mkdir()
    try:
        primary.start()
        replica.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not replica_caught_up(primary, replica):
            assert time.monotonic() < deadline, "the replica did not sync with its primary"
            time.sleep(0.02)
        yield primary, replica
    finally:
        if replica.running:
            replica.resume()  # a paused server does not act on SIGTERM
        replica.stop()
        primary.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


_databases = itertools.cycle(DATABASES)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    # A test that killed the server and failed before restarting it must not
    # take every later test down with it.
    if not redis_server.running:
        redis_server.restart()
    db = next(_databases)
    redis_server.flush_db(db)
    yield f"{redis_server.url}/{db}"
    if not redis_server.running:
        redis_server.restart()
    redis_server.flush_db(db)
