"""A Redis primary, its replica and three sentinels watching them, all on 127.0.0.1.

:func:`running_sentinel_group` starts them and waits until the sentinels agree on
the primary, know its replicas and each other; :meth:`SentinelGroup.fail_over` kills
the primary (SIGKILL, a lost host) and waits until the sentinels promote a replica.
Sentinels decide fast here (``down-after-milliseconds`` 500, a 2-second
``failover-timeout``) so that a test sees a failover in a few seconds.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.redis_server import (
    HOST,
    QUICK_SYNC,
    RedisServer,
    _answers_ping,
    _binary,
    _client,
    _free_port,
)

SERVICE = "ratchet-primary"
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 2000
QUORUM = 2


@dataclass
class Sentinel:
    directory: Path
    primary_port: int
    quorum: int = QUORUM
    port: int = field(default_factory=_free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "sentinel.conf"
        # Sentinel rewrites its config file as it learns (replicas, other sentinels, epochs).
        config.write_text(
            f"port {self.port}\n"
            f"bind {HOST}\n"
            f"dir {self.directory}\n"
            f"sentinel monitor {SERVICE} {HOST} {self.primary_port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        with open(self.directory / "sentinel.log", "ab") as log:
            self.process = subprocess.Popen(
                [_binary(), str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 10
        while not _answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sentinel on port {self.port} did not start:\n"
                    + (self.directory / "sentinel.log").read_text()
                )
            time.sleep(0.02)

    def client(self) -> redis.Redis:
        return _client(self.port)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@dataclass
class SentinelGroup:
    primary: RedisServer
    replica: RedisServer
    sentinels: list[Sentinel]
    others: list[RedisServer] = field(default_factory=list)
    """Replicas besides ``replica``, if the group was started with more than one."""

    @property
    def replicas(self) -> list[RedisServer]:
        return [self.replica, *self.others]

    def url(self, db: int = 0) -> str:
        """The ``redis+sentinel://`` URL of the group's database ``db``."""
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/{db}"

    def primary_port(self) -> int | None:
        """The port every sentinel names as the primary's, or None while they disagree."""
        named = set()
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                address = client.sentinel_get_master_addr_by_name(SERVICE)
            named.add(int(address[1]) if address else None)
        return named.pop() if len(named) == 1 else None

    def ready(self) -> bool:
        """The sentinels agree on the primary, see its replica synced, and know each other."""
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                state = client.sentinel_master(SERVICE)
                replicas = client.sentinel_slaves(SERVICE)
            if state.get("num-other-sentinels") != len(self.sentinels) - 1:
                return False
            for replica in self.replicas:
                if not any(r["port"] == replica.port and not r["is_sdown"] for r in replicas):
                    return False
        for replica in self.replicas:
            with _client(replica.port) as client:
                if client.info("replication").get("master_link_status") != "up":
                    return False
        return self.primary_port() == self.primary.port

    def promoted(self) -> RedisServer | None:
        """The replica every sentinel names as the primary, or None."""
        port = self.primary_port()
        return next((r for r in self.replicas if r.port == port), None)

    def fail_over(self, timeout_s: float = 20, then: Callable[[], None] | None = None) -> float:
        """SIGKILL the primary; wait until every sentinel names a replica. Seconds taken.

        ``then``: called once the primary is dead, before the wait (a test resumes a
        replica it stopped)."""
        started = time.monotonic()
        self.primary.kill()
        if then is not None:
            then()
        while (promoted := self.promoted()) is None:
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"the sentinels did not promote a replica in {timeout_s} s")
            time.sleep(0.05)
        with _client(promoted.port) as client:
            while client.info("replication").get("role") != "master":
                if time.monotonic() - started > timeout_s:
                    raise AssertionError("the replica was not told it is the primary")
                time.sleep(0.05)
        return time.monotonic() - started


@contextmanager
def running_sentinel_group(
    directory: Path, timeout_s: float = 20, replicas: int = 1, sentinels: int = 3
) -> Iterator[SentinelGroup]:
    """A primary, ``replicas`` replicas of it and ``sentinels`` sentinels (the quorum two,
    or one for a lone sentinel: it is ready sooner, not waiting to meet the others),
    ready; all stopped on exit."""
    # Each may sync replicas: the primary now, a promoted replica after a failover.
    primary = RedisServer(directory / "primary", args=QUICK_SYNC)
    primary.directory.mkdir(parents=True)
    primary.start()
    made = []
    for n in range(replicas):
        replica_dir = directory / ("replica" if n == 0 else f"replica-{n}")
        replica_dir.mkdir()
        made.append(
            RedisServer(replica_dir, args=("--replicaof", HOST, str(primary.port), *QUICK_SYNC))
        )
    group = SentinelGroup(primary, made[0], [], made[1:])
    try:
        for replica in group.replicas:
            replica.start()
        for n in range(sentinels):
            sentinel = Sentinel(directory / f"sentinel-{n}", primary.port, min(QUORUM, sentinels))
            group.sentinels.append(sentinel)
            sentinel.start()
        deadline = time.monotonic() + timeout_s
        while not group.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinel group was not ready within {timeout_s} s")
            time.sleep(0.1)
        yield group
    finally:
        for sentinel in group.sentinels:
            sentinel.stop()
        for replica in group.replicas:
            if replica.running:
                replica.resume()  # one a test left stopped ends on SIGTERM only once resumed
            replica.stop()
        primary.stop()
