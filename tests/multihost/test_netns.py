"""The fleet fixture itself: it says why it cannot run, and leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns import REASON_PROGRAM, network_fleet
from tests.workers import ROOT

pytestmark = pytest.mark.multihost


def ip_names(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_a_fleet_leaves_nothing_behind_even_when_its_test_fails(
    netns_machine: None, tmp_path: Path
) -> None:
    # Given a fleet with a host running a process
    with pytest.raises(RuntimeError, match="the test failed"), network_fleet(tmp_path) as fleet:
        host = fleet.add_host("a")
        sleeper = fleet.popen(host, ["sleep", "600"], dict(os.environ), tmp_path / "sleep.log")
        number = fleet.number
        assert f"ratchet-{number}-a" in ip_names("netns", "list")
        # When the test fails
        raise RuntimeError("the test failed")
    # Then its process is gone, and so are its namespaces and its veth
    assert sleeper.poll() is not None
    assert f"ratchet-{number}-" not in ip_names("netns", "list")
    assert f"rtnet{number}" not in ip_names("-o", "link", "show")


@pytest.mark.parametrize(
    ("wrapper", "path", "reason"),
    [
        (["unshare", "--user"], None, "network namespaces need root (running as uid 65534)"),
        (["unshare", "--user", "--map-root-user"], None, "`ip netns add` is not permitted here"),
        ([], "/nonexistent", "`ip` (iproute2) is not installed"),
    ],
    ids=["not-root", "not-permitted", "no-ip"],
)
def test_a_machine_that_cannot_run_a_fleet_is_told_exactly_why(
    netns_machine: None, wrapper: list[str], path: str | None, reason: str
) -> None:
    if wrapper and shutil.which(wrapper[0]) is None:
        pytest.fail(f"{wrapper[0]} (util-linux) is needed to build this case", pytrace=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": path or os.environ["PATH"]}
    found = subprocess.run(
        [*wrapper, sys.executable, "-c", REASON_PROGRAM],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert found.stdout.startswith(reason)
