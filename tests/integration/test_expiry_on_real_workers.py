"""``max_suspended_s`` on real workers: beat's sweep is the only actor that expires a run.

A run asks a person for input under an agent with ``max_suspended_s = 2``; nobody
answers. A ``celery -A worker worker`` and a ``celery -A worker beat``, configured
only by the environment, must expire it (``run.expired``) within one sweep of the
moment it has waited longer than 2 s — on the embedded default (``filesystem://``
broker, SQLite stores) and on Redis. A late answer is then refused in one line.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.continuation import expires_at_ms
from runtime.fsm import rebuild
from runtime.models import RunStatus
from store import open_run_store
from store.runs import RunStore
from tasks.settings import Settings
from tests.helpers import call, turn, write_agent
from tests.workers import ROOT, WorkerProcesses, running_beat, wait_for, worker_env
from worker.exits import Exit

pytestmark = pytest.mark.timeout(180)

SWEEP_MS = 1000
"""The default ``RATCHET_SWEEP_INTERVAL_S``: how late beat's sweep may find a run."""
SLACK_MS = 500
"""The sweep's own time on a loaded 2-core box: the task's hop and one store write."""


@pytest.fixture(params=["embedded", "redis"])
def fleet(
    request: pytest.FixtureRequest, redis_url: str, ledger: Path, tmp_path: Path
) -> Iterator[tuple[WorkerProcesses, RunStore]]:
    data_dir = tmp_path / "data"
    env = worker_env(redis_url, ledger, data_dir)
    if request.param == "embedded":
        for name in ("RATCHET_BROKER_URL", "RATCHET_SNAPSHOT_STORE", "RATCHET_RUN_STORE"):
            del env[name]
        runs = open_run_store(Settings(data_dir=data_dir).resolved_run_store)
    else:
        runs = open_run_store(redis_url)
    processes = WorkerProcesses(env, tmp_path)
    try:
        yield processes, runs
    finally:
        processes.stop_all()
        runs.close()


def ratchet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "worker", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)


def test_a_run_waiting_past_max_suspended_s_expires_at_the_next_sweep_and_a_late_answer_is_refused(
    fleet: tuple[WorkerProcesses, RunStore], tmp_path: Path
) -> None:
    processes, runs = fleet
    env = processes.base_env
    agent = write_agent(
        tmp_path,
        [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")],
        extra="max_suspended_s = 2",
    )
    # Given a worker and beat, on the defaults but for where they keep their data
    processes.start("--concurrency", "1")
    with running_beat(env, tmp_path):
        # When a run asks a person for input, and nobody answers
        started = ratchet(env, "runs", "start", str(agent), "--input", "refund", "--wait")
        assert started.returncode == Exit.SUSPENDED, started.stdout + started.stderr
        run_id = started.stdout.split()[0]

        # Then beat's sweep expires it within one sweep of the moment it waited over 2 s
        # (on a loaded box it may have expired before the CLI's process even ended)
        wait_for("the run expires", lambda: _status(runs, run_id) == RunStatus.FAILED, 60)
        events = runs.events(run_id)
        expired = [e for e in events if e.type == "run.expired"]
        assert len(expired) == 1, [e.type for e in events]
        state = rebuild([e for e in events if e.seq < expired[0].seq])
        assert state is not None and state.status == RunStatus.NEEDS_USER_INPUT
        assert state.suspension is not None
        deadline_ms = expires_at_ms(state.suspension, 2)
        assert deadline_ms is not None
        late_ms = expired[0].at_ms - deadline_ms
        assert 0 <= late_ms <= SWEEP_MS + SLACK_MS, f"expired {late_ms} ms after its deadline"
        assert "max_suspended_s of 2" in expired[0].data["reason"]

        # And a late answer is refused, in one line
        late = ratchet(env, "runs", "continue", run_id, "--input", "Order B2")
        assert late.returncode == Exit.REFUSED, late.stdout + late.stderr
        assert late.stderr.count("\n") == 1 and f"run {run_id} is failed" in late.stderr
        assert [e.type for e in runs.events(run_id)][-1] == "run.expired"


def _status(runs: RunStore, run_id: str) -> RunStatus | None:
    record = runs.get(run_id)
    return record.status if record is not None else None
