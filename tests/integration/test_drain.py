"""``tests.drain.join`` waits for the workers' work, not for the clock."""

from __future__ import annotations

from pathlib import Path

from celery import Celery

from runtime.models import RunStatus
from tests.drain import join, queued
from tests.helpers import turn, write_agent
from worker.api import Ratchet


def test_join_returns_only_once_every_turn_sent_has_run_and_been_acknowledged(
    ratchet: Ratchet, session_app: Celery, tmp_path: Path
) -> None:
    # Given three runs whose model calls take a while, on a worker with two slots
    slow = [{**turn("thinking"), "sleep_s": 0.4}, {**turn("done"), "sleep_s": 0.4}]
    run_ids = [ratchet.start(write_agent(tmp_path / str(n), slow), "go") for n in range(3)]
    # When a test joins the workers
    join(session_app)
    # Then every turn has run: the runs are complete, nothing waits or is unacknowledged
    assert [ratchet.get(run_id).status for run_id in run_ids] == [RunStatus.COMPLETED] * 3
    assert queued(str(session_app.conf.broker_url)) == 0
