"""Long timers hold nothing (issue 30, item 6), on a real worker and beat.

A worker holds an ETA message unacknowledged until its time. On Redis, kombu gives
a message held past the visibility timeout to a worker again, and the first keeps
its copy: three runs waiting 3,000 s held 6 copies after 90 s, 12 after 210 s. A
wait longer than half the broker's redelivery horizon is now not an ETA message:
the sweeper's due index wakes it. Here the visibility timeout is 6 s (an ETA may
last 3 s), and kombu's restore is run every loop of the test as a worker's timer
would run it.
"""

from __future__ import annotations

import base64
import json
import subprocess
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import pytest
import redis

from runtime.models import RunStatus
from runtime.timers import wake_at_ms
from store.runs import RunStore
from tasks.broker.transport import RatchetConnection
from tasks.context import Context
from tasks.delivery import MAX_PRIORITY
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcesses, redis_context, run_status, running_beat, wait_for
from worker.app import make_app

pytestmark = pytest.mark.slow

VISIBILITY_S = 6
SHORT_ENV = {"RATCHET_VISIBILITY_TIMEOUT_S": str(VISIBILITY_S), "RATCHET_TURN_TIME_LIMIT_S": "5"}


def held_wakes(client: redis.Redis) -> list[str]:
    """The run ids of the ``ratchet.wake`` messages in kombu's unacked hash (held by a worker)."""
    runs = []
    held: dict[bytes, bytes] = client.hgetall("unacked")  # type: ignore[assignment]
    for value in held.values():
        envelope = json.loads(value)[0]
        if envelope["headers"]["task"] == "ratchet.wake":
            _, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
            runs.append(kwargs["run_id"])
    return runs


def beat(
    worker_processes: WorkerProcesses, tmp_path: Path, **env: str
) -> AbstractContextManager[object]:
    """``celery -A worker beat`` (the sweeper every second), with the workers' environment."""
    return running_beat({**worker_processes.base_env, **env}, tmp_path)


WAITS = {"long": 3000, "short": 2, "medium": 9}
"""Seconds each run waits: beyond, within and beyond an ETA horizon of 3 s."""


def start_waits(ctx: Context, broker_url: str, tmp_path: Path) -> dict[str, str]:
    """Start one run per entry of WAITS, each asking to wait that long; their ids."""
    run_ids = {}
    sender = make_app(Settings(broker_url=broker_url))
    for name, seconds in WAITS.items():
        agent = write_agent(
            tmp_path / name,
            [turn("Waiting.", call("wait", seconds=seconds, reason=name)), turn("Done.")],
            tools=["wait"],
        )
        run_ids[name] = create_run(ctx, agent, name).run_id
        sender.send_task("ratchet.turn", (run_ids[name], 1))
    sender.close()
    return run_ids


def shorter_ones_fire_on_time(ctx: Context, run_ids: dict[str, str]) -> None:
    """The 2 s wait (by its ETA) and the 9 s one (by the sweeper's) end within 1 s of
    their time, and their runs complete."""
    for name in ("short", "medium"):
        run_id = run_ids[name]
        wait_for(f"{name} completes", partial(completed, ctx, run_id), timeout_s=60)
        late_ms = woken_late_ms(ctx.runs, run_id, WAITS[name])
        assert 0 <= late_ms <= 1000, f"{name} woke {late_ms} ms after its time"


def completed(ctx: Context, run_id: str) -> bool:
    return run_status(ctx, run_id) == RunStatus.COMPLETED


def woken_late_ms(runs: RunStore, run_id: str, seconds: int) -> int:
    """How long after its time the run's wait ended (its ``run.suspended`` time + ``seconds``)."""
    events = runs.events(run_id)
    suspended = next(e for e in events if e.type == "run.suspended")
    woken = [e for e in events if e.type == "run.woken"]
    assert len(woken) == 1 and woken[0].data["by"] == "timer", woken
    return woken[0].at_ms - (suspended.at_ms + seconds * 1000)


