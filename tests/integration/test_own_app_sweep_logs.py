"""A team's own app keeps empty sweeps at DEBUG, as ratchet's app does (docs/celery.md).

Beat sends ``ratchet.sweep`` every second; on an idle fleet each one found nothing,
and Celery's received/succeeded lines and beat's "Sending due task" for it would be
about three INFO lines a second. The worker here logs at DEBUG, so the lines are
there to read: each must be at DEBUG, none at INFO.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.queues import CONTROL_QUEUE, TURNS_QUEUE
from tests.workers import WorkerProcesses, wait_for


@pytest.mark.timeout(120)
def test_a_team_apps_empty_sweeps_are_logged_at_debug_not_info(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    # Given a worker of the team's app with its beat inside, sweeping every 0.2 s
    worker = worker_processes.start(
        "-Q", f"{TURNS_QUEUE},{CONTROL_QUEUE}", "--concurrency", "1", "--loglevel", "DEBUG",
        "-B", "-s", str(tmp_path / "beat-schedule"),
        app="tests.fixtures.proj_app", PROJ_BROKER_URL=redis_url, RATCHET_SWEEP_INTERVAL_S="0.2",
    )  # fmt: skip

    def sweep_lines() -> list[str]:
        return [line for line in worker.log().splitlines() if "ratchet.sweep" in line]

    # When it has run three sweeps that found nothing
    wait_for(
        "three sweeps ran",
        lambda: sum("succeeded" in line for line in sweep_lines()) >= 3,
    )
    # Then every line about them is at DEBUG
    lines = sweep_lines()
    assert any("Sending due task ratchet.sweep" in line for line in lines), lines
    assert not [line for line in lines if " INFO/" in line], lines
