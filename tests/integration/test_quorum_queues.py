"""ratchet's queues as RabbitMQ quorum queues (RATCHET_TASK_DEFAULT_QUEUE_TYPE=quorum), on the real server.

Each test has a virtual host of its own. The fleet and crash tests run on quorum queues
too (tests/integration/test_team_fleet.py, tests/crash/test_liveness_on_real_workers.py);
here: what RabbitMQ holds once a worker has declared them, where a wait's wake-up sits
while it waits, and the refusal when RabbitMQ has the queues declared otherwise.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kombu import Connection

from runtime.models import RunStatus
from tasks.delivery import MAX_PRIORITY, declaration_refusal
from tasks.queues import queues
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, turn, write_agent
from tests.integration.test_limits_on_real_workers import wait_all
from tests.workers import WorkerProcess, WorkerProcesses, redis_context, wait_for, wait_until
from worker.app import make_app

pytestmark = pytest.mark.timeout(120)

QUORUM = {"RATCHET_TASK_DEFAULT_QUEUE_TYPE": "quorum"}
WAIT_S = 6


def listed(vhost_url: str) -> dict[str, tuple[str, int, int]]:
    """Each queue of the virtual host: (type, messages, messages unacknowledged)."""
    vhost = vhost_url.rsplit("/", 1)[1]
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost,
         "name", "type", "messages", "messages_unacknowledged"],
        capture_output=True, check=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    rows = [line.split("\t") for line in out.splitlines()[1:] if line.count("\t") == 3]
    return {name: (kind, int(ready), int(unacked)) for name, kind, ready, unacked in rows}


def delayed(queues_now: dict[str, tuple[str, int, int]]) -> int:
    """Messages Celery's native delayed delivery holds (its ``celery_delayed_*`` queues)."""
    return sum(n for name, (_, n, _) in queues_now.items() if name.startswith("celery_delayed_"))


def started(worker: WorkerProcess) -> None:
    wait_for("the worker is ready", lambda: worker.process.poll() is not None  # type: ignore[union-attr]
             or " ready." in worker.log())  # fmt: skip
    assert worker.process is not None and worker.process.poll() is None, worker.log()


def test_a_wait_on_quorum_queues_is_held_by_rabbitmq_not_by_a_worker_and_ends_on_time(
    worker_processes: WorkerProcesses,
    rabbitmq_vhost: str,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
) -> None:
    # Given a worker whose queues are quorum queues, and no beat (no sweeper to wake a run)
    ctx = redis_context(redis_url)
    worker = worker_processes.start(
        "--pool", "threads", "-c", "2", RATCHET_BROKER_URL=rabbitmq_vhost, **QUORUM
    )
    started(worker)
    # When a run waits 6 s
    agent = write_agent(
        tmp_path, [turn("Waiting.", call("wait", seconds=WAIT_S, reason="q")), turn("Done.")],
        tools=["wait"],
    )  # fmt: skip
    run_id = create_run(ctx, agent, "wait").run_id
    sender = make_app(Settings(broker_url=rabbitmq_vhost, task_default_queue_type="quorum"))
    sender.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")

    # Then its wake-up waits in RabbitMQ's delayed-delivery queues, and no worker holds it
    def holding_the_wake_up() -> dict[str, tuple[str, int, int]] | None:
        now = listed(rabbitmq_vhost)
        return now if delayed(now) else None

    now = wait_until("the wake-up is in a delayed queue", holding_the_wake_up)
    assert now["ratchet.control"][2] == 0, now
    # and ratchet's queues are quorum queues; Celery's pidbox (auto-delete) stays classic
    for name in ("ratchet.turns", "ratchet.control", "ratchet.continuations"):
        assert now[name][0] == "quorum", now
    pidboxes = [kind for name, (kind, _, _) in now.items() if name.endswith(".celery.pidbox")]
    assert pidboxes == ["classic"], now
    # And the wake-up ends the wait (the ETA's: no sweeper runs) and the run completes
    wait_for("the run completes", lambda: ctx.runs.get(run_id).status == RunStatus.COMPLETED)  # type: ignore[union-attr]
    events = ctx.runs.events(run_id)
    suspended = next(e for e in events if e.type == "run.suspended")
    woken = [e for e in events if e.type == "run.woken"]
    assert [e.data["by"] for e in woken] == ["timer"], worker.log()
    assert woken[0].at_ms >= suspended.at_ms + WAIT_S * 1000
    sender.close()
    ctx.close()


