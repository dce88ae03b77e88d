"""A SIGKILLed worker's runs move on long before its lease would expire.

Real worker subprocesses, real SIGKILLs, a real Redis (stores, and broker for the
first test) and a real RabbitMQ (the broker's fast path). Every lease here is 120 s,
so a run taken over before that — the assertion compares the take-over's event with
the dead owner's lease expiry, both from the store — was taken through the dead
process's lapsed liveness, never through the lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from store.runs import Lease
from tasks.context import Context
from tasks.recovery import sweep_orphans
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcess, WorkerProcesses, redis_context
from worker.app import make_app
from worker.settings import Settings

pytestmark = pytest.mark.slow

LONG_LEASE = {"RATCHET_LEASE_S": "120"}


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting until {what}")
        time.sleep(0.05)


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
def test_rabbitmq_redelivers_a_killed_workers_turn_and_it_takes_the_run_over_itself(
    worker_processes: WorkerProcesses,
    rabbitmq_vhost: str,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
) -> None:
    ctx = redis_context(redis_url, lease_s=120)
    broker = {"RATCHET_BROKER_URL": rabbitmq_vhost, **LONG_LEASE}
    # Given a worker in a long model call and a second worker on the same queue;
    # no sweeper runs in this test
    first = worker_processes.start("--pool", "prefork", "-c", "1", **broker)
    ready(first)
    run_id = create_run(ctx, slow_agent(tmp_path), "look B2").run_id
    sender = make_app(Settings(broker_url=rabbitmq_vhost))
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
