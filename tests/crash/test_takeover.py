"""Real workers stopped in the ways real workers stop: SIGKILL, SIGSTOP (a zombie),
SIGTERM (a deploy), and a snapshot store that dies under them."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from contextlib import closing
from functools import partial
from pathlib import Path

import pytest
import redis

from runtime.errors import SnapshotFailed
from runtime.models import RunStatus
from runtime.recovery import OPERATOR
from store.runs import RunRecord
from store.runs.redis import RedisRunStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.context import Context
from tasks.recovery import resume
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.drain import join
from tests.helpers import call, turn, write_agent
from tests.redis_server import running_redis_server
from tests.workers import ROOT, WorkerProcesses, redis_context, run_status, running_beat
from tests.workers import wait_for as shared_wait_for
from worker.app import make_app

pytestmark = pytest.mark.slow

wait_for = partial(shared_wait_for, timeout_s=30)


def enqueue_turn(broker_url: str, run_id: str, seq: int) -> None:
    make_app(Settings(broker_url=broker_url)).send_task(
        "ratchet.turn", (run_id, seq), queue="ratchet.turns"
    )


def asking_the_model(ctx: Context, redis_url: str, agent: Path, text: str, who: str = "") -> str:
    """Create a run of ``agent``, send its first turn, and wait until its model is asked (by
    the worker ``who`` names, for the wait's message); its run id."""
    run_id = create_run(ctx, agent, text).run_id
    enqueue_turn(redis_url, run_id, 1)
    wait_for(
        f"{who or 'the worker'} asks the model",
        lambda: any(e.type == "model.requested" for e in ctx.runs.events(run_id)),
    )
    return run_id


def look_slowly(order_id: str, sleep_s: float, *then: dict[str, object]) -> list[dict[str, object]]:
    """A script whose first turn looks ``order_id`` up after a model call of ``sleep_s``,
    then ``then``'s turns (else one answering ``Found it.``)."""
    look = {**turn("look", call("lookup_order", order_id=order_id)), "sleep_s": sleep_s}
    return [look, *(then or [turn("Found it.")])]


def join_on(broker_url: str) -> None:
    """:func:`tests.drain.join` the workers on ``broker_url``, through an app of its own."""
    with closing(make_app(Settings(broker_url=broker_url))) as client:
        join(client)


def ratchet_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ratchet", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def model_calls(call_log: Path) -> list[int]:
    if not call_log.exists():
        return []
    return [json.loads(line)["turn"] + 1 for line in call_log.read_text().splitlines()]


@pytest.mark.timeout(90)
def test_a_killed_worker_is_swept_by_the_cli_and_another_worker_takes_the_run_over(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    refund = turn("refund", call("issue_refund", order_id="B2", amount_cents=2900))
    agent = write_agent(tmp_path, look_slowly("B2", 30, refund, turn("Refunded.")))
    ctx = redis_context(redis_url)
    # Given a worker in the middle of a long model call
    first = worker_processes.start("--pool", "solo", RATCHET_LEASE_S="1")
    run_id = asking_the_model(ctx, redis_url, agent, "refund B2")
    # When the whole worker is SIGKILLed and another starts
    first.kill()
    second = worker_processes.start("--pool", "solo", RATCHET_LEASE_S="1")
    # And `ratchet sweep --once` runs once the lease has expired
    wait_for("the lease expires", lambda: ctx.runs.overdue() == [run_id], timeout_s=10)
    swept = ratchet_cli(first.env, "sweep", "--once")
    assert swept.returncode == 0, swept.stderr
    assert run_id in swept.stdout
    # Then the second worker resumes it from the sweeper's message (the broker never
    # gives back a dead worker's message within the test) and asks the model again
    wait_for(
        "the run is resumed and the model asked again",
        lambda: (
            [e.type for e in ctx.runs.events(run_id)][-2:] == ["run.resumed", "model.requested"]
        ),
    )
    resumed = [e for e in ctx.runs.events(run_id) if e.type == "run.resumed"]
    assert resumed[0].data == {"by": "sweeper", "attempt": 1}
    assert "resumed by sweeper" in second.log()
    ctx.close()


@pytest.mark.timeout(90)
def test_a_frozen_worker_wakes_up_after_a_takeover_and_cannot_write(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, [{**turn("all done"), "sleep_s": 2.5}])
    ctx = redis_context(redis_url)
    beat_env = {**worker_processes.base_env, "RATCHET_SWEEP_INTERVAL_S": "0.5"}
    # Given worker A in a slow model call, frozen (SIGSTOP) past its 1 s lease
    zombie = worker_processes.start("--pool", "solo", RATCHET_LEASE_S="1")
    run_id = asking_the_model(ctx, redis_url, agent, "x", who="A")
    zombie.signal(signal.SIGSTOP)
    # When beat's sweeper hands the run to worker B, which finishes it
    with running_beat(beat_env, tmp_path):
        worker_processes.start("--pool", "solo", RATCHET_LEASE_S="1")
        wait_for("B completes the run", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED)
    finished = ctx.runs.events(run_id)
    record = ctx.runs.get(run_id)
    # And A wakes up
    zombie.signal(signal.SIGCONT)
    wait_for(
        "A's write is refused",
        lambda: (
            "this write is dropped" in zombie.log()
            or "no longer holds the run's lease" in zombie.log()
        ),
        timeout_s=15,
    )
    # Then its writes were refused and, once A has given up its turn, the finished run is untouched
    join_on(redis_url)
    assert ctx.runs.events(run_id) == finished
    assert ctx.runs.get(run_id) == record
    assert [e.data["by"] for e in finished if e.type == "run.resumed"] == ["sweeper"]
    assert [e.type for e in finished].count("model.responded") == 1
    ctx.close()


@pytest.mark.timeout(90)
def test_sigterm_ends_the_turn_at_a_boundary_and_another_worker_goes_on_at_once(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, look_slowly("A1", 1.5))
    ctx = redis_context(redis_url)
    # Given a worker with a 60 s lease in the middle of a model call
    leaving = worker_processes.start("--pool", "solo", RATCHET_LEASE_S="60")
    run_id = asking_the_model(ctx, redis_url, agent, "look A1")
    # When it is told to stop (a deploy), and a new worker starts
    started = time.monotonic()
    leaving.signal(signal.SIGTERM)
    worker_processes.start("--pool", "solo", RATCHET_LEASE_S="60")
    # Then the run completes long before the lease could have expired, with no sweeper
    wait_for(
        "the run completes", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED, timeout_s=30
    )
    assert time.monotonic() - started < 30
    assert leaving.wait(10) == 0
    assert "worker shutting down; stopping at seq" in leaving.log()
    types = [e.type for e in ctx.runs.events(run_id)]
    assert "run.resumed" not in types
    assert types.count("model.responded") == 2 and types.count("tool.completed") == 1
    ctx.close()


@pytest.mark.timeout(90)
def test_a_snapshot_store_killed_mid_run_stalls_the_run_and_resume_continues_it(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, look_slowly("B2", 1.0))
    call_log = tmp_path / "calls.log"
    with running_redis_server(tmp_path) as snapshot_server:
        snapshots_url = f"{snapshot_server.url}/0"
        ctx = Context(
            Settings(),
            RedisSnapshotStore.from_url(snapshots_url),
            RedisRunStore.from_url(redis_url),
        )
        env = {"RATCHET_SNAPSHOT_STORE": snapshots_url, "RATCHET_SCRIPTED_CALL_LOG": str(call_log)}
        worker = worker_processes.start("--pool", "solo", **env)
        run_id = asking_the_model(ctx, redis_url, agent, "look B2")
        # When the snapshot store's server dies while the model answers
        snapshot_server.kill()
        # Then the checkpoint fails after bounded retries: the run is stalled, nothing chained
        wait_for("the run stalls", lambda: run_status(ctx, run_id) == RunStatus.STALLED)
        record = ctx.runs.get(run_id)
        assert record is not None and record.error is not None
        assert f"ratchet runs resume {run_id}" in record.error
        join_on(redis_url)  # the stalled turn ended and chained nothing
        assert ctx.runs.events(run_id)[-1].type == "run.stalled"
        assert "SnapshotFailed" in worker.log()
        # When the server is back (empty: it kept nothing) and an operator resumes
        snapshot_server.restart()
        resumed = ratchet_cli(worker.env, "runs", "resume", run_id)
        assert resumed.returncode == 0, resumed.stderr
        # Then the run is rebuilt from its events and completes, the model not asked again
        wait_for("the run completes", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED)
        assert model_calls(call_log) == [1, 2]
        types = [e.type for e in ctx.runs.events(run_id)]
        assert types.count("run.resumed") == 1 and types.count("tool.completed") == 1
        ctx.close()


def test_a_failed_snapshot_write_leaves_the_previous_snapshot_intact_and_chains_nothing(
    redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    agent = write_agent(
        tmp_path,
        [
            turn("look", call("lookup_order", order_id="B2")),
            turn("again", call("lookup_order", order_id="A1")),
            turn("done"),
        ],
    )
    with running_redis_server(tmp_path) as snapshot_server:
        ctx = Context(
            Settings(),
            RedisSnapshotStore.from_url(f"{snapshot_server.url}/0"),
            RedisRunStore.from_url(redis_url),
        )
        run_id = create_run(ctx, agent, "look").run_id
        assert advance(ctx, run_id, 1).outcome == "next"
        before = ctx.snapshots.load_document(run_id)
        admin = redis.Redis(host="127.0.0.1", port=snapshot_server.port)
        # Given the snapshot server turned read-only (a primary demoted by a failover)
        admin.execute_command("REPLICAOF", "127.0.0.1", "1")
        try:
            # When the next turn checkpoints
            with pytest.raises(SnapshotFailed, match="the run stays at its previous state"):
                advance(ctx, run_id, None)
            # Then the previous snapshot is intact and the run is stalled
            assert ctx.snapshots.load_document(run_id) == before
            assert run_status(ctx, run_id) == RunStatus.STALLED
        finally:
            admin.execute_command("REPLICAOF", "NO", "ONE")
            admin.close()
        # And resuming after the store is healed continues from there
        assert resume(ctx, run_id, OPERATOR).outcome == "completed"
        record: RunRecord | None = ctx.runs.get(run_id)
        assert record is not None and record.usage.model_turns == 3
        ctx.close()
