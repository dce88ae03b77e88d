"""A SIGKILLed worker's runs move on long before its lease would expire.

Real worker subprocesses, real SIGKILLs, a real Redis (stores, and broker for the
first test) and a real RabbitMQ (the broker's fast path). Every lease here is 120 s,
so a run taken over before that — the assertion compares the take-over's event with
the dead owner's lease expiry, both from the store — was taken through the dead
process's lapsed liveness, never through the lease.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.models import RunStatus
from store.runs import Lease
from tasks.context import Context
from tasks.recovery import sweep_orphans
from tasks.settings import QueueType, Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcess, WorkerProcesses, redis_context, wait_for
from worker.app import make_app

pytestmark = pytest.mark.slow

LONG_LEASE = {"RATCHET_LEASE_S": "120"}


def ready(worker: WorkerProcess) -> None:
    wait_for("the worker is ready", lambda: worker.process.poll() is not None  # type: ignore[union-attr]
             or " ready." in worker.log())  # fmt: skip
    assert worker.process is not None and worker.process.poll() is None, worker.log()


def slow_agent(tmp_path: Path) -> Path:
    return write_agent(
        tmp_path,
        [
            {**turn("look", call("lookup_order", order_id="B2")), "sleep_s": 60},
            turn("Done."),
        ],
        extra="model_timeout_s = 90",
    )


def held_in_a_model_call(ctx: Context, run_id: str) -> Lease:
    wait_for(
        "the model is asked",
        lambda: any(e.type == "model.requested" for e in ctx.runs.events(run_id)),
    )
    lease = ctx.runs.lease(run_id)
    assert lease is not None
    return lease


def taken_over(ctx: Context, run_id: str, lease: Lease) -> None:
    """The run was resumed, and by then the dead owner's lease had not expired."""
    wait_for(
        "the run is resumed",
        lambda: any(e.type == "run.resumed" for e in ctx.runs.events(run_id)),
    )
    resumed = next(e for e in ctx.runs.events(run_id) if e.type == "run.resumed")
    assert resumed.data["by"] == "sweeper"
    assert resumed.at_ms < lease.expires_at_ms - 60_000, (resumed.at_ms, lease)
    now = ctx.runs.lease(run_id)
    assert now is not None and now.owner != lease.owner