def test_a_quorum_worker_refuses_to_start_on_the_classic_queues_an_earlier_release_declared(
    worker_processes: WorkerProcesses, rabbitmq_vhost: str
) -> None:
    # Given RabbitMQ holding ratchet.turns as a classic worker declares it, with a turn in it
    with Connection(rabbitmq_vhost) as connection:
        classic_turns = queues(MAX_PRIORITY)[0](connection.default_channel)
        classic_turns.declare()
        connection.Producer().publish(
            {"waiting": "turn"}, exchange="ratchet.turns", routing_key="ratchet.turns"
        )
    # When a worker starts with quorum queues
    refused = worker_processes.start("--pool", "solo", RATCHET_BROKER_URL=rabbitmq_vhost, **QUORUM)
    # Then it exits at once with one line: RabbitMQ's reply and how to migrate
    assert refused.wait(timeout_s=60) == 2, refused.log()
    lines = [line for line in refused.log().splitlines() if "refusing to start" in line]
    assert len(lines) == 1, refused.log()
    assert "RabbitMQ refuses ratchet.turns as this worker declares it (a quorum queue" in lines[0]
    assert "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'ratchet.turns'" in lines[0]
    assert (
        "let ratchet.turns drain, delete it and its exchange (`rabbitmqctl delete_queue" in lines[0]
    )
    assert "or set RATCHET_TASK_DEFAULT_QUEUE_TYPE=classic to keep the queues" in lines[0]
    # and the classic queue and its turn are left as they were
    assert listed(rabbitmq_vhost)["ratchet.turns"] == ("classic", 1, 0)


def test_a_classic_app_is_refused_on_quorum_queues_naming_the_queue_type_to_keep(
    rabbitmq_vhost: str,
) -> None:
    # Given ratchet's queues declared as quorum queues (what a quorum worker's check leaves)
    quorum = make_app(Settings(broker_url=rabbitmq_vhost, task_default_queue_type="quorum"))
    classic = make_app(Settings(broker_url=rabbitmq_vhost))
    try:
        assert declaration_refusal(quorum) is None
        # When an app with classic queues checks them (a worker of an older configuration)
        refusal = declaration_refusal(classic)
    finally:
        quorum.close()
        classic.close()
    # Then RabbitMQ's reply is named, with both ways out
    assert refusal is not None
    assert "(a classic queue behind a direct exchange" in refusal
    assert "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'ratchet.turns'" in refusal
    assert "or set RATCHET_TASK_DEFAULT_QUEUE_TYPE=quorum to keep the queues" in refusal


def test_on_rabbitmq_3_quorum_queues_first_turns_queued_earlier_go_before_a_run_under_way(
    worker_processes: WorkerProcesses, rabbitmq_vhost: str, redis_url: str, tmp_path: Path
) -> None:
    # The classic-queue case is test_limits_on_real_workers.py's
    # test_a_turn_of_a_run_under_way_is_taken_before_first_turns_queued_earlier: there the
    # run under way finishes before any new run's first call. RabbitMQ 3.x quorum queues
    # have no priorities (4.0 gives them two levels, and this would change: docs/broker.md).
    with Connection(rabbitmq_vhost) as connection:
        version = str(connection.default_channel.connection.server_properties["version"])
    assert version.startswith("3."), f"RabbitMQ {version}: quorum queues have priorities now"
    settings = Settings(broker_url=rabbitmq_vhost, task_default_queue_type="quorum")
    ctx = redis_context(redis_url, broker_url=rabbitmq_vhost, task_default_queue_type="quorum")
    # Given a run under way (its first call made, in this process) and five new runs
    agent = write_agent(
        tmp_path, [turn("Looking.", call("lookup_order", order_id="A1")), turn("Done.")]
    )
    started = create_run(ctx, agent, "under way")
    done = advance(ctx, started.run_id, None)
    assert done.outcome == "next" and done.priority == 7
    new = [create_run(ctx, agent, f"new {i}") for i in range(5)]
    # When the five first turns are queued first, then the run under way's next turn at
    # its priority, and only then a worker with one slot starts
    client = make_app(settings)
    try:
        for state in new:
            client.send_task("ratchet.turn", (state.run_id, state.seq))
        client.send_task("ratchet.turn", (started.run_id, done.seq), priority=done.priority)
    finally:
        client.close()
    worker_processes.start("--pool", "solo", RATCHET_BROKER_URL=rabbitmq_vhost, **QUORUM)
    wait_all(ctx, [started.run_id] + [s.run_id for s in new], worker_processes)
    # Then the queue handed them over in the order they came: every new run made its
    # first call before the run under way finished
    finished = next(e.at_ms for e in ctx.runs.events(started.run_id) if e.type == "run.completed")
    firsts = [
        next(e.at_ms for e in ctx.runs.events(s.run_id) if e.type == "model.requested") for s in new
    ]
    assert finished > max(firsts), (finished, firsts)
    ctx.close()
