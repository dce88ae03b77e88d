"""A start either happens or it does not, and the user is told which; a retry never starts twice.

The broker is a real redis-server that is down when the CLI starts the run, then
comes up; the stores are on another one that stays up. Everything runs as an
operator runs it: `ratchet runs start` (``python -m worker``), `celery -A worker
worker` and `celery -A worker beat` subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.helpers import refunds
from tests.redis_server import RedisServer, _free_port, running_redis_server
from tests.workers import ROOT, WorkerProcesses, ratchet_cli, worker_env
from tests.workers import wait_for as shared_wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXIT_NOT_QUEUED = 7
wait_for = partial(shared_wait_for, timeout_s=90)


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[str]:
    directory = tmp_path / "stores"
    directory.mkdir()
    with running_redis_server(directory) as server:
        yield f"{server.url}/1"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    """A broker that is down until the test starts it."""
    directory = tmp_path / "broker"
    directory.mkdir()
    server = RedisServer(directory, port=_free_port())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def env(stores: str, broker: RedisServer, tmp_path: Path) -> dict[str, str]:
    base = worker_env(stores, tmp_path / "refunds.ledger", tmp_path / "data")
    # A short lease: a run recorded while the broker was down is overdue 1 s later.
    base.update(
        RATCHET_BROKER_URL=f"{broker.url}/0", RATCHET_LEASE_S="1", RATCHET_SWEEP_INTERVAL_S="0.5"
    )
    return base


def ratchet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return ratchet_cli(env, *args)


def start(
    env: dict[str, str], *key: str, text: str = "Refund order B2"
) -> subprocess.CompletedProcess[str]:
    return ratchet(env, "runs", "start", "examples/refund-desk.toml", "--input", text, *key)


def show(env: dict[str, str], run_id: str) -> dict[str, object]:
    done = ratchet(env, "runs", "show", run_id, "--json")
    assert done.returncode == 0, done.stderr
    shown: dict[str, object] = json.loads(done.stdout)
    return shown


def run_count(env: dict[str, str]) -> int:
    done = ratchet(env, "runs", "list", "--json")
    assert done.returncode == 0, done.stderr
    return len(json.loads(done.stdout))


def test_a_start_while_the_broker_is_down_says_so_and_runs_once_the_broker_is_back(
    env: dict[str, str], broker: RedisServer, tmp_path: Path
) -> None:
    ledger = tmp_path / "refunds.ledger"
    # Given the broker is down, when the operator starts a run
    first = start(env, "--run-id", "broker-down-1")
    # Then one line says the run is recorded, not queued, that it will start by itself,
    # and how to cancel it; a distinct exit status; the id on stdout for scripts
    assert first.returncode == EXIT_NOT_QUEUED, first.stderr
    lines = first.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in first.stderr, first.stderr
    assert "run broker-down-1 is recorded" in lines[0]
    assert "starts by itself once the broker is back" in lines[0]
    assert "ratchet runs cancel broker-down-1" in lines[0]
    assert first.stdout.strip() == "broker-down-1"
    # When the user retries the same start, the same way: the same run, still one
    again = start(env, "--run-id", "broker-down-1")
    assert again.returncode == EXIT_NOT_QUEUED and again.stdout.strip() == "broker-down-1"
    # And a different input under the same id is refused, naming what differs
    other = start(env, "--run-id", "broker-down-1", text="Refund order B3")
    assert other.returncode == 1 and "already exists with another input" in other.stderr
    assert run_count(env) == 1
    assert show(env, "broker-down-1")["status"] == "queued"
    # When the broker comes back with a worker and beat (the crash sweeper)
    broker.start()
    processes = WorkerProcesses(env, tmp_path)
    beat_dir = tmp_path / "beat-cwd"
    beat_dir.mkdir()
    with (tmp_path / "beat.log").open("ab") as beat_log:
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "worker", "beat", "--loglevel", "INFO"],
            cwd=beat_dir,
            env=env,
            stdout=beat_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        processes.start("--pool", "solo")
        # Then the run starts by itself and completes, refunding exactly once
        wait_for("the run to complete", lambda: show(env, "broker-down-1")["status"] == "completed")
        assert refunds(ledger) == ["refund B2 2900"]
        # And beat keeps its schedule under the data dir, not in its working directory
        assert list(beat_dir.iterdir()) == []
        assert list((tmp_path / "data").glob("celerybeat-schedule*"))
    finally:
        os.killpg(beat.pid, 9)
        beat.wait(timeout=10)
        processes.stop_all()
    # When the user retries once more, now that the broker is up: the same run, no refund
    late = start(env, "--run-id", "broker-down-1")
    assert late.returncode == 0 and late.stdout.strip() == "broker-down-1", late.stderr
    assert run_count(env) == 1
    assert refunds(ledger) == ["refund B2 2900"]


def test_an_idempotency_key_gives_one_run_however_often_the_start_is_sent(
    env: dict[str, str], broker: RedisServer, tmp_path: Path
) -> None:
    ledger = tmp_path / "refunds.ledger"
    broker.start()
    processes = WorkerProcesses(env, tmp_path)
    try:
        processes.start("--pool", "solo")
        # When a client sends the same start three times with one key
        ids = set()
        for _ in range(3):
            done = start(env, "--idempotency-key", "refund-B2-ticket-7", "--json")
            assert done.returncode == 0, done.stderr
            ids.add(json.loads(done.stdout)["run_id"])
        # Then there is one run, and it refunds once
        assert len(ids) == 1
        (run_id,) = ids
        wait_for("the run to complete", lambda: show(env, run_id)["status"] == "completed")
        assert run_count(env) == 1
        assert refunds(ledger) == ["refund B2 2900"]
        # And the key with another input is refused
        other = start(env, "--idempotency-key", "refund-B2-ticket-7", text="Refund order B3")
        assert other.returncode == 1 and "already exists with another input" in other.stderr
        # And a run id and a key together are refused
        both = start(env, "--idempotency-key", "k", "--run-id", "r1")
        assert both.returncode == 2 and "not both" in both.stderr
    finally:
        processes.stop_all()


def test_the_start_task_is_keyed_by_its_message_and_refuses_another_input(
    env: dict[str, str], broker: RedisServer, stores: str, tmp_path: Path
) -> None:
    # A client that speaks only Celery: `ratchet.start` sent twice with one key.
    ledger = tmp_path / "refunds.ledger"
    broker.start()
    processes = WorkerProcesses(env, tmp_path)
    agent = str(ROOT / "examples" / "refund-desk.toml")
    script = """
import sys
from worker.app import app
for text in ("Refund order B2", "Refund order B2", "Refund order B3"):
    app.send_task("ratchet.start", (sys.argv[1], text), {"idempotency_key": "celery-7"},
                  queue="ratchet.turns")
"""
    try:
        processes.start("--pool", "solo")
        sent = subprocess.run(
            [sys.executable, "-c", script, agent], cwd=ROOT, env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        wait_for(
            "the third message to be refused",
            lambda: "ratchet.start refused" in processes.started[0].log(),
        )
        done = ratchet(env, "runs", "list", "--json")
        runs = json.loads(done.stdout)
        assert len(runs) == 1, runs
        wait_for(
            "the run to complete", lambda: show(env, runs[0]["run_id"])["status"] == "completed"
        )
        assert refunds(ledger) == ["refund B2 2900"]
        assert "already exists with another input" in processes.started[0].log()
    finally:
        processes.stop_all()
