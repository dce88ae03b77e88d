"""The ``ratchet`` command with real workers: --wait exit statuses, --follow, resume outcomes.

``runs start --wait`` runs in-process (click's CliRunner) against the session
worker; ``runs events --follow`` and ``runs resume`` run as subprocesses, the
latter against ``celery -A worker worker`` subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from runtime.models import RunStatus
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import ROOT, WorkerProcesses, redis_context, wait_for_run
from worker.api import Ratchet
from worker.cli import main
from worker.exits import Exit

pytestmark = pytest.mark.timeout(180)

ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]


def start_and_wait(agent: Path, *extra: str) -> Result:
    args = ["runs", "start", str(agent), "--input", "refund B2", "--wait", *extra]
    return CliRunner().invoke(main, args)


# --- runs start --wait: one exit status per outcome (item 7) -----------------------


def test_wait_exits_with_a_status_per_outcome(ratchet: Ratchet, tmp_path: Path) -> None:
    done = start_and_wait(write_agent(tmp_path / "ok", [turn("Done.")]))
    assert done.exit_code == int(Exit.OK) == 0, done.output

    over_budget = write_agent(
        tmp_path / "failed",
        [turn("look", call("lookup_order", order_id="B2")), turn("Done.")],
        budgets={"max_turns": 1},
    )
    failed = start_and_wait(over_budget)
    assert failed.exit_code == int(Exit.FAILED) == 3, failed.output
    assert "status     failed" in failed.output

    asks = start_and_wait(write_agent(tmp_path / "ask", ASK))
    assert asks.exit_code == int(Exit.SUSPENDED) == 4, asks.output
    assert "status     needs_user_input" in asks.output

    slow = write_agent(tmp_path / "slow", [{**turn("Done."), "sleep_s": 3}])
    timed_out = start_and_wait(slow, "--timeout", "0.5")
    assert timed_out.exit_code == int(Exit.TIMEOUT) == 6, timed_out.output
    assert "is still" in timed_out.output


def test_wait_exits_5_for_a_run_that_stalled_and_needs_an_operator(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    # A first model call slow enough to change the agent under it: the next turn stalls.
    script = [
        {**turn("look", call("lookup_order", order_id="B2")), "sleep_s": 1.5},
        turn("Done."),
    ]
    agent = write_agent(tmp_path, script)
    outcome: dict[str, Result] = {}
    waiting = threading.Thread(
        target=lambda: outcome.setdefault("r", start_and_wait(agent, "--run-id", "stalls-1"))
    )
    waiting.start()
    wait_for_run(ratchet.ctx, "stalls-1", lambda r: r.usage.model_attempts == 1)
    agent.write_text(agent.read_text().replace("You are a test agent.", "You changed."))
    waiting.join(timeout=120)
    assert not waiting.is_alive()
    result = outcome["r"]
    assert ratchet.get("stalls-1").status == RunStatus.STALLED
    assert result.exit_code == int(Exit.OPERATOR) == 5, result.output


# --- runs events --follow (item 8) ----------------------------------------------


def cli_env(redis_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_RUN_STORE=redis_url,
        RATCHET_SNAPSHOT_STORE=redis_url,
        RATCHET_BROKER_URL=redis_url,
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def follow(run_id: str, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "worker", "runs", "events", run_id, "--follow", *extra],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(process: subprocess.Popen[str], marker: str) -> list[str]:
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} never came; got {lines}")


def test_follow_goes_on_through_a_suspension_until_the_run_finishes(
    ratchet: Ratchet, redis_url: str, tmp_path: Path
) -> None:
    run_id = ratchet.start(write_agent(tmp_path, ASK), "refund")
    wait_for_run(ratchet.ctx, run_id, lambda r: r.status.is_suspended)
    env = cli_env(redis_url)
    # With --until-suspended it stops at the suspension, exit 0.
    stops = follow(run_id, env, "--until-suspended")
    assert stops.communicate(timeout=60)[0].splitlines()[-1].split()[2] == "run.suspended"
    assert stops.returncode == 0
    # Without, it has printed the suspension and still follows when the answer comes.
    tails = follow(run_id, env)
    try:
        read_until(tails, "run.suspended")
        seq = ratchet.suspension(run_id).seq  # type: ignore[union-attr]
        ratchet.continue_run(run_id, input="Order B2", suspension_seq=seq)
        rest, _ = tails.communicate(timeout=60)
    finally:
        tails.kill()
    kinds = [line.split()[2] for line in rest.splitlines()]
    assert kinds[0] == "run.continued" and kinds[-1] == "run.completed", rest
    assert tails.returncode == 0


# --- runs resume: the worker's verdict (item 6) ----------------------------------


def resume(run_id: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", "runs", "resume", run_id, *extra],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_resume_reports_what_the_worker_did_and_exits_1_when_it_refused(
    worker_processes: WorkerProcesses,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tool module the operator's machine has but the workers do not.
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "deskonly.py").write_text("def ping(text: str) -> str:\n    return text\n")
    monkeypatch.syspath_prepend(str(tools))
    ctx = redis_context(redis_url)
    try:
        worker = worker_processes.start("--pool", "threads")
        fine = create_run(ctx, write_agent(tmp_path / "fine", [turn("Done.")]), "hi").run_id
        agent = write_agent(tmp_path / "odd", [turn("Done.")], name="odd", tools=["deskonly:ping"])
        odd = create_run(ctx, agent, "hi").run_id
        env = cli_env(redis_url, PYTHONPATH=f"{ROOT}{os.pathsep}{tools}")

        resumed = resume(fine, env, "--wait", "60", "--json")
        assert resumed.returncode == 0, (resumed, worker.log())
        assert json.loads(resumed.stdout)["outcome"] == "resumed"
        assert wait_for_run(ctx, fine, lambda r: r.status.is_terminal).status == RunStatus.COMPLETED

        refused = resume(odd, env, "--wait", "60")
        assert refused.returncode == 1, (refused, worker.log())
        assert "resume enqueued" not in refused.stdout
        assert f"run {odd} is queued: a worker refused to resume it" in refused.stderr
        assert "cannot be loaded" in refused.stderr
        assert ctx.runs.events(odd)[-1].type == "run.resume_refused"
    finally:
        ctx.close()


def test_resume_with_no_worker_says_none_took_it_and_exits_6(
    redis_url: str, tmp_path: Path, ledger: Path
) -> None:
    ctx = redis_context(redis_url)
    try:
        run_id = create_run(ctx, write_agent(tmp_path, [turn("Done.")]), "hi").run_id
        result = resume(run_id, cli_env(redis_url), "--wait", "1")
        assert result.returncode == Exit.TIMEOUT, result
        assert "no worker took it within 1s" in result.stderr
    finally:
        ctx.close()


# --- the demo (item 18) -------------------------------------------------------


def test_the_demo_summarises_before_its_worker_stops_and_keeps_one_log(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(tmp_path / "data"))
    for _ in range(2):
        demo = subprocess.run(
            [sys.executable, "-m", "worker", "demo"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert demo.returncode == 0, demo
    lines = demo.stdout.splitlines()
    summary = next(i for i, line in enumerate(lines) if ": completed in " in line)
    assert lines[-1] == "stopping the demo worker…" and summary < len(lines) - 1
    log = tmp_path / "data" / "demo-worker.log"
    assert log.read_text().count(" ready.") == 1  # this demo's worker only
    assert (tmp_path / "data" / "demo-worker.log.1").read_text().count(" ready.") == 1
