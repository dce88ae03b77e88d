"""Sends that cannot reach a worker are refused before anything is recorded, in one line.

- an answer whose next turn the broker refuses is not taken (it used to be recorded,
  leaving the run moved on with no turn queued);
- a CLI with no ``RATCHET_BROKER_URL`` (the embedded ``filesystem://`` broker) and a
  Redis store refuses to start a run its workers would never see;
- a worker of a team's app with a setting ratchet cannot take refuses to start, naming it;
- on RabbitMQ, a start with no worker consuming ``ratchet.turns`` says so.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
import redis
from kombu import Connection, Exchange, Queue

from runtime.models import RunStatus
from tests.helpers import call, turn, write_agent
from tests.redis_server import RedisServer
from tests.workers import ROOT, WorkerProcesses, wait_for, worker_env
from worker.api import Ratchet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]


def ratchet_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ratchet", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_an_answer_whose_turn_the_broker_refuses_is_not_taken(
    ratchet: Ratchet, redis_url: str, ledger: Path, rabbitmq_vhost: str, tmp_path: Path
) -> None:
    # Given a suspended run, and a RabbitMQ whose ratchet.turns an earlier deployment
    # declared without priorities (so a declaration with x-max-priority is refused)
    run_id = ratchet.start(write_agent(tmp_path, ASK), "refund my order")
    wait_for("the run waits for a person", lambda: ratchet.get(run_id).status.is_suspended)
    before = ratchet.events(run_id)
    with Connection(rabbitmq_vhost) as connection:
        exchange = Exchange("ratchet.turns", type="direct")
        Queue("ratchet.turns", exchange, routing_key="ratchet.turns")(
            connection.channel()
        ).declare()
    env = {**worker_env(redis_url, ledger, tmp_path / "data"), "RATCHET_BROKER_URL": rabbitmq_vhost}
    # When the CLI answers it through that broker
    answered = ratchet_cli(env, "runs", "continue", run_id, "--input", "Order B2")
    # Then the answer is not taken: the run still waits for it (it can be given again)
    assert ratchet.events(run_id) == before, answered.stderr
    assert ratchet.get(run_id).status == RunStatus.NEEDS_USER_INPUT
    # and the refusal is one line saying nothing was recorded
    assert answered.returncode == 1, answered.stderr
    lines = answered.stderr.strip().splitlines()
    assert len(lines) == 1, answered.stderr
    assert "PRECONDITION_FAILED" in lines[0] and "nothing was recorded" in lines[0]


def test_a_cli_without_a_broker_url_refuses_to_queue_where_workers_sharing_its_store_never_look(
    redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    # Given the CLI's environment: stores on Redis, and RATCHET_BROKER_URL forgotten
    env = worker_env(redis_url, ledger, tmp_path / "data")
    del env["RATCHET_BROKER_URL"]
    agent = write_agent(tmp_path, ASK)
    # When a run is started
    started = ratchet_cli(env, "runs", "start", str(agent), "--input", "x", "--run-id", "lost")
    # Then it is refused in one line naming the setting, and no run is recorded
    assert started.returncode != 0
    assert started.stderr.count("\n") == 1, started.stderr
    assert "RATCHET_BROKER_URL is not set" in started.stderr
    assert "RATCHET_RUN_STORE is redis://" in started.stderr
    listed = ratchet_cli(env, "runs", "show", "lost")
    assert listed.returncode == 1 and "lost" in listed.stderr


PROJ_WITH_ITS_OWN_STEPS = """\
import os

from celery import Celery

import tasks

app = Celery("proj", broker=os.environ["PROJ_BROKER_URL"])
app.conf.broker_transport_options = {"priority_steps": [0, 3, 6, 9]}
tasks.install(app)
"""


def test_a_worker_of_an_app_with_a_setting_ratchet_cannot_take_refuses_to_start_naming_it(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    # Given a team's app that chose kombu's default priority steps for itself
    (tmp_path / "stepped.py").write_text(PROJ_WITH_ITS_OWN_STEPS)
    # When its worker starts
    worker = worker_processes.start(
        "-Q", "ratchet.turns,ratchet.control", "--pool", "threads", app="stepped",
        PROJ_BROKER_URL=redis_url, PYTHONPATH=f"{tmp_path}:{ROOT}",
    )  # fmt: skip
    # Then it exits at once with one line naming the setting
    assert worker.wait(timeout_s=60) == 2, worker.log()
    refusal = [line for line in worker.log().splitlines() if "refusing to start" in line]
    assert refusal == [
        "ratchet: refusing to start: app 'proj' has settings ratchet cannot take: "
        "broker_transport_options['priority_steps'] is [0, 3, 6, 9], ratchet needs "
        "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]; remove them from the app's configuration "
        "(tasks.install sets them)"
    ], worker.log()


def test_a_start_on_a_rabbitmq_nobody_consumes_says_so(
    redis_url: str, ledger: Path, rabbitmq_vhost: str, tmp_path: Path
) -> None:
    env = {**worker_env(redis_url, ledger, tmp_path / "data"), "RATCHET_BROKER_URL": rabbitmq_vhost}
    agent = write_agent(tmp_path, ASK)
    started = ratchet_cli(env, "runs", "start", str(agent), "--input", "x")
    assert started.returncode == 0, started.stderr
    assert "no worker consumes ratchet.turns on amqp://guest:**@127.0.0.1:5672/" in started.stderr
    assert started.stderr.count("\n") == 1, started.stderr


def test_an_answer_recorded_whose_turn_the_broker_then_refuses_says_so_and_exits_7(
    ratchet: Ratchet, redis_server: RedisServer, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    # Given a suspended run, and a broker account that may connect and declare queues but
    # not push a message (Redis ACL): the send fails only after the answer is recorded
    run_id = ratchet.start(write_agent(tmp_path, ASK), "refund my order")
    wait_for("the run waits for a person", lambda: ratchet.get(run_id).status.is_suspended)
    user = f"nopush{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-lpush", "-rpush",
        "-eval", "-evalsha",
    )  # fmt: skip
    try:
        broker = redis_url.replace("redis://", f"redis://{user}:pw@")
        env = {**worker_env(redis_url, ledger, tmp_path / "data"), "RATCHET_BROKER_URL": broker}
        # When the CLI answers it through that broker
        answered = ratchet_cli(env, "runs", "continue", run_id, "--input", "Order B2")
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()
    # Then exit status 7 and one line say the answer is recorded and the sweeper goes on
    assert answered.returncode == 7, answered.stderr
    lines = answered.stderr.strip().splitlines()
    assert len(lines) == 1, answered.stderr
    assert f"run {run_id}: the answer is recorded" in lines[0]
    assert "the crash sweeper" in lines[0] and "'lpush'" in lines[0], lines[0]
    assert [e.type for e in ratchet.events(run_id)].count("run.continued") == 1
