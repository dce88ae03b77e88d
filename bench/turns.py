"""Durable turns/s on a real worker and Redis, against a plain Celery self-chain.

    python -m bench.turns [--runs 40] [--turns 10] [--concurrency 2] [--sequential]
                          [--pool prefork|threads|solo]

Starts its own redis-server on a free port, then, with the same worker options
(``--pool``, default prefork as ``celery -A worker worker``; ``--concurrency``), measures:

1. **baseline** — ``--runs`` chains of ``--turns`` no-op tasks, each enqueuing the next;
2. **ratchet** — ``--runs`` runs of an agent with ``--turns`` turns, each a model call
   plus one tool call, every transition checkpointed (events + snapshot on Redis).

and prints turns/s for both and their ratio (the target is ≥ 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.redis_server import RedisServer  # noqa: E402


def write_agent(directory: Path, turns: int) -> Path:
    script = {
        "turns": [
            {
                "content": f"step {i}",
                "tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A1"}}],
                "usage": {"input_tokens": 100, "output_tokens": 20},
            }
            for i in range(turns - 1)
        ]
        + [{"content": "done", "usage": {"input_tokens": 100, "output_tokens": 5}}]
    }
    (directory / "bench.script.json").write_text(json.dumps(script))
    agent = directory / "bench.toml"
    agent.write_text(
        'name = "bench"\nmodel = "scripted"\nscript = "bench.script.json"\n'
        'system = "bench"\ntools = ["examples.refunds:lookup_order"]\n'
        f"[budgets]\nmax_turns = {turns + 1}\nmax_tool_calls = {turns + 1}\n"
    )
    return agent


def start_worker(
    app: str, env: dict[str, str], concurrency: int, log: Path, pool: str = "prefork"
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app,
        "worker",
        "--loglevel",
        "WARNING",
        "--concurrency",
        str(concurrency),
        "--pool",
        pool,
        "--without-mingle",
        "--without-gossip",
        "--hostname",
        f"bench-{app}-{os.getpid()}@%h",
    ]
    with log.open("ab") as handle:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def wait_for(predicate, timeout_s: float, poll_s: float = 0.01) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("benchmark timed out; see the worker logs")
        time.sleep(poll_s)


SEQUENTIAL_POLL_S = 0.001
"""How often a sequential pass looks for its chain's end: the same for both sides."""


