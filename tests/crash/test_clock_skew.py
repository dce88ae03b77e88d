"""Hosts whose clocks disagree still agree on leases, liveness and deadlines.

Real worker subprocesses and a real ``celery beat`` (the sweeper) on a real Redis,
some of them with their wall clock shifted (``RATCHET_TEST_CLOCK_OFFSET_S``: ratchet's
wall clock only; libfaketime, the real mechanism, makes Python's ``time.sleep`` fail
with EINVAL here, so it cannot run a worker).
Before the store's clock decided (store/clock.py), a sweeper 30 s ahead found a
live worker's runs overdue, a worker 30 s ahead took them as if their holder were
dead, and 5 of 8 runs parked "in flight when a worker stopped" though none stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.models import RunStatus
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcesses, redis_context, run_status, running_beat, wait_for
from worker.app import make_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUNS = 8


def shifted(offset_s: float) -> dict[str, str]:
    """The environment that shifts a process's wall clock by ``offset_s``, as ratchet reads
    it (``RATCHET_TEST_CLOCK_OFFSET_S``, tests only: libfaketime breaks Python's
    ``time.sleep`` with EINVAL). Celery's own clock (ETAs) is not shifted."""
    return {"RATCHET_TEST_CLOCK_OFFSET_S": str(offset_s)}


@pytest.fixture
def skewed_beat(worker_processes: WorkerProcesses, tmp_path: Path) -> Iterator[None]:
    """``celery -A worker beat`` (the crash sweeper, every second) 30 s ahead."""
    env = {**worker_processes.base_env, **shifted(30), "RATCHET_SWEEP_INTERVAL_S": "1"}
    with running_beat(env, tmp_path):
        yield


def test_a_worker_and_a_sweeper_30s_ahead_park_no_run(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path, skewed_beat: None
) -> None:
    # Given a worker on time and a worker and a sweeper 30 s ahead, on one Redis
    ctx = redis_context(redis_url)
    on_time = worker_processes.start("--pool", "threads", "-c", "4")
    ahead = worker_processes.start("--pool", "threads", "-c", "4", **shifted(30))
    agent = write_agent(
        tmp_path / "agent",
        [turn("charge", call("slow_charge", sleep_s=3)), turn("Charged.")],
        tools=["tests.slow_tools:slow_charge"],
    )
    # When 8 runs each make a 3 s call of a tool that is not idempotent
    sender = make_app(Settings(broker_url=redis_url))
    run_ids = [create_run(ctx, agent, f"charge {n}").run_id for n in range(RUNS)]
    for run_id in run_ids:
        sender.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")

    # Then every run completes; none was parked or taken from a live worker
    def finished() -> bool:
        return all(not run_status(ctx, r).is_live for r in run_ids)

    wait_for("every run stops", finished, timeout_s=150)
    statuses = {r: run_status(ctx, r) for r in run_ids}
    assert set(statuses.values()) == {RunStatus.COMPLETED}, (
        statuses, on_time.log()[-3000:], ahead.log()[-3000:]
    )  # fmt: skip
    for run_id in run_ids:
        types = [e.type for e in ctx.runs.events(run_id)]
        assert "run.resumed" not in types and types.count("tool.requested") == 1, types
    sender.close()
    ctx.close()


@pytest.mark.parametrize("offset_s", [7200, -90])
def test_a_worker_whose_clock_is_past_the_bound_refuses_to_start_naming_the_skew(
    worker_processes: WorkerProcesses, offset_s: float
) -> None:
    worker = worker_processes.start("--pool", "solo", **shifted(offset_s))
    assert worker.wait(timeout_s=60) == 2, worker.log()
    refusals = [line for line in worker.log().splitlines() if "refusing to start" in line]
    assert len(refusals) == 1, worker.log()
    way = "ahead of" if offset_s > 0 else "behind"
    seconds = str(abs(offset_s))
    assert f"this host's clock is {seconds}." in refusals[0], refusals
    assert f"s {way} the run store's (Redis TIME), past RATCHET_MAX_CLOCK_SKEW_S=60" in refusals[0]
