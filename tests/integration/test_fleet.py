"""A fleet's guard rails on real ``celery -A worker worker`` processes: the broker check, metrics."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from runtime.models import RunStatus
from tasks.settings import Settings
from tests.redis_server import _free_port
from tests.workers import (
    EXAMPLE_AGENT,
    WorkerProcess,
    WorkerProcesses,
    run_on_workers,
    wait_until,
)
from worker.checks import broker_problem, longest_turn

# The example agent: model_timeout_s 120 (default) + 20 tool calls x 300 s x 3 tries.
EXAMPLE_LONGEST_TURN_S = 18_120


def wait_for_log(worker: WorkerProcess, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in worker.log():
        assert worker.process is not None and worker.process.poll() is None, worker.log()
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.05)


# --- the broker check -------------------------------------------------------------


def test_the_longest_turn_is_the_time_limit_in_prefork_and_the_agents_own_otherwise() -> None:
    settings = Settings(agents=str(EXAMPLE_AGENT), visibility_timeout_s=3600)
    assert longest_turn(settings, "prefork", 1800).seconds == 1800
    assert longest_turn(settings, "threads", 1800).seconds == EXAMPLE_LONGEST_TURN_S
    assert longest_turn(Settings(), "solo", 1800).seconds is None
    problem = broker_problem(settings, "redis://127.0.0.1:6379/0", "threads", 1800)
    assert problem is not None and "RATCHET_VISIBILITY_TIMEOUT_S (3600 s)" in problem
    assert broker_problem(settings, "redis://127.0.0.1:6379/0", "prefork", 1800) is None


def test_on_rabbitmq_the_longest_turn_must_fit_in_the_servers_consumer_timeout() -> None:
    # RabbitMQ closes a channel that holds a delivery past its consumer_timeout (30 min)
    settings = Settings(agents=str(EXAMPLE_AGENT))
    problem = broker_problem(settings, "amqp://guest@127.0.0.1//", "threads", 1500)
    assert problem is not None and "RATCHET_AMQP_CONSUMER_TIMEOUT_S (1800 s" in problem
    assert f"longest turn, {EXAMPLE_LONGEST_TURN_S} s" in problem
    # the default time limit fits in the default consumer timeout, in prefork
    assert Settings().turn_time_limit_s < Settings().amqp_consumer_timeout_s
    assert broker_problem(settings, "amqp://guest@127.0.0.1//", "prefork", 1500) is None
    assert broker_problem(settings, "amqp://guest@127.0.0.1//", "prefork", 1800) is not None


@pytest.mark.timeout(60)
def test_a_worker_whose_turns_can_outlive_the_visibility_timeout_refuses_to_start(
    worker_processes: WorkerProcesses,
) -> None:
    # Given agents whose longest turn is 18,120 s, and a visibility timeout of 100 s
    fleet = {
        "RATCHET_AGENTS": str(EXAMPLE_AGENT),
        "RATCHET_VISIBILITY_TIMEOUT_S": "100",
        "RATCHET_TURN_TIME_LIMIT_S": "50",
    }
    # When a threads-pool worker (which does not enforce the time limit) starts
    refused = worker_processes.start("--pool", "threads", **fleet)
    # Then it exits at once, non-zero, with one line naming the setting to raise
    assert refused.wait(timeout_s=30) != 0
    assert (
        "refusing to start: RATCHET_VISIBILITY_TIMEOUT_S (100 s) is not longer than the "
        f"longest turn, {EXAMPLE_LONGEST_TURN_S} s" in refused.log()
    )
    assert f"Raise RATCHET_VISIBILITY_TIMEOUT_S above {EXAMPLE_LONGEST_TURN_S}" in refused.log()
    # And a prefork worker, whose hard time limit (50 s) ends any turn first, starts
    fine = worker_processes.start("--concurrency", "1", **fleet)
    wait_for_log(fine, "ready.")


# --- metrics ------------------------------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.mark.timeout(60)
def test_a_prefork_worker_exposes_prometheus_metrics_that_count_a_run(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    port = _free_port()
    worker = worker_processes.start("--concurrency", "2", RATCHET_METRICS_PORT=str(port))
    wait_for_log(worker, "ready.")
    assert scrape(port).get('ratchet_turns_total{outcome="completed"}', 0) == 0
    # When the example agent runs to completion on the worker's pool processes
    record = run_on_workers(redis_url, EXAMPLE_AGENT, "Refund order B2", timeout_s=30)
    assert record.status == RunStatus.COMPLETED
    # Then the metrics, summed over the pool processes, counted what happened (the last
    # turn counts itself once its commit, which the run's record shows, is written)
    wait_until(
        "the last turn is counted",
        lambda: scrape(port).get('ratchet_turns_total{outcome="completed"}', 0) >= 1,
        timeout_s=10,
    )
    samples = scrape(port)
    assert samples['ratchet_turns_total{outcome="completed"}'] == 1
    assert samples['ratchet_turns_total{outcome="next"}'] == 2  # two look-ups at once, a refund
    assert samples['ratchet_events_total{type="tool.completed"}'] == 3
    assert samples['ratchet_run_transitions_total{status="completed"}'] == 1
    # (a snapshot save a turn, with its last checkpoint; the run's end deletes it instead)
    assert samples["ratchet_checkpoint_seconds_count"] == 3
    assert samples["ratchet_checkpoint_bytes_sum"] > 1000
    assert samples.get("ratchet_dead_lettered_total", 0) == 0
