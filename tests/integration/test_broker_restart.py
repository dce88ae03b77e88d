"""A worker's Redis broker crashes and comes back while a turn is under way: the worker
carries on (before, it ended on an unrecoverable ``AttributeError`` in kombu's close)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.models import RunStatus
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.redis_server import running_redis_server
from tests.workers import WorkerProcesses, redis_context, wait_for, worker_env
from worker.app import make_app

pytestmark = pytest.mark.slow


@pytest.mark.timeout(90)
def test_a_worker_carries_on_when_its_redis_broker_crashes_with_a_read_in_flight(
    tmp_path: Path, ledger: Path
) -> None:
    lookups = [
        {**turn(f"look {n}", call("lookup_order", order_id=f"A{n}")), "sleep_s": 0.4}
        for n in range(4)
    ]
    agent = write_agent(tmp_path / "agent", [*lookups, {**turn("Done."), "sleep_s": 0.4}])
    with running_redis_server(tmp_path) as server:
        url = f"{server.url}/0"
        ctx = redis_context(url)
        env = worker_env(
            url, ledger, tmp_path / "data", RATCHET_LEASE_S="2", RATCHET_SWEEP_INTERVAL_S="0.5"
        )
        workers = WorkerProcesses(env, tmp_path)
        try:
            # Given a worker (with beat's sweeper) taking a run's turns
            worker = workers.start(
                "--pool", "threads", "--concurrency", "4", "-B", "-s", str(tmp_path / "beat")
            )  # fmt: skip
            run_id = create_run(ctx, agent, "x").run_id
            make_app(Settings(broker_url=url)).send_task(
                "ratchet.turn", (run_id, 1), queue="ratchet.turns"
            )
            wait_for(
                "the run is two turns in",
                lambda: sum(e.type == "model.responded" for e in ctx.runs.events(run_id)) >= 2,
                timeout_s=30,
            )

            # When Redis is SIGKILLed, its BRPOP in flight, and comes back from its AOF
            server.crash()

            # Then the same worker finishes the run
            def completed() -> bool:
                record = ctx.runs.get(run_id)
                return record is not None and record.status == RunStatus.COMPLETED

            wait_for("the run completes", completed, timeout_s=45)
            assert worker.process is not None and worker.process.poll() is None, worker.log()
            assert "Unrecoverable error" not in worker.log()
        finally:
            workers.stop_all()
            ctx.close()
