"""A tool that raises SystemExit or KeyboardInterrupt on a prefork worker: the call is a tool
error the model reads, the tool runs once, the pool process lives (runtime_io/tools.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.models import RunStatus
from tests.helpers import call, turn, write_agent
from tests.workers import ROOT, WorkerProcesses, redis_context, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.parametrize("tool", ["exits", "interrupts"])
def test_a_tool_raising_a_base_exception_is_an_error_result_and_runs_once(
    tool: str, redis_url: str, ledger: Path, tmp_path: Path, worker_processes: WorkerProcesses
) -> None:
    # Given a prefork worker and an agent whose tool raises `tool`'s BaseException
    booked = tmp_path / "tool.log"
    agent = write_agent(
        tmp_path / "agents",
        [turn("Looking.", call(tool, order_id="A1")), turn("The lookup failed.")],
        name="exiter",
        tools=[f"tests.exiting_tools:{tool}"],
    )
    worker_processes.start(
        "--pool", "prefork", "--concurrency", "1", RATCHET_TEST_TOOL_LOG=str(booked)
    )
    # When a run calls it
    env = worker_env(redis_url, ledger, tmp_path / "data")
    started = subprocess.run(
        [sys.executable, "-m", "worker", "runs", "start", str(agent), "--input", "go",
         "--run-id", f"exit-{tool}", "--wait", "--timeout", "90"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    # Then the run completes: the call was an error result the model read
    ctx = redis_context(redis_url)
    try:
        record = ctx.runs.get(f"exit-{tool}")
        assert record is not None and record.status == RunStatus.COMPLETED, record
        failed = [e for e in ctx.runs.events(record.run_id) if e.type == "tool.failed"]
        name = "SystemExit" if tool == "exits" else "KeyboardInterrupt"
        assert len(failed) == 1 and f"`{tool}` raised {name}" in failed[0].data["error"]
        assert record.recovery_attempts == 0
    finally:
        ctx.close()
    # and the tool ran exactly once
    assert booked.read_text().splitlines() == [f"{tool} A1"]
