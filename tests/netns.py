"""Hosts on this machine: network namespaces on one bridge, for the multi-host tests.

A :class:`Fleet` is a private network ``10.231.<n>.0/24``: a *switch* namespace
holding a bridge, and one namespace per host, each joined to the bridge by a
veth pair (the host's end is its ``eth0``, with the address ``10.231.<n>.<k>``).
The test process itself is on the bridge too, through one veth of the root
namespace (``.1``), so it can reach every host and nothing else is routed there.
Processes are started on a host with ``ip netns exec``; they share this
machine's files, so a tool's side-effect log written on any host can be read
by the test.

- :meth:`Fleet.cut` takes a host's switch port down: its cable pulled. The host
  keeps running and sees no error, only silence (TCP retransmits into a link
  with no carrier), as a host behind a failed switch or a partition does.
  :meth:`Fleet.heal` brings the port back up.
- :meth:`Fleet.close` (also on every exit of :func:`network_fleet`) kills the
  process group of every process it started, deletes every namespace it made
  (which deletes their veths) and the root namespace's veth.

Parallel fleets do not collide: each holds an exclusive ``flock`` on a lock file
of its own subnet number for its whole life, and every name it makes carries
that number. Debris of a fleet whose process was SIGKILLed (its lock free, its
names still there) is removed by the next fleet that takes the same number.

:func:`netns_unavailable` says why this machine cannot run a fleet (not root,
no ``ip``, namespaces not permitted), for a skip that names the reason. With
``RATCHET_REQUIRE_NETNS=1`` (set by ``.ci/run``) the ``fleet`` fixture fails
instead of skipping: where the suite must prove the multi-host behaviour, it
never passes without running it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from tests.workers import logged_process

SUBNET = "10.231"
"""First two octets of every fleet's /24; the third is the fleet's number."""
NUMBERS = range(1, 255)
LOCK_DIR = Path(tempfile.gettempdir()) / "ratchet-netns"
REQUIRE_ENV = "RATCHET_REQUIRE_NETNS"
COMMAND_TIMEOUT_S = 20.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(
            f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}"
        )
    return done


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here (the exact reason), or None if they can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install iproute2"
    probe = f"ratchet-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    try:
        veth = _ip(
            "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False
        )
        if veth.returncode != 0:
            return f"veth pairs cannot be made in a namespace: {veth.stderr.strip()}"
        bridge = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"bridges cannot be made in a namespace: {bridge.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


REASON_PROGRAM = "from tests.netns import netns_unavailable; print(netns_unavailable())"
"""A program that prints :func:`netns_unavailable`'s answer (for checking it elsewhere)."""


@dataclass(frozen=True)
class Host:
    """One host of the fleet: a namespace with one address on the fleet's bridge."""

    name: str
    namespace: str
    address: str
    port: str
    """Its veth's end on the switch (in the switch namespace): what :meth:`Fleet.cut` downs."""

    def owns_pid(self, pid: int) -> bool:
        """Whether process ``pid`` lives in this host's network namespace."""
        try:
            theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return False
        return theirs == os.stat(f"/run/netns/{self.namespace}").st_ino


