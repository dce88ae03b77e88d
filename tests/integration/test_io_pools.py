"""Runs that wait on a model, on the pools built for waiting: threads and gevent.

A real ``celery -A worker worker -P threads|gevent`` with more slots than
redis-py's default pool has connections (100), real Redis, and the real
OpenAI-compatible provider talking HTTP to an asynchronous local model that
answers after a delay. Every slot is busy waiting on the model at once, then
every one of them checkpoints at once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime.models import RunStatus
from tasks.settings import Settings
from tasks.start import create_run
from tests.model_server import ModelServer, serve
from tests.workers import WorkerProcess, WorkerProcesses, redis_context
from worker.app import make_app

TURNS = 3
"""Model turns per run: two with a tool call, then the answer."""
LATENCY_S = 0.8
SIGNS_OF_TROUBLE = (
    "Traceback",
    "ERROR",
    "StoreUnavailable",
    "is unavailable",
    "Too many connections",
    "pooled connections stayed busy",
    "lease lost",
    "no longer holds the run's lease",
)


def write_openai_agent(directory: Path, base_url: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    agent = directory / "waiting.toml"
    agent.write_text(
        'name = "waiting"\nmodel = "openai:fleet-test"\nsystem = "Look the order up."\n'
        'tools = ["examples.refunds:lookup_order"]\nmodel_timeout_s = 60\n'
        f'[provider]\nbase_url = "{base_url}"\ntimeout_s = 30\n'
        f"[budgets]\nmax_turns = {TURNS + 1}\nmax_tool_calls = {TURNS}\n"
    )
    return agent


def wait_until_ready(worker: WorkerProcess, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while "ready." not in worker.log():
        assert worker.process is not None and worker.process.poll() is None, worker.log()
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.05)


def run_fleet(
    worker_processes: WorkerProcesses,
    redis_url: str,
    tmp_path: Path,
    model: ModelServer,
    pool_args: tuple[str, ...],
    runs: int,
) -> tuple[WorkerProcess, list[RunStatus], list[int]]:
    agent = write_openai_agent(tmp_path / "agent", model.url)
    worker = worker_processes.start(*pool_args)
    wait_until_ready(worker)
    ctx = redis_context(redis_url)
    client = make_app(Settings(broker_url=redis_url))
    try:
        # Every run is created before any is sent, so that they all wait on the model together.
        states = [create_run(ctx, agent, f"look up order A1 ({i})") for i in range(runs)]
        for state in states:
            client.send_task("ratchet.turn", (state.run_id, state.seq))
        ids = [state.run_id for state in states]
        deadline = time.monotonic() + 240
        while True:
            records = [ctx.runs.get(run_id) for run_id in ids]
            if all(r is not None and not r.status.is_live for r in records):
                break
            assert worker.process is not None and worker.process.poll() is None, worker.log()
            assert time.monotonic() < deadline, (
                f"{sum(r is not None and r.status.is_live for r in records)} runs still live",
                worker.log()[-5000:],
            )
            time.sleep(0.2)
        statuses = [r.status for r in records if r is not None]
        turns = [r.usage.model_turns for r in records if r is not None]
        return worker, statuses, turns
    finally:
        client.close()
        ctx.close()


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("pool", "concurrency", "runs"),
    [("threads", 150, 150), ("gevent", 300, 150)],
)
def test_more_runs_wait_on_the_model_at_once_than_redis_py_has_default_connections(
    worker_processes: WorkerProcesses,
    redis_url: str,
    tmp_path: Path,
    pool: str,
    concurrency: int,
    runs: int,
) -> None:
    # Given a model that answers after 0.8 s, and first only once all 150 runs wait on
    # it together (then every one of them checkpoints at once), and a worker with more
    # slots than redis-py's default pool has connections
    with serve(latency_s=LATENCY_S, turns=TURNS, hold_until=runs) as model:
        # When 150 runs of three model turns each start at once
        worker, statuses, turns = run_fleet(
            worker_processes, redis_url, tmp_path, model, ("-P", pool, "-c", str(concurrency)), runs
        )
    # Then all 150 were in flight together (more than 100),
    assert model.most_in_flight == runs
    # every run completed with exactly its three turns,
    assert statuses == [RunStatus.COMPLETED] * runs
    assert turns == [TURNS] * runs
    assert model.requests == runs * TURNS
    # and no store call failed and no lease was lost on the way
    log = worker.log()
    for sign in SIGNS_OF_TROUBLE:
        assert sign not in log, log[max(0, log.find(sign) - 2000) : log.find(sign) + 2000]
