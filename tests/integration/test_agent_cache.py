"""A worker's agent cache follows every file the binding covers, and says when only a restart helps.

Real ``celery -A worker worker`` subprocesses on a real Redis; runs are started
and swept with the CLI as subprocesses (each a fresh process, as an operator's).
"""

from __future__ import annotations

import json
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from tests.helpers import call, turn, write_agent
from tests.workers import ROOT, WorkerProcesses, ratchet_cli
from tests.workers import wait_for as shared_wait_for

wait_for = partial(shared_wait_for, timeout_s=90)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def ratchet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return ratchet_cli(env, *args)


def run_record(env: dict[str, str], run_id: str) -> dict[str, object]:
    done = ratchet(env, "runs", "show", run_id, "--json")
    assert done.returncode == 0, done.stderr
    shown: dict[str, object] = json.loads(done.stdout)
    return shown


def start_and_wait(env: dict[str, str], agent: Path, run_id: str) -> dict[str, object]:
    done = ratchet(
        env, "runs", "start", str(agent), "--input", "go", "--run-id", run_id,
        "--wait", "--timeout", "90", "--json",
    )  # fmt: skip
    record: dict[str, object] = json.loads(done.stdout)
    return record


def test_editing_only_the_script_is_followed_by_a_running_worker(
    worker_processes: WorkerProcesses, tmp_path: Path
) -> None:
    # Given a worker that has run an agent once
    agent = write_agent(tmp_path / "agents", [turn("first answer")], name="cache-desk")
    worker_processes.start("--pool", "solo")
    env = worker_processes.base_env
    first = start_and_wait(env, agent, "cache-1")
    assert (first["status"], first["output"]) == ("completed", "first answer"), first
    # When only the agent's script is edited (the .toml file is untouched)
    toml_before = agent.stat()
    script = agent.with_name("cache-desk.script.json")
    script.write_text(json.dumps({"turns": [turn("second, longer answer")]}))
    assert agent.stat().st_mtime_ns == toml_before.st_mtime_ns
    # Then a new run on the same worker plays the new script instead of stalling
    second = start_and_wait(env, agent, "cache-2")
    assert (second["status"], second["output"]) == ("completed", "second, longer answer"), second


TOOL_V1 = '''
def refund_one(order_id: str) -> str:
    """Refund one order."""
    return "refunded " + order_id
'''
TOOL_V2 = (
    TOOL_V1
    + '''

def refund_two(order_id: str) -> str:
    """Refund one order, the new way."""
    return "refunded twice " + order_id
'''
)


def test_a_tool_module_changed_on_disk_is_recorded_as_needing_a_worker_restart(
    worker_processes: WorkerProcesses, tmp_path: Path
) -> None:
    module = f"cache_tools_{time.monotonic_ns()}"
    tools_dir = tmp_path / "tools"
    tools_dir.mkdir()
    (tools_dir / f"{module}.py").write_text(TOOL_V1)
    env = {
        **worker_processes.base_env,
        "PYTHONPATH": f"{ROOT}:{tools_dir}",
        "RATCHET_LEASE_S": "1",
    }
    agents = tmp_path / "agents"

    def agent_using(function: str) -> Path:
        return write_agent(
            agents,
            [turn("calling", call(function, order_id="A1")), turn("done")],
            name="tool-desk",
            tools=[f"{module}:{function}"],
        )

    # Given a worker that imported the tool module for a run
    agent = agent_using("refund_one")
    worker = worker_processes.start("--pool", "solo", **env)
    assert start_and_wait(env, agent, "tools-1")["status"] == "completed"
    # When the module gains a function on disk and the agent is edited to use it
    (tools_dir / f"{module}.py").write_text(TOOL_V2)
    agent_using("refund_two")
    started = ratchet(env, "runs", "start", str(agent), "--input", "go", "--run-id", "tools-2")
    assert started.returncode == 0, started.stderr

    # Then the worker cannot take the run, and once the sweeper gives up on it the
    # recorded reason says that this worker must be restarted (not "restore the file")
    def given_up() -> bool:
        ratchet(env, "sweep", "--once")
        return run_record(env, "tools-2")["status"] == "dead_lettered"

    wait_for("the sweeper to give up on the run", given_up)
    reason = str(run_record(env, "tools-2")["error"])
    assert f"tool module `{module}`" in reason and "changed on disk" in reason, reason
    assert "restart that worker" in reason, reason
    assert "`ratchet runs resume tools-2`" in reason, reason  # the run's own command
    assert "restore it" not in reason
    # And after the restart the operator's resume completes it
    worker.kill()
    worker_processes.start("--pool", "solo", **env)
    resumed = ratchet(env, "runs", "resume", "tools-2")
    assert resumed.returncode == 0, resumed.stderr
    wait_for(
        "the resumed run to complete", lambda: run_record(env, "tools-2")["status"] == "completed"
    )
