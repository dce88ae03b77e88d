"""A Redis primary, its replica and three sentinels watching them, all on 127.0.0.1.

:func:`running_sentinel_group` starts them and waits until the sentinels agree on
the primary, know its replica and each other; :meth:`SentinelGroup.fail_over` kills
the primary (SIGKILL, a lost host) and waits until the sentinels promote the replica.
Sentinels decide fast here (``down-after-milliseconds`` 500, a 2-second
``failover-timeout``) so that a test sees a failover in a few seconds.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.redis_server import HOST, RedisServer, _answers_ping, _binary, _client, _free_port

SERVICE = "ratchet-primary"
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 2000
QUORUM = 2


@dataclass
class Sentinel:
    directory: Path
    primary_port: int
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
            f"sentinel monitor {SERVICE} {HOST} {self.primary_port} {QUORUM}\n"
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
            if not any(r["port"] == self.replica.port and not r["is_sdown"] for r in replicas):
                return False
        with _client(self.replica.port) as client:
            link = client.info("replication").get("master_link_status")
        return link == "up" and self.primary_port() == self.primary.port

    def fail_over(self, timeout_s: float = 20) -> float:
        """SIGKILL the primary; wait until every sentinel names the replica. Seconds taken."""
        started = time.monotonic()
        self.primary.kill()
        while self.primary_port() != self.replica.port:
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"the sentinels did not promote the replica in {timeout_s} s")
            time.sleep(0.05)
        with _client(self.replica.port) as client:
            while client.info("replication").get("role") != "master":
                if time.monotonic() - started > timeout_s:
                    raise AssertionError("the replica was not told it is the primary")
                time.sleep(0.05)
        return time.monotonic() - started


@contextmanager
def running_sentinel_group(directory: Path, timeout_s: float = 20) -> Iterator[SentinelGroup]:
    """A primary, a replica of it and three sentinels, ready; all stopped on exit."""
    primary = RedisServer(directory / "primary")
    primary.directory.mkdir(parents=True)
    primary.start()
    replica_dir = directory / "replica"
    replica_dir.mkdir()
    replica = RedisServer(replica_dir, args=("--replicaof", HOST, str(primary.port)))
    group = SentinelGroup(primary, replica, [])
    try:
        replica.start()
        for n in range(3):
            sentinel = Sentinel(directory / f"sentinel-{n}", primary.port)
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
        replica.stop()
        primary.stop()
