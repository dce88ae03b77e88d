"""A durable timer on real workers: the worker that scheduled the wake-up is SIGKILLed.

Worker A runs the turn that suspends the run in a `wait` and enqueues its
wake-up (an ETA message A may itself be holding); A is killed during the wait.
Worker B consumes only the control queue, where beat's sweeper sees the timer
one sweep before its time and enqueues the wake-up again. The run must wake
within a second of its time, with default settings, and then complete on a
worker started afterwards.
"""

from __future__ import annotations

from contextlib import closing
from functools import partial
from pathlib import Path

import pytest

from runtime.models import RunStatus
from runtime.timers import wake_at_ms
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcesses, redis_context, running_beat
from tests.workers import wait_for as shared_wait_for
from worker.app import make_app

wait_for = partial(shared_wait_for, timeout_s=45)


@pytest.mark.timeout(120)
def test_a_run_waiting_3s_wakes_within_a_second_of_its_time_after_its_worker_was_killed(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    agent = write_agent(
        tmp_path,
        [turn("Waiting.", call("wait", seconds=3, reason="courier")), turn("Scanned.")],
        tools=["wait"],
    )
    ctx = redis_context(redis_url)
    # Given worker A (all queues), worker B (the control queue only) and beat, all on defaults
    a = worker_processes.start("--concurrency", "1")
    worker_processes.start("--concurrency", "1", "-Q", "ratchet.control")
    with running_beat(worker_processes.base_env, tmp_path), closing(ctx):
        # When a run on A asks to wait 3 s, and A is killed as soon as the run waits
        run_id = create_run(ctx, agent, "track P1").run_id
        client = make_app(Settings(broker_url=redis_url))
        client.send_task("ratchet.turn", (run_id, 1))
        client.close()
        wait_for("the run waits", lambda: _status(ctx, run_id) == RunStatus.WAITING)
        # (during the wait, not during the turn: a worker killed before its turn let go of
        # the lease is a crash mid-turn, recovered once the lease expires)
        wait_for("A's turn has let go of the run", lambda: ctx.runs.lease(run_id) is None)
        a.kill()
        record = ctx.runs.get(run_id)
        assert record is not None and record.suspension is not None
        wake_at = wake_at_ms(record.suspension)
        # Then B wakes it within a second of its time
        wait_for("the run wakes", lambda: _status(ctx, run_id) != RunStatus.WAITING)
        woken = [e for e in ctx.runs.events(run_id) if e.type == "run.woken"]
        assert len(woken) == 1 and woken[0].data["by"] == "timer"
        late_ms = woken[0].at_ms - wake_at
        assert 0 <= late_ms <= 1000, f"woke {late_ms} ms after its time"
        # and a worker that consumes turns completes it
        worker_processes.start("--concurrency", "1")
        wait_for("the run completes", lambda: _status(ctx, run_id) == RunStatus.COMPLETED)


def _status(ctx: object, run_id: str) -> RunStatus | None:
    record = ctx.runs.get(run_id)  # type: ignore[attr-defined]
    return record.status if record is not None else None
