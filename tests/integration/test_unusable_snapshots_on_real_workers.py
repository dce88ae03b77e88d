"""A real worker and the real sweeper, with the embedded stores on disk, meet damaged snapshots.

One run per kind of damage (tests/test_unusable_snapshots.py lists them), each
orphaned after its first turn with its snapshot file damaged. ``ratchet sweep
--once`` enqueues a resume of each; a ``celery -A worker worker`` subprocess
resumes every one of them from its events, sets each file aside, and finishes
the runs. None is refused, none dead-lettered, none left to loop.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runtime.models import RunStatus
from store.runs.sqlite import SqliteRunStore
from store.snapshots.file import FileSnapshotStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, turn, write_agent
from tests.test_unusable_snapshots import DAMAGES
from tests.workers import ROOT, WorkerProcesses, wait_for, worker_env

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_the_sweeper_and_a_real_worker_resume_every_run_whose_snapshot_is_unusable(
    redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    snapshots, runs = data / "snapshots", data / "runs.sqlite3"
    env = worker_env(redis_url, ledger, data)
    env.update(
        RATCHET_SNAPSHOT_STORE=f"file://{snapshots}",
        RATCHET_RUN_STORE=f"sqlite://{runs}",
        RATCHET_LEASE_S="1",
    )
    ctx = Context(Settings(lease_s=1), FileSnapshotStore(snapshots), SqliteRunStore(runs))
    agent = write_agent(
        tmp_path, [turn("look", call("lookup_order", order_id="B2")), turn("Done.")]
    )
    # Given one orphaned run per kind of damage, each one turn in, beside another run
    create_run(ctx, agent, "someone else's", run_id="other-run")
    damaged: dict[str, str] = {}
    for param in DAMAGES:
        damage, problem = param.values
        run_id = create_run(ctx, agent, "look up B2", run_id=f"run-{param.id}").run_id
        assert advance(ctx, run_id, None).outcome == "next"
        damage(snapshots, run_id, "other-run")  # type: ignore[operator]
        damaged[run_id] = str(problem)
    wait_for(
        "every damaged run is overdue",
        lambda: set(damaged) <= set(ctx.runs.overdue()),
        timeout_s=30,
    )
    processes = WorkerProcesses(env, tmp_path)
    try:
        worker = processes.start("--pool", "solo")
        # When the sweeper runs once
        swept = subprocess.run(
            ["ratchet", "sweep", "--once"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert swept.returncode == 0, swept.stderr
        assert set(damaged) <= set(swept.stdout.split())
        # Then the worker resumes every run from its events and finishes it
        wait_for(
            "every run completes",
            lambda: all(
                (r := ctx.runs.get(run_id)) is not None and r.status == RunStatus.COMPLETED
                for run_id in [*damaged, "other-run"]
            ),
            timeout_s=150,
        )
    finally:
        processes.stop_all()
    log = worker.log()
    assert "cannot rebuild one" not in log
    for run_id, problem in damaged.items():
        resumed = [e.data for e in ctx.runs.events(run_id) if e.type == "run.resumed"]
        assert resumed == [{"by": "sweeper", "attempt": 1}]
        # One WARNING naming the file and what was wrong; the file kept in quarantine
        warnings = [
            line for line in log.splitlines() if "WARNING" in line and f"run {run_id}:" in line
        ]
        assert len(warnings) == 1, warnings
        assert str(snapshots / f"{run_id}.head") in warnings[0] and problem in warnings[0]
        # the document, or (when head and transcript do not assemble) the head as it was
        aside = snapshots / "quarantine"
        assert len([*aside.glob(f"{run_id}.*.json"), *aside.glob(f"{run_id}.*Z.head")]) == 1
    assert ctx.runs.overdue() == []
    ctx.close()
