"""Redis behind Sentinel: a worker whose broker and stores are one ``redis+sentinel://``
URL carries on through a failover, finding the promoted replica by itself."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import pytest

from runtime.models import RunStatus
from store.runs.redis import RedisRunStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.sentinel_servers import running_sentinel_group
from tests.workers import WorkerProcesses, wait_for, worker_env
from worker.app import make_app

pytestmark = pytest.mark.slow

TURNS = 5
"""Model turns of each run, a lookup each but the last, every one ~0.4 s."""


def sentinel_context(url: str) -> Context:
    return Context(
        settings=Settings(),
        snapshots=RedisSnapshotStore.from_url(url),
        runs=RedisRunStore.from_url(url),
    )


def start(ctx: Context, url: str, agent: Path, text: str) -> str:
    run_id = create_run(ctx, agent, text).run_id
    make_app(Settings(broker_url=url)).send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
    return run_id


def completed(ctx: Context, run_id: str) -> bool:
    record = ctx.runs.get(run_id)
    return record is not None and record.status == RunStatus.COMPLETED


@pytest.mark.timeout(90)
def test_a_worker_on_sentinel_urls_finishes_runs_across_a_failover_of_its_primary(
    tmp_path: Path, ledger: Path
) -> None:
    lookups = [
        {**turn(f"look {n}", call("lookup_order", order_id=f"A{n}")), "sleep_s": 0.4}
        for n in range(TURNS - 1)
    ]
    agent = write_agent(tmp_path / "agent", [*lookups, {**turn("Done."), "sleep_s": 0.4}])
    with running_sentinel_group(tmp_path / "redis") as group:
        url = group.url(0)
        ctx = sentinel_context(url)
        # Given a worker whose broker and both stores are the group's sentinel URL, with
        # beat's sweeper in it (a turn cut off by the failover is resumed by the sweeper
        # once its lease expires: the broker's redelivery is never the guarantee)
        env = worker_env(
            url, ledger, tmp_path / "data", RATCHET_LEASE_S="2", RATCHET_SWEEP_INTERVAL_S="0.5"
        )
        workers = WorkerProcesses(env, tmp_path)
        try:
            worker = workers.start(
                "--pool", "threads", "--concurrency", "4", "-B", "-s", str(tmp_path / "beat")
            )  # fmt: skip
            # And a run under way when the primary goes
            before = start(ctx, url, agent, "before the failover")
            wait_for(
                "the first run is two turns in",
                lambda: sum(e.type == "model.responded" for e in ctx.runs.events(before)) >= 2,
                timeout_s=30,
            )

            # When the primary is SIGKILLed and the sentinels promote its replica
            took_s = group.fail_over()

            # Then the run goes on, and a run started afterwards runs, on the same worker
            after = start(ctx, url, agent, "after the failover")
            for run_id in (before, after):
                wait_for(f"run {run_id} completes", functools.partial(completed, ctx, run_id), 45)
            assert worker.process is not None and worker.process.poll() is None, worker.log()
            assert group.primary_port() == group.replica.port
            for run_id in (before, after):
                events = ctx.runs.events(run_id)
                assert [e.seq for e in events] == list(range(1, len(events) + 1))
                responded = [e for e in events if e.type == "model.responded"]
                # Every turn answered once: no turn was lost to the failover nor taken twice
                assert [e.data["content"] for e in responded] == [
                    *(f"look {n}" for n in range(TURNS - 1)),
                    "Done.",
                ], _story(took_s, events, worker.log())
        finally:
            workers.stop_all()
            ctx.close()


def _story(took_s: float, events: Sequence[object], log: str) -> str:
    return f"failover took {took_s:.1f} s; events {events}\n--- worker log ---\n{log[-6000:]}"