@dataclass
class Fleet:
    """A private network of hosts; build with :func:`network_fleet`."""

    number: int
    directory: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)
    _lock: IO[bytes] | None = None

    @property
    def switch(self) -> str:
        return f"ratchet-{self.number}-switch"

    @property
    def uplink(self) -> str:
        """The root namespace's veth onto the bridge (interface names are 15 bytes at most)."""
        return f"rtnet{self.number}"

    @property
    def observer_address(self) -> str:
        return f"{SUBNET}.{self.number}.1"

    def _namespace(self, role: str) -> str:
        name = f"ratchet-{self.number}-{role}"
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _build_switch(self) -> None:
        switch = self._namespace("switch")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        _ip(
            "link",
            "add",
            self.uplink,
            "type",
            "veth",
            "peer",
            "name",
            "p-observer",
            "netns",
            switch,
        )
        _ip("-n", switch, "link", "set", "p-observer", "master", "br0", "up")
        _ip("addr", "add", f"{self.observer_address}/24", "dev", self.uplink)
        _ip("link", "set", self.uplink, "up")

    def add_host(self, name: str) -> Host:
        """A new host ``name`` (letters and digits, up to 8) on the bridge."""
        if not (name.isalnum() and len(name) <= 8) or name in self.hosts or name == "switch":
            raise ValueError(f"host name {name!r}: up to 8 letters or digits, not yet used")
        namespace = self._namespace(name)
        address = f"{SUBNET}.{self.number}.{len(self.hosts) + 2}"
        port = f"p-{name}"
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", namespace)  # fmt: skip
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        host = Host(name, namespace, address, port)
        self.hosts[name] = host
        return host

    def cut(self, host: Host) -> None:
        """Pull the host's cable: its switch port goes down; nothing reaches it or leaves it."""
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "up")

    def popen(
        self,
        host: Host,
        argv: Sequence[str],
        env: dict[str, str],
        log: Path,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` in a process group of its own, output to ``log``."""
        process = logged_process(["ip", "netns", "exec", host.namespace, *argv], env, log, cwd=cwd)
        self.processes.append(process)
        return process

    def wait_for_port(self, host: Host, port: int, timeout_s: float = 20.0) -> None:
        """Until ``host`` accepts TCP connections on ``port`` (from the observer's link)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection((host.address, port), timeout=1):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{host.name} ({host.address}) did not accept connections on port "
                        f"{port} within {timeout_s:g} s: {exc}"
                    ) from exc
                time.sleep(0.05)

    def close(self) -> None:
        """Kill every process started here, delete every namespace and veth made here."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
        self.processes.clear()
        _remove_debris(self.number)
        self._namespaces.clear()
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _remove_debris(number: int) -> None:
    """Delete fleet ``number``'s namespaces and uplink (its lock must be held)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ", 1)[0]
        if name.startswith(f"ratchet-{number}-"):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
    _ip("link", "del", f"rtnet{number}", check=False)


def _kill_namespace_processes(namespace: str) -> None:
    # Only processes in a namespace of ours, left by a fleet that was SIGKILLed.
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _in_use(number: int) -> bool:
    prefix = f"{SUBNET}.{number}."
    addresses = _ip("-o", "-4", "addr", "show", check=False).stdout
    routes = _ip("-4", "route", "show", check=False).stdout
    return prefix in addresses or f"{SUBNET}.{number}.0/" in routes


def _take_number() -> tuple[int, IO[bytes]]:
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    start = os.getpid() % len(NUMBERS)
    for offset in range(len(NUMBERS)):
        number = NUMBERS[(start + offset) % len(NUMBERS)]
        lock = (LOCK_DIR / f"{number}.lock").open("ab")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        _remove_debris(number)
        if _in_use(number):  # someone else's network on this subnet: leave it alone
            lock.close()
            continue
        return number, lock
    raise RuntimeError(f"no free {SUBNET}.<n>.0/24 subnet for a test fleet")


@contextlib.contextmanager
def network_fleet(directory: Path) -> Iterator[Fleet]:
    """A fleet with its switch built and no hosts yet; everything it made is gone on exit."""
    number, lock = _take_number()
    fleet = Fleet(number, directory, _lock=lock)
    try:
        fleet._build_switch()
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def netns_machine() -> None:
    """Skip, with the exact reason, where namespaces cannot work (fail if REQUIRE_ENV=1)."""
    reason = netns_unavailable()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
        pytest.skip(f"multi-host test needs network namespaces: {reason}")


@pytest.fixture
def fleet(netns_machine: None, tmp_path: Path) -> Iterator[Fleet]:
    """A :class:`Fleet` for one test, gone afterwards (see :func:`netns_machine`)."""
    with network_fleet(tmp_path) as made:
        yield made
