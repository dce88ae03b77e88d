"""A worker's Redis broker crashes and comes back while a turn is under way: the worker
carries on (before, it ended on an unrecoverable ``AttributeError`` in kombu's close)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.models import RunStatus
from tests.helpers import paced_lookups, write_agent
from tests.redis_server import running_redis_server
from tests.workers import status_is, swept_worker, wait_for_run

pytestmark = pytest.mark.slow


@pytest.mark.timeout(90)
def test_a_worker_carries_on_when_its_redis_broker_crashes_with_a_read_in_flight(
    tmp_path: Path, ledger: Path
) -> None:
    agent = write_agent(tmp_path / "agent", paced_lookups(4))
    with (
        running_redis_server(tmp_path) as server,
        swept_worker(tmp_path, ledger, f"{server.url}/0") as worker,
    ):
        ctx = worker.ctx
        # Given a worker (with beat's sweeper) taking a run's turns
        run_id = worker.under_way(agent, "x")

        # When Redis is SIGKILLed, its BRPOP in flight, and comes back from its AOF
        server.crash()

        # Then the same worker finishes the run
        wait_for_run(ctx, run_id, status_is(RunStatus.COMPLETED), timeout_s=45)
        assert worker.alive(), worker.process.log()
        assert "Unrecoverable error" not in worker.process.log()