@pytest.mark.timeout(120)
def test_a_3000s_wait_on_redis_holds_no_message_while_shorter_timers_fire_on_time(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    with beat(worker_processes, tmp_path, **SHORT_ENV):
        redis_broker_holds_nothing_for_the_long_wait(worker_processes, redis_url, tmp_path)


def redis_broker_holds_nothing_for_the_long_wait(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url)
    ctx = redis_context(redis_url)
    options = {"priority_steps": list(range(MAX_PRIORITY + 1)), "visibility_timeout": VISIBILITY_S}
    restorer = RatchetConnection(redis_url, transport_options=options)
    # Given a worker on a Redis broker whose visibility timeout is 6 s
    worker_processes.start("--concurrency", "1", **SHORT_ENV)
    # When three runs wait: 3,000 s, 2 s (within the ETA horizon) and 9 s (beyond it)
    run_ids = start_waits(ctx, redis_url, tmp_path)
    # Then, while the shorter ones wait and every held message is restored past 6 s,
    # no worker ever holds a wake-up of the long one, and at most one message a run
    most_held = 0

    def medium_woken() -> bool:
        nonlocal most_held
        held = held_wakes(client)
        assert run_ids["long"] not in held, f"the 3,000 s wait is held: {held}"
        most_held = max(most_held, len(held))
        restorer.default_channel.qos.restore_visible(interval=1)
        return run_status(ctx, run_ids["medium"]) not in (RunStatus.QUEUED, RunStatus.WAITING)

    wait_for("the 9 s wait is over", medium_woken, timeout_s=60)
    assert most_held <= 2, most_held
    # and the shorter ones fire on time: by their ETA, and by the sweeper's
    shorter_ones_fire_on_time(ctx, run_ids)
    # and the broker holds nothing for the long one, still waiting
    wait_for("every message is acknowledged", lambda: client.hlen("unacked") == 0)
    record = ctx.runs.get(run_ids["long"])
    assert record is not None and record.status == RunStatus.WAITING
    assert record.suspension is not None and wake_at_ms(record.suspension) > record.updated_at_ms
    restorer.release()
    ctx.close()
    client.close()


def unacknowledged(vhost_url: str) -> dict[str, int]:
    """Messages delivered and not acknowledged, per queue of the virtual host (rabbitmqctl)."""
    vhost = vhost_url.rsplit("/", 1)[1]
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "messages_unacknowledged"],
        capture_output=True, check=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    rows = (line.split("\t") for line in listed.splitlines() if "\t" in line)
    return {name: int(count) for name, count in rows if count.isdigit()}


@pytest.mark.timeout(150)
def test_a_3000s_wait_on_rabbitmq_holds_no_message_past_the_consumer_timeout(
    worker_processes: WorkerProcesses,
    rabbitmq_vhost: str,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
) -> None:
    # Given a worker on RabbitMQ whose consumer_timeout ratchet is told is 6 s (the server
    # here, 3.10, has no per-queue timeout: x-consumer-timeout and the policy key are 3.12's)
    env = {
        "RATCHET_BROKER_URL": rabbitmq_vhost,
        "RATCHET_AMQP_CONSUMER_TIMEOUT_S": "6",
        "RATCHET_TURN_TIME_LIMIT_S": "5",
    }
    ctx = redis_context(redis_url)
    worker_processes.start("--concurrency", "1", **env)
    with beat(worker_processes, tmp_path, **env):
        # When three runs wait: 3,000 s, 2 s and 9 s
        run_ids = start_waits(ctx, rabbitmq_vhost, tmp_path)
        # Then the shorter ones fire on time
        shorter_ones_fire_on_time(ctx, run_ids)
    # and no message is held unacknowledged, though the long one still waits: a held ETA
    # would outlive the consumer_timeout, which closes the channel and every turn on it
    wait_for(
        "no message is unacknowledged",
        lambda: not any(unacknowledged(rabbitmq_vhost).values()),
        timeout_s=30,
    )
    assert run_status(ctx, run_ids["long"]) == RunStatus.WAITING
    ctx.close()
