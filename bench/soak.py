"""Soak: slow tool calls on busy workers, no kills — is a live worker ever declared dead?

    python bench/soak.py [--minutes 10] [--hogs 2] [--in-flight 8] [--pool prefork]
                         [--concurrency 2] [--seed 1] [--keep]

Starts its own ``redis-server`` (broker and both stores), two ``celery -A worker
worker`` processes and a sweeper (``celery -A worker beat``), all with ratchet's
default settings (or those of the caller's ``RATCHET_*`` environment), and ``--hogs``
CPU hogs (``while 1: pass``). For ``--minutes`` it keeps ``--in-flight`` runs going,
each three turns of non-idempotent tool calls of 1–20 s: half of them sleep, half
spin the CPU in pure Python in the worker. Then it waits for every run to end.
Nothing is killed, so every take-over is of a live worker's run. It prints:

- takeovers of a live worker's run: ``run.resumed`` events, leases taken from an
  owner whose liveness lapsed (worker logs), leases lost during a turn;
- runs completed / parked / other, and lost (still live at the end);
- the liveness beats seen from the store (the bench polls each process's record
  every 50 ms): the worst gap between two beats of one process, how late that is
  against the heartbeat interval, and the least liveness any record had left
  before its next beat (at 0 a process is declared dead);
- the settings in effect, CPUs and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chaos import Process, percentile, start_redis  # noqa: E402

TOOLS = ["tests.slow_tools:slow_charge", "tests.liveness_tools:spin_charge"]


def write_agent(directory: Path, rng: random.Random, name: str) -> Path:
    from tests.helpers import call, turn
    from tests.helpers import write_agent as write

    script = [
        turn("work", call(rng.choice(["slow_charge", "spin_charge"]), sleep_s=rng.uniform(1, 20)))
        for _ in range(3)
    ]
    script.append(turn("Done."))
    return write(directory, script, name=name, tools=TOOLS, extra="tool_timeout_s = 40")


def main() -> int:  # noqa: C901 - a script read top to bottom
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"])
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    options = parser.parse_args()
    rng = random.Random(options.seed)
    work = Path(tempfile.mkdtemp(prefix="ratchet-soak-"))
    redis_server, url = start_redis(work)
    env = dict(os.environ)
    env.update(
        RATCHET_BROKER_URL=url, RATCHET_SNAPSHOT_STORE=url, RATCHET_RUN_STORE=url,
        RATCHET_DATA_DIR=str(work / "data"), PYTHONPATH=str(ROOT),
    )  # fmt: skip
    os.environ.update(env)
    import redis

    from tasks.settings import Settings
    from worker.api import Ratchet

    settings = Settings()
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(options.hogs)]
    load_before = os.getloadavg()
    celery = [sys.executable, "-m", "celery", "-A", "worker"]
    workers = [
        Process([*celery, "worker", "-P", options.pool, "-c", str(options.concurrency),
                 "--without-mingle", "--without-gossip", "--loglevel", "WARNING",
                 "--hostname", f"soak{n}@%h"], env, work / f"worker{n}.log")
        for n in range(2)
    ]  # fmt: skip
    beat = Process([*celery, "beat", "-s", str(work / "beat-schedule")], env, work / "beat.log")
    api = Ratchet()
    store = redis.Redis.from_url(url)
    procs_key = f"{settings.redis_prefix}:procs"
    last_expiry: dict[bytes, float] = {}
    gaps: list[float] = []
    least_left_s = float("inf")
    run_ids: list[str] = []
    try:
        for process in (*workers, beat):
            process.start()
        started = time.monotonic()
        ends = started + options.minutes * 60
        next_check = 0.0
        live: set[str] = set()
        while True:
            now = time.monotonic()
            if now >= next_check:
                for run_id in list(live):
                    record = api.ctx.runs.get(run_id)
                    if record is not None and not record.status.is_live:
                        live.discard(run_id)
                while now < ends and len(live) < options.in_flight:
                    name = f"soak-{len(run_ids)}"
                    agent = write_agent(work / "agents" / name, rng, name)
                    run_ids.append(api.start(agent, "charge it", name))
                    live.add(run_ids[-1])
                if now >= ends and not live:
                    break
                next_check = now + 0.5
            wall_ms = time.time() * 1000
            scored = cast(
                "list[tuple[bytes, float]]", store.zrange(procs_key, 0, -1, withscores=True)
            )
            for member, expiry in scored:
                before = last_expiry.get(member)
                if before is not None and expiry > before:
                    gaps.append((expiry - before) / 1000)
                    least_left_s = min(least_left_s, (before - wall_ms) / 1000)
                last_expiry[member] = expiry
            if now > ends + 600:
                break  # runs that do not end are reported as lost
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        statuses: Counter[str] = Counter()
        resumed = 0
        for run_id in run_ids:
            record = api.ctx.runs.get(run_id)
            statuses[
                "lost" if record is None or record.status.is_live else record.status.value
            ] += 1
            resumed += sum(1 for e in api.ctx.runs.events(run_id) if e.type == "run.resumed")
        logs = "".join(p.log.read_text(errors="replace") for p in workers if p.log.exists())
        interval = settings.heartbeat_interval_s
        worst_gap = max(gaps, default=float("nan"))
        figures = {
            "pool": f"{options.pool} -c {options.concurrency}",
            "minutes": options.minutes,
            "elapsed_s": round(elapsed, 1),
            "runs": len(run_ids),
            "tool_calls": 3 * len(run_ids),
            "takeovers_of_live_runs_resumed": resumed,
            "takeovers_of_live_runs_dead_owner": logs.count("whose process stopped renewing"),
            "leases_lost_during_a_turn": logs.count("lease lost during the turn"),
            "liveness_lapsed_warnings": logs.count("record had lapsed"),
            "completed": statuses["completed"],
            "parked": statuses["needs_reconciliation"],
            "other_end": sum(n for s, n in statuses.items() if s not in ("completed", "lost"))
            - statuses["needs_reconciliation"],
            "lost": statuses["lost"],
            "liveness_beats_seen": len(gaps),
            "liveness_processes_seen": len(last_expiry),
            "beat_gap_p50_s": round(percentile(gaps, 0.5), 3),
            "beat_gap_p99_s": round(percentile(gaps, 0.99), 3),
            "beat_gap_max_s": round(worst_gap, 3),
            "worst_heartbeat_lateness_s": round(worst_gap - interval, 3),
            "least_liveness_left_s": round(least_left_s, 3),
            "lease_s": settings.lease_s,
            "liveness_s": settings.liveness_s,
            "heartbeat_interval_s": interval,
            "sweep_interval_s": settings.sweep_interval_s,
            "cpu_hogs": options.hogs,
            "cpus": os.cpu_count(),
            "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        }
        for key, value in figures.items():
            print(f"{key:38} {value}")
        print(json.dumps(figures, sort_keys=True))
        return 0
    finally:
        for process in (*workers, beat):
            if process.popen is not None and process.popen.poll() is None:
                process.kill()
        for hog in hogs:
            hog.kill()
            hog.wait()
        api.ctx.close()
        redis_server.kill()
        redis_server.wait()
        if options.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
