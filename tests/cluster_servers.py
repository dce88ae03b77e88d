"""A real Redis Cluster for the test session: six ``redis-server --cluster-enabled yes``
on free ports of 127.0.0.1 (three primaries, a replica each), made one cluster by
``redis-cli --cluster create``.

Fixtures:

- ``redis_cluster`` (session): the running cluster, ready (``cluster_state:ok`` on
  every node). Its nodes run with AOF on, as every store's server must (worker/checks.py
  asks each node).
- ``cluster_prefix`` (function): a key prefix nobody else in the session uses. A cluster
  has only database 0, so tests are kept apart by prefix, not by database; the keys a
  test leaves stay until the session ends (the prefix is never used again).
"""

from __future__ import annotations

import itertools
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.redis_server import HOST, QUICK_SYNC, RedisServer, _client

NODES = 6
REPLICAS = 1
READY_TIMEOUT_S = 30.0
NODE_TIMEOUT_MS = 2000
"""How long a node is unreachable before the cluster counts it failed (a failover test
then waits about this long)."""


BUS_OFFSET = 10000
"""A cluster node also listens on its port + 10000 (the cluster bus), so its port is
at most 55535 and both must be free."""


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (and to port 0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _node_port(taken: set[int]) -> int:
    """A port for a node whose bus port is free too, and neither taken by another node.

    Both below the ephemeral range: a port found free there can be taken, before the node
    binds it, by any outgoing connection of the suite's (a bus port once was: the node
    exited at start, "Address already in use", and every cluster test of that run failed).
    """
    highest = min(_ephemeral_low(), 65536) - 1 - BUS_OFFSET
    while True:
        port = random.randint(10000, max(10000, highest))
        bus = port + BUS_OFFSET
        if taken.isdisjoint({port, bus}) and _free(port) and _free(bus):
            taken.update({port, bus})
            return port


@dataclass
class RedisClusterServers:
    """The nodes of one local cluster; ``url()`` names them all."""

    nodes: list[RedisServer]

    def url(self, shards: int | None = None) -> str:
        """The ``redis+cluster://`` URL of the cluster (every node), with ``shards=`` if given."""
        hosts = ",".join(f"{HOST}:{node.port}" for node in self.nodes)
        return f"redis+cluster://{hosts}" + (f"?shards={shards}" if shards else "")

    def ready(self) -> bool:
        """Every node says ``cluster_state:ok`` and knows every other node."""
        for node in self.nodes:
            if not node.running:
                return False
            with _client(node.port) as client:
                info = client.cluster("INFO")
            if not isinstance(info, dict):
                info = dict(
                    line.split(":", 1) for line in info.decode().splitlines() if ":" in line
                )
            if str(info.get("cluster_state")) != "ok":
                return False
            if int(info.get("cluster_known_nodes", 0)) != len(self.nodes):
                return False
        return True

    def serving(self) -> bool:
        """Every running node says ``cluster_state:ok`` (every slot has a live primary):
        what a test waits for after it killed a node."""
        for node in self.nodes:
            if node.running:
                with _client(node.port) as client:
                    if "cluster_state:ok" not in str(client.execute_command("CLUSTER", "INFO")):
                        return False
        return True

    def promote(self, replica: RedisServer) -> None:
        """Make ``replica`` a primary at once (``CLUSTER FAILOVER TAKEOVER``: no vote, no
        handshake with its primary, which may be dead) and wait until it says so."""
        with _client(replica.port) as client:
            client.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.role(replica) != "master":
            assert time.monotonic() < deadline, f"the node on port {replica.port} stayed a replica"
            time.sleep(0.02)

    def role(self, node: RedisServer) -> str:
        with _client(node.port) as client:
            return str(client.info("replication").get("role"))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ready within {timeout_s:g} s")
            time.sleep(0.1)

    def node(self, port: int) -> RedisServer:
        """The node listening on ``port``."""
        return next(node for node in self.nodes if node.port == port)

    def owner(self, key: str) -> RedisServer:
        """The primary that owns ``key``'s slot, as the cluster says now."""
        live = next(node for node in self.nodes if node.running)
        with _client(live.port) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            ranges = client.execute_command("CLUSTER", "SLOTS")
        for first, last, primary, *_ in ranges:
            if int(first) <= slot <= int(last):
                return self.node(int(primary[1]))
        raise AssertionError(f"no node owns slot {slot}")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        """The node configured as ``primary``'s replica (linked or not)."""
        for node in self.nodes:
            if node is primary or not node.running:
                continue
            with _client(node.port) as client:
                state = client.info("replication")
            if state.get("role") == "slave" and int(state.get("master_port", 0)) == primary.port:
                return node
        raise AssertionError(f"the node on port {primary.port} has no replica")

    def commandstats(self) -> dict[str, int]:
        """``INFO commandstats`` calls, summed over the primaries (command → calls)."""
        totals: dict[str, int] = {}
        for node in self.nodes:
            with _client(node.port) as client:
                if client.info("replication").get("role") != "master":
                    continue
                for name, stats in client.info("commandstats").items():
                    command = name.removeprefix("cmdstat_")
                    totals[command] = totals.get(command, 0) + int(stats["calls"])
        return totals


def _redis_cli() -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        pytest.fail(
            "redis-cli is not on PATH: the cluster tests make their cluster with "
            "`redis-cli --cluster create`; install redis-tools and run again",
            pytrace=False,
        )
    return binary


@contextmanager
def running_redis_cluster(
    directory: Path, node_timeout_ms: int = NODE_TIMEOUT_MS
) -> Iterator[RedisClusterServers]:
    """Six nodes made one cluster (three primaries, one replica each), ready; stopped on exit.

    ``node_timeout_ms``: how long a node is unreachable before the others count it failed
    (and its replica takes over)."""
    nodes: list[RedisServer] = []
    taken: set[int] = set()
    for n in range(NODES):
        node_dir = directory / f"node-{n}"
        node_dir.mkdir(parents=True)
        nodes.append(
            RedisServer(
                node_dir,
                port=_node_port(taken),
                args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(node_dir / "nodes.conf"),
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                    *QUICK_SYNC,
                ),
            )  # fmt: skip
        )
    cluster = RedisClusterServers(nodes)
    try:
        for node in nodes:
            node.start()
        made = subprocess.run(
            [
                _redis_cli(),
                "--cluster",
                "create",
                *(f"{HOST}:{node.port}" for node in nodes),
                "--cluster-replicas",
                str(REPLICAS),
                "--cluster-yes",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=60,
        )
        if made.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{made.stdout}{made.stderr}")
        cluster.wait_ready()
        yield cluster
    finally:
        for node in nodes:
            if node.running:
                node.resume()  # a paused server does not act on SIGTERM
            node.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    with running_redis_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


_prefixes = itertools.count()


@pytest.fixture
def cluster_prefix(redis_cluster: RedisClusterServers) -> str:
    return f"t{next(_prefixes)}"


def cluster_client(cluster: RedisClusterServers) -> redis.cluster.RedisCluster:
    """A plain redis-py cluster client (for a test's own look at the keys)."""
    return redis.cluster.RedisCluster(host=HOST, port=cluster.nodes[0].port)