@pytest.mark.timeout(120)
def test_the_sweeper_takes_a_killed_workers_run_once_its_liveness_lapses(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    ctx = redis_context(redis_url, lease_s=120)
    # Given a prefork worker in a long model call, holding a 120 s lease
    first = worker_processes.start("--pool", "prefork", "-c", "1", **LONG_LEASE)
    run_id = create_run(ctx, slow_agent(tmp_path), "look B2").run_id
    sender = make_app(Settings(broker_url=redis_url))
    sender.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
    lease = held_in_a_model_call(ctx, run_id)

    # When the whole worker is SIGKILLed and another one runs
    first.kill()
    second = worker_processes.start("--pool", "solo", **LONG_LEASE)

    # Then the run is orphaned as soon as the dead child's liveness lapses
    wait_for("the run is orphaned", lambda: [o.run_id for o in ctx.runs.orphaned()] == [run_id])
    assert ctx.runs.orphaned()[0].owner == lease.owner
    assert ctx.runs.overdue() == []  # the lease alone would keep it for two minutes
    # and a sweep (the Redis broker gives nothing back) has it resumed by the second worker
    found = sweep_orphans(
        ctx,
        lambda run, seq: sender.send_task(
            "ratchet.resume", (run, "sweeper", seq), queue="ratchet.control"
        ),
    )
    assert found == [run_id]
    taken_over(ctx, run_id, lease)
    assert "whose process stopped renewing its liveness" in second.log()
    sender.close()
    ctx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_rabbitmq_redelivers_a_killed_workers_turn_and_it_takes_the_run_over_itself(
    worker_processes: WorkerProcesses,
    rabbitmq_vhost: str,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
    queue_type: QueueType,
) -> None:
    ctx = redis_context(redis_url, lease_s=120)
    broker = {
        "RATCHET_BROKER_URL": rabbitmq_vhost,
        "RATCHET_TASK_DEFAULT_QUEUE_TYPE": queue_type,
        **LONG_LEASE,
    }
    # Given a worker in a long model call and a second worker on the same queue (classic
    # or quorum); no sweeper runs in this test
    first = worker_processes.start("--pool", "prefork", "-c", "1", **broker)
    ready(first)
    run_id = create_run(ctx, slow_agent(tmp_path), "look B2").run_id
    sender = make_app(Settings(broker_url=rabbitmq_vhost, task_default_queue_type=queue_type))
    sender.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
    lease = held_in_a_model_call(ctx, run_id)
    second = worker_processes.start("--pool", "solo", **broker)
    ready(second)

    # When the first worker is SIGKILLed
    first.kill()

    # Then RabbitMQ redelivers the turn to the second worker, which waits for the dead
    # child's liveness to lapse and takes the run over there and then
    taken_over(ctx, run_id, lease)
    log = second.log()
    assert "whose process stopped renewing its liveness" in log
    assert "sweep:" not in log
    sender.close()
    ctx.close()


@pytest.mark.timeout(180)
def test_busy_workers_in_long_tool_calls_keep_their_runs_against_a_busy_sweeper(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    # A short soak (bench/soak.py is the long one). Given two prefork workers with the
    # default liveness (3 s) and a CPU hog beside them
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    ctx = redis_context(redis_url)
    sender = make_app(Settings(broker_url=redis_url))
    try:
        for _ in range(2):
            worker_processes.start("--pool", "prefork", "-c", "2")
        # and two runs (two slots stay free for resumes), each in a non-idempotent tool
        # call twice the liveness long, sleeping or spinning the CPU in the worker
        run_ids = []
        for i in range(2):
            agent = write_agent(
                tmp_path / f"a{i}",
                [turn("work", call(("slow_charge", "spin_charge")[i % 2], sleep_s=6.0)),
                 turn("Done.")],
                tools=["tests.slow_tools:slow_charge", "tests.liveness_tools:spin_charge"],
                extra="tool_timeout_s = 30",
            )  # fmt: skip
            run_ids.append(create_run(ctx, agent, "charge it").run_id)
            sender.send_task("ratchet.turn", (run_ids[-1], 1), queue="ratchet.turns")

        # When a sweeper sweeps every 0.2 s until they have all ended, and another process
        # tries to claim each run held by a worker
        taken: list[str] = []

        def ended() -> bool:
            sweep_orphans(
                ctx,
                lambda run, seq: sender.send_task(
                    "ratchet.resume", (run, "sweeper", seq), queue="ratchet.control"
                ),
            )
            for run_id in run_ids:
                lease = ctx.runs.lease(run_id)
                if lease is not None and ctx.runs.claim_lease(run_id, "probe:1:x/y", 60).taken:
                    taken.append(f"{run_id} from {lease.owner}")
                    ctx.runs.release_lease(run_id, "probe:1:x/y")
            time.sleep(0.15)
            return all(not status(ctx, run_id).is_live for run_id in run_ids)

        wait_for("every run ends", ended, timeout_s=150)
        assert taken == []

        # Then none was taken from its worker: all completed, none resumed or parked
        for run_id in run_ids:
            types = [e.type for e in ctx.runs.events(run_id)]
            assert status(ctx, run_id) == RunStatus.COMPLETED, types
            assert "run.resumed" not in types and "run.parked" not in types
        logs = "".join(w.log() for w in worker_processes.started)
        assert "whose process stopped renewing" not in logs
    finally:
        hog.kill()
        hog.wait()
        sender.close()
        ctx.close()


def status(ctx: Context, run_id: str) -> RunStatus:
    record = ctx.runs.get(run_id)
    assert record is not None
    return record.status