def warm_up(env: dict[str, str], workers: int = 1, timeout_s: float = 60.0) -> None:
    """Wait until ``workers`` workers on the broker answer a ping: measured time starts after."""
    from celery import Celery

    probe = Celery("bench-probe", broker=env["RATCHET_BROKER_URL"])
    deadline = time.monotonic() + timeout_s
    try:
        while len(probe.control.ping(timeout=0.5) or []) < workers:
            if time.monotonic() > deadline:
                raise SystemExit("the benchmark's workers did not answer a ping; see their logs")
    finally:
        probe.close()


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes in process group ``pgid``."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # pgrp, after state and ppid
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` alone (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Measured(NamedTuple):
    turns_per_s: float
    worker_cpu_ms: float
    """Per turn: the worker's main and pool processes."""
    redis_cpu_ms: float
    """Per turn: redis-server (broker and stores; the driver's polling included)."""
    main_cpu_ms: float
    """Per turn: the worker's main process alone (its consumer loop), part of ``worker_cpu_ms``."""

    def cpu(self) -> str:
        return (
            f"CPU {self.worker_cpu_ms + self.redis_cpu_ms:5.2f} ms/turn "
            f"(worker {self.worker_cpu_ms:.2f}, of it main {self.main_cpu_ms:.2f}; "
            f"redis-server {self.redis_cpu_ms:.2f})"
        )


def measured(
    worker: subprocess.Popen[bytes], client: redis.Redis, turns: int, run: Callable[[], None]
) -> Measured:
    """Time ``run`` and count the CPU the worker's processes and redis-server spent on it."""
    cpu, main, server = group_cpu_s(worker.pid), process_cpu_s(worker.pid), server_cpu_s(client)
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    worker_ms = (group_cpu_s(worker.pid) - cpu) * 1000 / turns
    main_ms = (process_cpu_s(worker.pid) - main) * 1000 / turns
    redis_ms = (server_cpu_s(client) - server) * 1000 / turns
    return Measured(turns / elapsed, worker_ms, redis_ms, main_ms)


def bench_baseline(
    url: str,
    env: dict[str, str],
    runs: int,
    turns: int,
    concurrency: int,
    log: Path,
    sequential: bool = False,
    pool: str = "prefork",
) -> Measured:
    counter = redis.Redis.from_url(f"{url}/15")
    counter.delete("bench:chains_done")
    env = {**env, "RATCHET_BROKER_URL": f"{url}/1", "BENCH_COUNTER_URL": f"{url}/15"}
    worker = start_worker("bench.selfchain", env, concurrency, log, pool)
    try:
        warm_up(env)
        from bench import selfchain

        selfchain.app.conf.broker_url = f"{url}/1"

        def ended(chains: int) -> bool:
            return int(counter.get("bench:chains_done") or 0) >= chains

        def run() -> None:
            for chain_id in range(runs):
                selfchain.hop.apply_async((chain_id, turns))
                if sequential:  # one chain at a time: the next starts once this one ended
                    wait_for(lambda n=chain_id + 1: ended(n), 600, SEQUENTIAL_POLL_S)
            wait_for(lambda: ended(runs), 600)

        return measured(worker, counter, runs * turns, run)
    finally:
        stop(worker)


def bench_ratchet(
    url: str,
    env: dict[str, str],
    runs: int,
    turns: int,
    concurrency: int,
    log: Path,
    agent: Path,
    sequential: bool = False,
    pool: str = "prefork",
) -> tuple[Measured, int]:
    stores = f"{url}/2"
    env = {
        **env,
        "RATCHET_BROKER_URL": f"{url}/3",
        "RATCHET_SNAPSHOT_STORE": stores,
        "RATCHET_RUN_STORE": stores,
    }
    worker = start_worker("worker", env, concurrency, log, pool)
    try:
        warm_up(env)
        from runtime.models import RunStatus
        from store import open_run_store, open_snapshot_store
        from tasks.context import Context
        from tasks.messages import send_through
        from tasks.settings import Settings
        from worker.api import Ratchet
        from worker.app import make_app

        send_through(make_app(Settings(broker_url=f"{url}/3")))
        api = Ratchet(Context(Settings(), open_snapshot_store(stores), open_run_store(stores)))
        ids: list[str] = []

        def completed(run_id: str) -> bool:
            return api.get(run_id).status == RunStatus.COMPLETED

        def run() -> None:
            for i in range(runs):
                ids.append(run_id := api.start(agent, f"bench run {i}"))
                if sequential:  # one run at a time: the next starts once this one completed
                    wait_for(lambda r=run_id: completed(r), 600, SEQUENTIAL_POLL_S)
            wait_for(lambda: len(api.list(RunStatus.COMPLETED, limit=runs + 1)) >= runs, 600)

        result = measured(worker, redis.Redis.from_url(url), runs * turns, run)
        bad = [i for i in ids if api.get(i).usage.model_turns != turns]
        return result, len(bad)
    finally:
        stop(worker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--no-task-events",
        action="store_true",
        help="both workers without Celery task events (RATCHET_TASK_EVENTS=0)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="one chain or run at a time, as the peer harness's sequential pass: "
        "ms/turn is then a turn's latency",
    )
    parser.add_argument(
        "--pool",
        choices=["prefork", "threads", "solo"],
        default="prefork",
        help="both workers' pool: the hop a turn pays besides its own work differs by pool",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        server = RedisServer(directory)
        server.start()
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
            env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(directory / "data"))
            if args.no_task_events:
                env["RATCHET_TASK_EVENTS"] = "0"
            agent = write_agent(directory, args.turns)
            baseline = bench_baseline(
                server.url,
                env,
                args.runs,
                args.turns,
                args.concurrency,
                directory / "baseline.log",
                args.sequential,
                args.pool,
            )
            durable, wrong = bench_ratchet(
                server.url,
                env,
                args.runs,
                args.turns,
                args.concurrency,
                directory / "ratchet.log",
                agent,
                args.sequential,
                args.pool,
            )
        finally:
            server.stop()
    print(
        f"workload: {args.runs} runs x {args.turns} turns, {args.pool} concurrency {args.concurrency}, "
        "Redis broker and stores on loopback"
        + (", no task events" if args.no_task_events else "")
        + (", one at a time" if args.sequential else "")
    )
    print(
        f"plain Celery self-chain (no-op tasks): {baseline.turns_per_s:8.1f} turns/s, {baseline.cpu()}"
    )
    print(
        f"ratchet durable turns (model + tool):  {durable.turns_per_s:8.1f} turns/s, {durable.cpu()}"
    )
    if args.sequential:
        print(
            f"latency per turn: self-chain {1000 / baseline.turns_per_s:.2f} ms, "
            f"ratchet {1000 / durable.turns_per_s:.2f} ms"
        )
    ratio = durable.turns_per_s / baseline.turns_per_s
    print(f"ratio durable / self-chain:            {ratio:8.2f}   (target >= 0.80)")
    cpu_ratio = (durable.worker_cpu_ms + durable.redis_cpu_ms) / (
        baseline.worker_cpu_ms + baseline.redis_cpu_ms
    )
    print(f"CPU per turn, durable / self-chain:    {cpu_ratio:8.2f}")
    main_ratio = durable.main_cpu_ms / baseline.main_cpu_ms
    print(f"main process CPU, durable / self-chain: {main_ratio:7.2f}")
    if wrong:
        print(f"WARNING: {wrong} runs did not take exactly {args.turns} turns")


if __name__ == "__main__":
    main()
