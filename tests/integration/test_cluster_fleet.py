"""Real workers with their stores on a Redis Cluster (the broker on the suite's own Redis):
200 runs complete across a worker SIGKILLed mid-run, nothing lost, no refund twice.

``python -m bench.cluster_sweep --fleet`` runs a larger fleet and counts each key's share of
the commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.models import RunStatus
from store.runs import owner_process
from store.runs.redis import RedisRunStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.cluster_servers import RedisClusterServers
from tests.helpers import call, refunds, turn, write_agent
from tests.workers import ROOT, WorkerProcess, WorkerProcesses, wait_until, worker_env
from worker.app import make_app

pytestmark = pytest.mark.slow

RUNS = 200
SLOW = 8
"""The first runs take 0.3 s a step, so the doomed worker is caught holding one; the rest
go as fast as the fleet takes them."""
TOOLS = ["examples.refunds:lookup_order", "examples.refunds:send_refund"]
"""A lookup (idempotent) and a refund the ledger books once per idempotency key (its probe
tells a run taken over whether the refund went)."""


def _group(worker: WorkerProcess) -> set[int]:
    """The pids of ``worker``'s process group: the main process and its pool."""
    assert worker.process is not None
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == worker.process.pid:
                    pids.add(int(entry))
            except ProcessLookupError:
                pass
    return pids


@pytest.mark.timeout(240)
def test_a_fleet_on_a_cluster_completes_every_run_once_across_a_killed_worker(
    redis_cluster: RedisClusterServers,
    cluster_prefix: str,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
) -> None:
    # Given two workers (prefork, two processes each) whose stores are the cluster, a beat
    # that sweeps every half second, and runs that each look an order up and refund it
    url = redis_cluster.url()
    env = {
        **worker_env(redis_url, ledger, tmp_path / "data", RATCHET_SWEEP_INTERVAL_S="0.5"),
        "RATCHET_RUN_STORE": url,
        "RATCHET_SNAPSHOT_STORE": url,
        "RATCHET_REDIS_PREFIX": cluster_prefix,
    }
    workers = WorkerProcesses(env, tmp_path)
    ctx = Context(
        settings=Settings(redis_prefix=cluster_prefix),
        snapshots=RedisSnapshotStore.from_url(url, prefix=cluster_prefix),
        runs=RedisRunStore.from_url(url, prefix=cluster_prefix),
    )
    beat_log = (tmp_path / "beat.log").open("wb")
    beat = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "worker", "beat", "--loglevel", "INFO",
         "-s", str(tmp_path / "beat-schedule")],
        cwd=ROOT, env=env, stdout=beat_log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        doomed = workers.start("--concurrency", "2")
        workers.start("--concurrency", "2")
        app = make_app(Settings(broker_url=redis_url))
        run_ids = []
        for n in range(RUNS):
            pace = {"sleep_s": 0.3} if n < SLOW else {}
            script = [
                {**turn("look", call("lookup_order", order_id=f"A{n}")), **pace},
                {**turn("refund", call("send_refund", order_id=f"A{n}", amount_cents=100 + n)),
                 **pace},
                {**turn("Done."), **pace},
            ]  # fmt: skip
            agent = write_agent(tmp_path / "agents", script, name=f"agent-{n}", tools=TOOLS)
            run_ids.append(create_run(ctx, agent, f"refund A{n}").run_id)
            app.send_task("ratchet.turn", (run_ids[-1], 1), queue="ratchet.turns")

        # When one worker is SIGKILLed while one of its processes holds a run's lease
        def held_by_doomed() -> str | None:
            pids = _group(doomed)
            for run_id in run_ids:
                lease = ctx.runs.lease(run_id)
                process = owner_process(lease.owner) if lease is not None else None
                if process is not None and int(process.split(":")[-2]) in pids:
                    return run_id
            return None

        victim = wait_until("the doomed worker holds a run", held_by_doomed, timeout_s=90)
        doomed.kill()

        # Then every run completes, the victim too (taken over by the other worker)
        def finished() -> bool:
            records = [ctx.runs.get(run_id) for run_id in run_ids]
            return all(r is not None and r.status.is_terminal for r in records)

        wait_until(f"all {RUNS} runs finish", finished, timeout_s=180, poll_s=0.2)
        statuses = {run_id: ctx.runs.get(run_id).status for run_id in run_ids}  # type: ignore[union-attr]
        assert set(statuses.values()) == {RunStatus.COMPLETED}, statuses
        assert statuses[victim] == RunStatus.COMPLETED
        # And each order was refunded exactly once: nothing lost, nothing twice
        assert sorted(refunds(ledger)) == sorted(f"refund A{n} {100 + n}" for n in range(RUNS))
        # And the cluster's indexes agree: the runs are listed, none is overdue
        assert {r.run_id for r in ctx.runs.list(limit=RUNS)} == set(run_ids)
        assert ctx.runs.overdue() == []
    finally:
        os.killpg(beat.pid, signal.SIGKILL)
        beat.wait()
        beat_log.close()
        workers.stop_all()
        ctx.close()
