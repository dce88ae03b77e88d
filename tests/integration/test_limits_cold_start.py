"""A fleet-wide limit holds from the first request of freshly started worker processes.

A fresh process builds its HTTP client (certificates, TLS context) on its first model
call; 0.26-0.9 s on a loaded machine. When that happened after ``limits.admit`` had let
the call go, the first request of each process reached the provider late and bunched with
the next ones allowed: with 120 requests a minute, two fresh workers sent 1-2 requests
over the limit (issue 35). The server here counts arrivals and does not refuse (a 429
would make the runs wait and hide the bunching); the test replays them through the limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from store.limits import RESERVATION_EARLY_MS
from tasks.start import create_run
from tests.integration.test_broker_faults import ready
from tests.integration.test_limits_on_real_workers import openai_agent, send_first_turns, wait_all
from tests.model_server import serve
from tests.workers import WorkerProcesses, redis_context

RPM = 120
BURST_S = 0.5
RUNS = 10
REPETITIONS = 4
SLACK_MS = 100.0
"""Arrival jitter forgiven beyond the limiter's own (a loaded machine's scheduling): a
late client build is 0.26-0.9 s, well past it."""


def over_the_limit(arrivals_ms: list[float], interval_ms: float, tolerance_ms: float) -> int:
    """How many arrivals a provider enforcing GCRA(``interval_ms``, ``tolerance_ms``)
    would refuse (a refused request takes nothing)."""
    tat: float | None = None
    over = 0
    for at in sorted(arrivals_ms):
        if tat is not None and at < tat - tolerance_ms:
            over += 1
            continue
        tat = max(at, tat if tat is not None else at) + interval_ms
    return over


def test_the_replay_counts_a_request_that_bunches_with_the_next_allowed_ones() -> None:
    # Two allowed at once, then one each 500 ms: all in time, or the first two 900 ms late
    in_time = [0.0, 0.0, 500.0, 1000.0, 1500.0]
    assert over_the_limit(in_time, 500, 500) == 0
    assert over_the_limit([900.0, 900.0, 500.0, 1000.0, 1500.0], 500, 500) == 1


@pytest.mark.timeout(300)
def test_two_fresh_workers_send_nothing_over_a_limit_of_120_a_minute(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    ctx = redis_context(redis_url)
    figures = []
    try:
        for repetition in range(REPETITIONS):
            # Given a provider and two worker processes started just now, their agent held
            # to 120 requests a minute under a limit key of this repetition's own
            with serve(latency_s=0.0, turns=1) as server:
                agent = openai_agent(
                    tmp_path / str(repetition), server, f"cold{repetition}",
                    f"requests_per_minute = {RPM}\nburst_s = {BURST_S}",
                )  # fmt: skip
                workers = [
                    worker_processes.start("--pool", "threads", "--concurrency", "4")
                    for _ in range(2)
                ]
                for worker in workers:
                    ready(worker)
                # When runs of one call each go through both at once
                states = [create_run(ctx, agent, f"task {i}") for i in range(RUNS)]
                run_ids = send_first_turns(redis_url, states)
                wait_all(ctx, run_ids, worker_processes)
                arrivals = [at * 1000 for at in server.arrived_at]
            for worker in workers:
                worker.kill()
            # Then the provider, enforcing the same limit, would have refused none of them
            interval_ms = 60_000 / RPM
            tolerance_ms = BURST_S * 1000 + RESERVATION_EARLY_MS + SLACK_MS
            first = min(arrivals)
            figures.append(
                (over_the_limit(arrivals, interval_ms, tolerance_ms),
                 [round(a - first) for a in sorted(arrivals)])
            )  # fmt: skip
            assert len(arrivals) == RUNS
    finally:
        ctx.close()
    print(f"cold start figures (over the limit, ms from the first arrival): {figures}")
    # A late client build makes the first request of every fresh process late, so it bunches
    # in every repetition ([1, 1, 1, 1] before that fix, and again with prepare() taken out,
    # here: ~140 ms late on a quiet box). A loaded machine can delay one repetition's first
    # arrivals as much once (CI at -n 4 on 2 cores: [0, 0, 1, 0], both 113 ms late), so one
    # repetition of the four may count one.
    overs = [over for over, _ in figures]
    assert max(overs) <= 1 and sum(overs) <= 1, figures
