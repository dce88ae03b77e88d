"""The README's fleet commands, run as written: two workers on one host are two nodes."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workers import ROOT, logged_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def fleet_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Running a fleet", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "no sh block under 'Running a fleet'"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]


def test_the_readmes_worker_commands_give_two_workers_on_a_host_two_node_names(
    redis_url: str, tmp_path: Path
) -> None:
    workers = [
        shlex.split(line) for line in fleet_block() if line.startswith("celery -A worker worker")
    ]
    assert len(workers) >= 2, "the README should show two workers on one host"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        PYTHONPATH=str(ROOT),
        RATCHET_BROKER_URL=redis_url,
        RATCHET_SNAPSHOT_STORE=redis_url,
        RATCHET_RUN_STORE=redis_url,
        RATCHET_DATA_DIR=str(tmp_path / "data"),
    )
    started = []
    try:
        for index, argv in enumerate(workers[:2]):
            # The README's command as written, in this interpreter, with a small pool.
            command = [sys.executable, "-m", *argv, "--concurrency", "1"]
            started.append(logged_process(command, env, tmp_path / f"worker-{index}.log", cwd=ROOT))
        deadline = time.monotonic() + 120
        while True:
            status = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "worker", "status", "--timeout", "2"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if "2 nodes online" in status.stdout:
                break
            assert time.monotonic() < deadline, status.stdout + status.stderr
            time.sleep(1)
        logs = "".join(p.read_text() for p in tmp_path.glob("worker-*.log"))
        assert "DuplicateNodenameWarning" not in logs
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait(timeout=10)
