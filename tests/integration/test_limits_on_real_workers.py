"""Fleet-wide limits on real ``celery -A worker worker`` processes sharing a real Redis.

The 429 → countdown path on a real worker is in tests/test_openai_runs.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.models import Event, RunState, RunStatus
from store.limits import RESERVATION_EARLY_MS
from store.limits.redis import RedisLimitStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, turn, write_agent
from tests.integration.test_broker_faults import ready
from tests.model_server import ModelServer, serve
from tests.workers import WorkerProcesses, ratchet_cli, redis_context
from worker.app import make_app

WAIT_S = 120


@pytest.fixture
def ctx(redis_url: str) -> Iterator[Context]:
    context = redis_context(redis_url)
    yield context
    context.close()


def openai_agent(directory: Path, server: ModelServer, name: str, limits: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text(
        "\n".join(
            [
                f'name = "{name}"',
                'model = "openai:limited"',
                "tools = []",
                "[provider]",
                f'base_url = "{server.url}"',
                "[limits]",
                f'key = "{name}-key"',
                limits,
            ]
        )
        + "\n"
    )
    return path


def start_all(ctx: Context, redis_url: str, agent: Path, count: int) -> list[str]:
    """Create ``count`` runs and send their first turns, as ``Ratchet.start`` would."""
    return send_first_turns(redis_url, [create_run(ctx, agent, f"task {i}") for i in range(count)])


def send_first_turns(redis_url: str, states: list[RunState]) -> list[str]:
    """Send the first turns of runs already created; their ids."""
    client = make_app(Settings(broker_url=redis_url))
    try:
        for state in states:
            client.send_task("ratchet.turn", (state.run_id, state.seq))
    finally:
        client.close()
    return [s.run_id for s in states]


def wait_all(ctx: Context, run_ids: list[str], workers: WorkerProcesses) -> None:
    deadline = time.monotonic() + WAIT_S
    for run_id in run_ids:
        while (record := ctx.runs.get(run_id)) is None or record.status.is_live:
            logs = "\n".join(w.log()[-3000:] for w in workers.started)
            assert time.monotonic() < deadline, f"run {run_id} still live\n{logs}"
            time.sleep(0.1)
        assert record.status == RunStatus.COMPLETED, record.error


def events_of(ctx: Context, run_ids: list[str], kind: str) -> list[Event]:
    return [e for r in run_ids for e in ctx.runs.events(r) if e.type == kind]


@pytest.mark.timeout(180)
def test_two_worker_processes_share_one_limit_and_the_provider_refuses_nothing(
    worker_processes: WorkerProcesses, ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    # Given a provider that accepts 120 requests a minute (5 s of it at once) and answers 429
    # beyond, and two worker processes whose agent holds itself to that limit
    with serve(latency_s=0.0, turns=1, rpm=120, burst_s=5.0) as server:
        agent = openai_agent(tmp_path, server, "shared", "requests_per_minute = 120\nburst_s = 0.5")
        workers = [worker_processes.start("--pool", "threads", "--concurrency", "4")
                   for _ in range(2)]  # fmt: skip
        for worker in workers:
            ready(worker)
        # When 30 runs of one call each go through both of them at once
        states = [create_run(ctx, agent, f"task {i}") for i in range(30)]
        secs, micros = ctx.runs._client.time()  # type: ignore[attr-defined]
        before_ms = secs * 1000 + micros / 1000  # the limiter's clock, before any call went
        run_ids = send_first_turns(redis_url, states)
        wait_all(ctx, run_ids, worker_processes)
        accepted, refused = sorted(server.accepted_at), server.refused

    # Then both workers took turns, and together they kept to the one limit: no 429 (two
    # limits of 120 a minute each, one per process, would have sent twice that; the bucket's
    # 5 s absorbs a call late by a loaded machine)
    for worker in worker_processes.started:
        assert "ratchet.turn" in worker.log()
    assert refused == 0 and len(accepted) == 30
    # And the limiter spaced them exactly, call by call. GCRA with T = 60 s / 120 = 500 ms
    # and a tolerance of burst_s = 500 ms admits the k-th call (0-based, in the order
    # admitted) no earlier than g0 + k*T - burst: its bucket holds 1 + burst/T = 2 calls,
    # starts full, and the k-th call waits for k + 1 - 2 refills. A call reaches the server
    # no earlier than it was admitted, less RESERVATION_EARLY_MS (a reserved turn whose
    # timer fires that early still goes), so the k-th accepted call (sorted: the k-th
    # earliest of times each no earlier than its own bound) came at or after
    # g0 + (k + 1 - capacity) * T - early. Clocks: the server stamps time.time() on the
    # host whose Redis TIME is the limiter's clock; the TAT is stored rounded to the
    # microsecond (%.3f ms), 0.5 us once per call, and the float stamp is within 1 us.
    # The first accepted call is no reference for the others: it reaches the server any
    # time after g0 (a fresh process's first request, TLS context and all, took 0.4-1 s
    # on a loaded machine), so their span has no lower bound; before_ms <= g0 is one.
    interval_ms, burst_ms = 60_000 / 120, 0.5 * 1000
    capacity = 1 + burst_ms / interval_ms
    rounding_ms = len(accepted) * 0.0005 + 0.001
    from_before = [at * 1000 - before_ms for at in accepted]
    early = [
        (k, round(after, 3))
        for k, after in enumerate(from_before)
        if after < (k + 1 - capacity) * interval_ms - RESERVATION_EARLY_MS - rounding_ms
    ]
    assert early == [], f"(k, ms after before_ms) came before the k-th slot: {early}; " + str(
        [round(after, 1) for after in from_before]
    )
    throttled = events_of(ctx, run_ids, "run.throttled")
    assert throttled and {e.data["limit"] for e in throttled} == {"shared-key"}
    assert all(e.data["reason"] in ("reserved", "over_limit") for e in throttled)


def ran_three_unthrottled(
    worker_processes: WorkerProcesses, ctx: Context, redis_url: str, agent: Path
) -> Path:
    """``agent``, after a worker of four threads ran three runs of it, none throttled."""
    worker_processes.start("--pool", "threads", "--concurrency", "4")
    before = start_all(ctx, redis_url, agent, 3)
    wait_all(ctx, before, worker_processes)
    assert events_of(ctx, before, "run.throttled") == []
    return agent


@pytest.mark.timeout(180)
def test_a_limit_changed_at_run_time_reaches_running_workers_without_a_restart(
    worker_processes: WorkerProcesses, ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    # Given a worker running an agent whose file allows 6000 calls a minute
    with serve(latency_s=0.0, turns=1) as server:
        agent = ran_three_unthrottled(
            worker_processes,
            ctx,
            redis_url,
            openai_agent(tmp_path, server, "changed", "requests_per_minute = 6000"),
        )
        env = worker_processes.base_env

        # When an operator lowers it to 60 a minute with the CLI, the worker still running
        set_it = ratchet_cli(
            env, "limits", "set", "changed-key", "--rpm", "60", "--burst-s", "0.001", timeout_s=60
        )
        assert set_it.returncode == 0, set_it.stderr
        store = RedisLimitStore(ctx.runs._client)  # type: ignore[attr-defined]
        assert store.overrides()["changed-key"]["requests_per_minute"] == 60
        # the worker reads it within its cache's seconds: pairs of runs until one waits
        deadline = time.monotonic() + 60
        while True:
            probes = start_all(ctx, redis_url, agent, 2)
            wait_all(ctx, probes, worker_processes)
            if events_of(ctx, probes, "run.throttled"):
                break
            assert time.monotonic() < deadline, "the worker never applied the new limit"
        run_ids = start_all(ctx, redis_url, agent, 5)
        wait_all(ctx, run_ids, worker_processes)

        # Then the five calls went one a second, as the new limit says
        throttled = events_of(ctx, run_ids, "run.throttled")
        assert {e.data["limit"] for e in throttled} == {"changed-key"}
        asked = sorted(e.at_ms for e in events_of(ctx, run_ids, "model.requested"))
        # Five calls one second apart span four seconds (a call only ever goes later than
        # its slot; the first may be up to a second late); at 6000 a minute it was ~0
        assert len(asked) == 5 and (asked[-1] - asked[0]) / 1000 >= 3.0, asked

        # And when the operator lifts the override, the file's limit applies again
        unset = ratchet_cli(env, "limits", "unset", "changed-key", timeout_s=60)
        assert unset.returncode == 0, unset.stderr
        assert "changed-key" not in store.overrides()
        shown = ratchet_cli(env, "limits", timeout_s=60)
        assert shown.returncode == 0 and "changed-key" in shown.stdout, shown.stderr


@pytest.mark.timeout(180)
def test_a_rate_set_for_a_key_without_one_holds_running_workers_within_the_cache_bound(
    worker_processes: WorkerProcesses, ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    from tasks.limits import OVERRIDES_TTL_S

    # Given a worker running an agent whose key has no rate: its calls skip admission
    with serve(latency_s=0.0, turns=1) as server:
        agent = ran_three_unthrottled(
            worker_processes, ctx, redis_url, openai_agent(tmp_path, server, "unlimited", "")
        )
        env = worker_processes.base_env

        # When an operator sets 60 a minute on that key, and the bound docs/limits.md
        # states (the workers' cache of run-time limits) has passed
        set_it = ratchet_cli(
            env, "limits", "set", "unlimited-key", "--rpm", "60", "--burst-s", "0.001", timeout_s=60
        )
        assert set_it.returncode == 0, set_it.stderr
        time.sleep(OVERRIDES_TTL_S + 0.2)
        run_ids = start_all(ctx, redis_url, agent, 4)
        wait_all(ctx, run_ids, worker_processes)

        # Then every call sent after it keeps the new limit: four calls a second apart
        # (at no limit they went within milliseconds of each other)
        assert {e.data["limit"] for e in events_of(ctx, run_ids, "run.throttled")} == {
            "unlimited-key"
        }
        asked = sorted(e.at_ms for e in events_of(ctx, run_ids, "model.requested"))
        assert len(asked) == 4 and (asked[-1] - asked[0]) / 1000 >= 2.0, asked


@pytest.mark.timeout(240)
def test_a_concurrency_cap_of_2_runs_10_runs_at_most_2_at_once_in_order(
    worker_processes: WorkerProcesses, ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    # Given an agent capped at 2 runs at once, whose runs take a while (two slow turns),
    # and two workers with 8 slots between them
    slow = {"sleep_s": 0.5}
    agent = write_agent(
        tmp_path,
        [
            {**turn("Looking.", call("lookup_order", order_id="A1")), **slow},
            {**turn("Done."), **slow},
        ],
        name="capped",
        extra="[limits]\nmax_runs = 2",
    )
    for _ in range(2):
        worker_processes.start("--pool", "threads", "--concurrency", "4")

    # When 10 runs start one after another (each once its first turn has taken a place
    # or joined the line, so the line's order is the order they started in)
    run_ids = []
    client = make_app(Settings(broker_url=redis_url))
    try:
        for i in range(10):
            state = create_run(ctx, agent, f"task {i}")
            client.send_task("ratchet.turn", (state.run_id, state.seq))
            run_ids.append(state.run_id)
            deadline = time.monotonic() + WAIT_S
            while (record := ctx.runs.get(state.run_id)) is None or record.last_seq == 1:
                assert time.monotonic() < deadline, "the first turn was not taken"
                time.sleep(0.02)
    finally:
        client.close()
    wait_all(ctx, run_ids, worker_processes)

    # Then never more than 2 were in progress (first model call to completion), and 2 were
    spans = []
    for run_id in run_ids:
        events = ctx.runs.events(run_id)
        begun = next(e.at_ms for e in events if e.type == "model.requested")
        ended = next(e.at_ms for e in events if e.type == "run.completed")
        spans.append((begun, ended, run_id))
    marks = sorted([(b, 1) for b, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    level, most = 0, 0
    for _, step in marks:
        level += step
        most = max(most, level)
    assert most == 2, spans
    # The runs started in the order they came, the 8 that waited for a place too: no run
    # began before one two places ahead of it in line (two places freed at nearly the same
    # moment are handed in order, but their turns may be picked up a moment apart)
    began = {i: b for b, _, i in spans}
    for ahead, run_id in enumerate(run_ids):
        for later in run_ids[ahead + 2 :]:
            assert began[later] >= began[run_id], (run_ids.index(later), ahead, spans)
    waited = [r for r in run_ids if any(e.type == "run.throttled" for e in ctx.runs.events(r))]
    assert len(waited) >= 8
    # And nobody holds a place any more
    store = RedisLimitStore(ctx.runs._client)  # type: ignore[attr-defined]
    assert (
        store.cap_use("agent:capped").holders == () and store.cap_use("agent:capped").waiting == ()
    )


@pytest.mark.timeout(180)
def test_a_turn_of_a_run_under_way_is_taken_before_first_turns_queued_earlier(
    worker_processes: WorkerProcesses, redis_url: str, broker_url: str, tmp_path: Path
) -> None:
    # Given a run under way (its first call made, in this process) and five new runs
    ctx = redis_context(redis_url, broker_url=broker_url)
    agent = write_agent(
        tmp_path, [turn("Looking.", call("lookup_order", order_id="A1")), turn("Done.")]
    )
    started = create_run(ctx, agent, "under way")
    done = advance(ctx, started.run_id, None)
    assert done.outcome == "next" and done.priority is not None
    new = [create_run(ctx, agent, f"new {i}") for i in range(5)]
    # When the five first turns are queued first, then the run under way's next turn,
    # and only then a worker with one slot starts
    client = make_app(Settings(broker_url=broker_url))
    try:
        for state in new:
            client.send_task("ratchet.turn", (state.run_id, state.seq))
        client.send_task("ratchet.turn", (started.run_id, done.seq), priority=done.priority)
    finally:
        client.close()
    worker_processes.start("--pool", "solo", RATCHET_BROKER_URL=broker_url)
    run_ids = [started.run_id] + [s.run_id for s in new]
    wait_all(ctx, run_ids, worker_processes)

    # Then the broker handed the run under way over first: it finished before any new run
    # made its first call
    finished = next(e.at_ms for e in ctx.runs.events(started.run_id) if e.type == "run.completed")
    firsts = [
        next(e.at_ms for e in ctx.runs.events(s.run_id) if e.type == "model.requested") for s in new
    ]
    assert finished <= min(firsts), (finished, firsts)
    ctx.close()
