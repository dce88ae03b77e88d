"""A turn keeps its lease while its agent loads for the first time in a worker process.

Loading an agent imports its tool modules and lists its MCP servers' tools, which can
take seconds; the turn holds the run's lease meanwhile, before its own heartbeat starts.
Without a renewal during the load, a lease shorter than the load expires: the worker
stops the turn ("no longer holds the run's lease") and the run waits for the sweeper.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.models import RunStatus
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcesses, run_on_workers


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_first_load_longer_than_the_lease_keeps_the_lease(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    # Given an agent whose tool module takes 2.5 s to import, and a worker with a 1 s lease
    agent = write_agent(
        tmp_path,
        [turn("Asking.", call("answer", question="why")), turn("Done.")],
        tools=["tests.slow_import_tools:answer"],
    )
    worker = worker_processes.start("--pool", "solo", RATCHET_LEASE_S="1")
    # When a run's first turn reaches that worker (no beat: nothing else would move it)
    record = run_on_workers(redis_url, agent, "go", timeout_s=60)
    # Then the worker kept the lease through the load and finished the run itself
    assert record.status == RunStatus.COMPLETED, worker.log()[-3000:]
    assert "no longer holds the run's lease" not in worker.log()
