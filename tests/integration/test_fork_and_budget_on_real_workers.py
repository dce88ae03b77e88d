"""`ratchet runs fork` and `ratchet runs budget` from another process, on a real worker."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.models import RunStatus
from tests.helpers import call, refunds, turn, write_agent
from tests.workers import WorkerProcesses, ratchet_cli, start_example


def wait_until_finished(env: dict[str, str], run_id: str, log: Callable[[], str]) -> Any:
    deadline = time.monotonic() + 60
    while True:
        shown = cli(env, "runs", "show", run_id, "--json")
        record = json.loads(shown.stdout)
        if record["status"] in ("completed", "failed", "cancelled"):
            return record
        assert time.monotonic() < deadline, log()
        time.sleep(0.1)


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return ratchet_cli(env, *args, timeout_s=80)


@pytest.mark.timeout(120)
def test_a_fork_before_the_refund_runs_on_a_real_worker_and_says_it_refunds_again(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path
) -> None:
    # Given the example refund desk ran to completion on a real worker
    worker = worker_processes.start("--concurrency", "2", RATCHET_BROKER_URL=redis_url)
    env = {**worker_processes.base_env, "RATCHET_BROKER_URL": redis_url}
    started = start_example(env, "--json")
    assert started.returncode == 0, started.stderr + worker.log()
    original = json.loads(started.stdout)["run_id"]
    listed = cli(env, "runs", "events", original, "--json")
    events = [json.loads(line) for line in listed.stdout.splitlines()]
    asked = [
        e["seq"]
        for e in events
        if e["type"] == "model.responded"
        and any(c["name"] == "send_refund" for c in e["data"]["tool_calls"])
    ]
    assert len(asked) == 1, events
    # When an operator forks it where the model had asked for the refund
    forked = cli(env, "runs", "fork", original, "--at", str(asked[0]), "--run-id", "fork-b2")
    # Then the CLI says the fork refunds again, and the worker carries the fork to the end
    assert forked.returncode == 0, forked.stderr
    assert f"run fork-b2: forked from {original} at seq {asked[0]}" in forked.stdout
    assert "will run `send_refund`" in forked.stdout and "not idempotent" in forked.stdout
    record = wait_until_finished(env, "fork-b2", worker.log)
    assert record["status"] == RunStatus.COMPLETED.value, record
    assert refunds(ledger) == ["refund B2 2900", "refund B2 2900"]
    # and the original is as it was
    again = [
        json.loads(line)
        for line in cli(env, "runs", "events", original, "--json").stdout.splitlines()
    ]
    assert again == events


@pytest.mark.timeout(120)
def test_a_run_stopped_on_max_turns_completes_on_a_real_worker_after_a_top_up(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    # Given a run that a real worker stopped on max_turns 2
    agent = write_agent(
        tmp_path,
        [
            *(turn(f"look {n}", call("lookup_order", order_id="A1")) for n in range(3)),
            turn("Found A1."),
        ],
        budgets={"max_turns": 2},
    )
    worker = worker_processes.start("--concurrency", "1", RATCHET_BROKER_URL=redis_url)
    env = {**worker_processes.base_env, "RATCHET_BROKER_URL": redis_url}
    started = cli(
        env,
        "runs",
        "start",
        str(agent),
        "--input",
        "find A1",
        "--run-id",
        "topped",
        "--wait",
        "--timeout",
        "60",
        "--json",
    )
    assert json.loads(started.stdout)["status"] == "failed", started.stderr + worker.log()
    # When an operator gives it two more turns from another process
    raised = cli(
        env,
        "runs",
        "budget",
        "topped",
        "--max-turns",
        "+2",
        "--reason",
        "ticket 42",
        "--by",
        "operator:ana",
    )
    assert raised.returncode == 0, raised.stderr
    assert "budgets raised to max_turns 4, by operator:ana" in raised.stdout
    # Then the worker carries it on to completion, and its events hold the audit record
    record = wait_until_finished(env, "topped", worker.log)
    assert record["status"] == "completed", record
    assert record["output"] == "Found A1."
    events = [
        json.loads(line)
        for line in cli(env, "runs", "events", "topped", "--json").stdout.splitlines()
    ]
    audit = [e["data"] for e in events if e["type"] == "run.budget_raised"]
    assert audit == [
        {
            "by": "operator:ana",
            "reason": "ticket 42",
            "budgets": {"max_turns": 4},
            "was": {"max_turns": 2},
        }
    ]
