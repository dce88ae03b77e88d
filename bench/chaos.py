"""Chaos: runs on two real workers while one of them is SIGKILLed every 1–3 s.

    python bench/chaos.py [--runs 200] [--seed 1] [--timeout 300] [--pool prefork] [--concurrency 2]
                          [--hogs 0] [--keep] [--overlap]
                          [--agent refund | parallel-probed | parallel-unprobed | parallel]

Starts its own ``redis-server`` on a free port (broker and both stores), two
``celery -A worker worker`` processes (``--pool``, default prefork, with
``--concurrency``, default 2) and a sweeper
(``celery -A worker beat``), all with ratchet's default lease, sweep interval
and recovery limit. It starts N runs of a four-turn agent with tools (two
idempotent look-ups, one non-idempotent refund), then SIGKILLs the whole
process group of a random worker every 1–3 s and starts it again, until every
run has stopped being live — one failure at a time: a kill waits until the other worker
is up again (ready), unless ``--overlap``, when both may be down and a run then waits for
a worker to start, whatever ratchet does. It prints figures, not pass/fail:

- completed / parked (needs_reconciliation) / dead-lettered / failed / lost
  (still live at the end, or never created);
- duplicate non-idempotent executions: refunds in the ledger beyond one per run;
- duplicate transitions: a model turn, tool request or outcome recorded twice;
- recovery latency p50 / p90 / p99 / max: from a kill to the next event of each run
  whose lease the killed worker's processes still held once dead, and what that event was;
- how the runs were taken back: leases taken from a dead owner (liveness) by the
  sweeper's resume or a turn, and resumes after the lease expired;
- worker start time (Popen to Celery's ``worker_ready``, start-up checks included),
  the settings in effect and the load average, so a figure taken on a busy machine
  says so. ``--hogs N`` runs N CPU hogs (``while 1: pass``) for the whole bench.

``--agent`` picks the agent (default ``refund``, above). ``parallel-probed``:
one turn asks for two look-ups at once, the next for two refunds at once
through the example's keyed ``send_refund``, whose probe asks the ledger
about the call's idempotency key; ``parallel-unprobed`` is the same agent
with the same tool minus its probe; ``--refund-latency`` (default 0.2 s) is
the payment API's round trip, half before the refund is booked and half
after, so kills land on refunds in flight. ``parallel`` runs N of each in the same
fleet under the same kills, and prints both agents' figures side by side:
the runs parked with the probe against the runs parked without it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.models import Event

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    server = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "yes", "--dir", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return server, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def group_pids(leader: int) -> set[int]:
    """Every process in ``leader``'s process group (the worker and its pool children)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == leader:
                pids.add(int(entry.name))
    return pids


class Process:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args, self.env, self.log = args, env, log
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def kill(self) -> set[int]:
        assert self.popen is not None
        pids = group_pids(self.popen.pid) | {self.popen.pid}
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        return pids


PARALLEL_TOOLS = {
    "parallel-probed": "examples.refunds:send_refund",
    "parallel-unprobed": "tests.probed_tools:send_refund_unprobed",
}


def write_parallel_agents(directory: Path, count: int, kind: str) -> list[Path]:
    """Two look-ups at once, then two refunds at once through a non-idempotent tool."""
    from tests.helpers import call, turn, write_agent

    reference = PARALLEL_TOOLS[kind]
    refund = reference.rsplit(":", 1)[1]
    tools = ["examples.refunds:lookup_order", "examples.refunds:refund_policy", reference]
    agents = []
    for i in range(count):
        script = [
            {**turn("look", call("lookup_order", order_id="B2"),
                    call("refund_policy", reason="lost in transit")), "sleep_s": 0.05},
            {**turn("refund", call(refund, order_id=f"{kind}-{i}-a", amount_cents=2900),
                    call(refund, order_id=f"{kind}-{i}-b", amount_cents=100)), "sleep_s": 0.05},
            {**turn("Refunded."), "sleep_s": 0.05},
        ]  # fmt: skip
        agents.append(
            write_agent(directory / f"{kind}{i}", script, name=f"{kind}-{i}", tools=tools)
        )
    return agents


def write_agents(directory: Path, count: int) -> list[Path]:
    from tests.helpers import call, turn, write_agent

    agents = []
    for i in range(count):
        script = [
            {**turn("look", call("lookup_order", order_id="B2")), "sleep_s": 0.05},
            {**turn("policy", call("refund_policy", reason="lost in transit")), "sleep_s": 0.05},
            {
                **turn("refund", call("issue_refund", order_id=f"R{i}", amount_cents=2900)),
                "sleep_s": 0.05,
            },
            {**turn("Refunded."), "sleep_s": 0.05},
        ]
        agents.append(write_agent(directory / f"a{i}", script, name=f"chaos-{i}"))
    return agents


def ready_pids(ready: Path) -> set[int]:
    """The workers (main process pids) that reached worker_ready (bench/ready_probe.py)."""
    if not ready.exists():
        return set()
    lines = ready.read_text().splitlines()
    return {int(line.split()[2]) for line in lines if line.startswith("ready ")}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def duplicated_transitions(events: list[Event]) -> int:
    keys: Counter[tuple[str, object]] = Counter()
    turns = 0
    for e in events:
        kind, data = e.type, e.data
        if kind == "model.responded":
            turns += 1
            keys[(kind, turns)] += 1
        elif kind in ("tool.requested", "tool.completed", "tool.failed"):
            keys[(kind, data["call_id"])] += 1
        elif kind in ("run.completed", "run.parked", "run.dead_lettered"):
            keys[(kind, None)] += 1
    return sum(n - 1 for n in keys.values() if n > 1)


def main() -> int:  # noqa: C901 - a script read top to bottom
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument(
        "--pool", default="prefork", choices=["prefork", "threads", "gevent", "solo"]
    )
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--hogs", type=int, default=0, help="CPU hogs to run meanwhile")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--loglevel", default="WARNING", help="the workers' --loglevel")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="kill even while the other worker is still starting (both may be down)",
    )
    parser.add_argument(
        "--agent",
        default="refund",
        choices=["refund", "parallel-probed", "parallel-unprobed", "parallel"],
        help="parallel: N runs of parallel-probed and N of parallel-unprobed, side by side",
    )
    parser.add_argument(
        "--refund-latency", type=float, default=0.2,
        help="seconds send_refund takes (a payment API's round trip), half before booking",
    )  # fmt: skip
    options = parser.parse_args()
    rng = random.Random(options.seed)
    work = Path(tempfile.mkdtemp(prefix="ratchet-chaos-"))
    redis_server, url = start_redis(work)
    ledger = work / "refunds.ledger"
    ready = work / "ready"
    # Settings come from the caller's environment (RATCHET_LIVENESS_S=… to try others).
    env = dict(os.environ)
    env.update(
        RATCHET_BROKER_URL=url, RATCHET_SNAPSHOT_STORE=url, RATCHET_RUN_STORE=url,
        RATCHET_DATA_DIR=str(work / "data"), RATCHET_EXAMPLE_LEDGER=str(ledger),
        RATCHET_BENCH_READY_FILE=str(ready), PYTHONPATH=str(ROOT),
        RATCHET_EXAMPLE_REFUND_LATENCY_S=str(options.refund_latency),
    )  # fmt: skip
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(options.hogs)]
    load_before = os.getloadavg()
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import redis

    from tasks.delivery import redis_lists
    from tasks.queues import TURNS_QUEUE
    from worker.api import Ratchet

    celery = [sys.executable, "-m", "celery", "-A", "worker"]
    workers = [
        Process([*celery, "worker", "-P", options.pool, "-c", str(options.concurrency),
                 "--without-mingle", "--without-gossip", "-I", "bench.ready_probe",
                 "--loglevel", options.loglevel, "--hostname", f"chaos{n}@%h"], env, work / f"worker{n}.log")
        for n in range(2)
    ]  # fmt: skip
    beat = Process([*celery, "beat", "-s", str(work / "beat-schedule")], env, work / "beat.log")
    api = Ratchet()
    starts: list[tuple[int, float]] = []
    backlog: list[int] = []
    owners: dict[tuple[str, int], str] = {}
    ended: dict[int, float] = {}
    broker = redis.Redis.from_url(url)
    kills: list[tuple[int, list[str]]] = []
    try:
        for process in (*workers, beat):
            began = time.time()
            process.start()
            assert process.popen is not None
            starts.append((process.popen.pid, began))
        starts.pop()  # beat's
        kinds = {"parallel": ["parallel-probed", "parallel-unprobed"]}.get(
            options.agent, [options.agent]
        )
        agents: list[tuple[str, Path]] = []
        for kind in kinds:
            written = (
                write_agents(work / "agents", options.runs)
                if kind == "refund"
                else write_parallel_agents(work / "agents", options.runs, kind)
            )
            agents.extend((kind, agent) for agent in written)
        if len(kinds) > 1:
            rng.shuffle(agents)  # both agents' runs side by side, under the same kills
        started = time.monotonic()
        run_ids = [
            api.start(agent, "refund it", f"chaos-{i}") for i, (_, agent) in enumerate(agents)
        ]
        kind_of = dict(zip(run_ids, (kind for kind, _ in agents), strict=True))
        next_kill = time.monotonic() + rng.uniform(1, 3)
        while time.monotonic() - started < options.timeout:
            live = [
                r for r in run_ids if (rec := api.ctx.runs.get(r)) is None or rec.status.is_live
            ]
            if not live:
                break
            if time.monotonic() >= next_kill:
                victim = rng.choice(workers)
                assert victim.popen is not None
                other = workers[1 - workers.index(victim)].popen
                if not options.overlap and not (
                    other is not None and other.pid in ready_pids(ready)
                ):
                    # One failure at a time: a kill waits until the other worker is up.
                    time.sleep(0.05)
                    continue
                pids = group_pids(victim.popen.pid) | {victim.popen.pid}
                backlog.append(sum(int(broker.llen(name)) for name in redis_lists(TURNS_QUEUE)))
                dead_pid = victim.popen.pid
                victim.kill()
                # From its death (kill returns once the worker is reaped): an event stamped
                # in the milliseconds before is the dead worker's own last write.
                kill_ms = time.time_ns() // 1_000_000
                ended[dead_pid] = kill_ms / 1000
                # The runs it was in the middle of: leases its processes hold once they are
                # dead (read before the kill, a turn that just ended would count too).
                held = []
                for run_id in live:
                    lease = api.ctx.runs.lease(run_id)
                    if lease is not None and int(lease.owner.split(":")[1]) in pids:
                        held.append(run_id)
                        owners[run_id, len(kills)] = lease.owner
                kills.append((kill_ms, held))
                began = time.time()
                victim.start()
                starts.append((victim.popen.pid, began))
                next_kill = time.monotonic() + rng.uniform(1, 3)
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        statuses: Counter[str] = Counter()
        by_kind: dict[str, Counter[str]] = {kind: Counter() for kind in kinds}
        duplicates = 0
        for run_id in run_ids:
            record = api.ctx.runs.get(run_id)
            status = "lost" if record is None or record.status.is_live else record.status.value
            statuses[status] += 1
            by_kind[kind_of[run_id]][status] += 1
            if record is not None:
                events = api.ctx.runs.events(run_id)
                duplicates += duplicated_transitions(events)
                by_kind[kind_of[run_id]]["probed"] += sum(e.type == "tool.probed" for e in events)
        refunds = (
            Counter(line.split()[1] for line in ledger.read_text().splitlines())
            if ledger.exists()
            else Counter()
        )
        double_refunds = sum(n - 1 for n in refunds.values() if n > 1)
        latencies = []
        next_events: Counter[str] = Counter()
        slowest: list[tuple[float, str]] = []
        for n, (kill_ms, held) in enumerate(kills):
            for run_id in held:
                after = [e for e in api.ctx.runs.events(run_id) if e.at_ms > kill_ms]
                if after:
                    latencies.append((after[0].at_ms - kill_ms) / 1000)
                    next_events[after[0].type] += 1
                    slowest.append(
                        (
                            latencies[-1],
                            f"kill {n}: {run_id} held by "
                            f"{owners[run_id, n]}, then {after[0].type} {after[0].data}",
                        )
                    )
        slowest.sort(reverse=True)
        resumes = Counter(
            e.data.get("by", "?")
            for run_id in run_ids
            for e in api.ctx.runs.events(run_id)
            if e.type == "run.resumed"
        )
        logs = "".join(p.log.read_text(errors="replace") for p in workers if p.log.exists())
        # Per worker main process (pid): when it loaded, finished its checks, was ready.
        marks: dict[str, dict[str, float]] = {}
        for line in ready.read_text().splitlines():
            mark_name, mark_at, mark_pid = line.split()
            marks.setdefault(mark_pid, {})[mark_name] = float(mark_at)
        # Popen's pid is the worker's main process (``python -m celery`` runs in it).
        start_s, import_s, checks_s = [], [], []
        for pid, began in starts:
            mark = marks.get(str(pid), {})
            if "loaded" in mark:
                import_s.append(mark["loaded"] - began)
            if "init" in mark and "loaded" in mark:
                checks_s.append(mark["init"] - mark["loaded"])
            if "ready" in mark:
                start_s.append(mark["ready"] - began)
        # When a worker was up (ready, not yet killed) after each kill: with none up,
        # nothing can recover a run, however fast the liveness lapses.
        up = [(marks[str(pid)]["ready"], ended.get(pid, float("inf")))
              for pid, _ in starts if "ready" in marks.get(str(pid), {})]  # fmt: skip
        no_worker_s = []
        for kill_ms, _ in kills:
            at = kill_ms / 1000
            if not any(ready <= at < end for ready, end in up):
                no_worker_s.append(min((r for r, _ in up if r > at), default=at) - at)
        from tasks.settings import Settings

        settings = Settings()
        figures = {
            "pool": f"{options.pool} -c {options.concurrency}",
            "runs": options.runs,
            "elapsed_s": round(elapsed, 1),
            "kills": len(kills),
            "completed": statuses["completed"],
            "parked": statuses["needs_reconciliation"],
            "dead_lettered": statuses["dead_lettered"],
            "failed": statuses["failed"],
            "lost": statuses["lost"],
            "duplicate_non_idempotent_executions": double_refunds,
            "duplicate_transitions": duplicates,
            "recoveries_measured": len(latencies),
            "recovery_p50_s": round(percentile(latencies, 0.50), 2),
            "recovery_p90_s": round(percentile(latencies, 0.90), 2),
            "recovery_p99_s": round(percentile(latencies, 0.99), 2),
            "recovery_max_s": round(max(latencies, default=float("nan")), 2),
            "recoveries_sorted_s": [round(x, 1) for x in sorted(latencies)],
            "next_event_after_kill": dict(next_events),
            "slowest_recoveries": [f"{t:.1f} s {what}" for t, what in slowest[:3]],
            "resumes_by": dict(resumes),
            "leases_taken_from_dead_owners": logs.count("whose process stopped renewing"),
            "kills_leaving_no_worker_up": len(no_worker_s),
            "no_worker_up_after_those_kills_s": [round(x, 1) for x in sorted(no_worker_s)],
            "turns_queued_at_kills_p50_max": [
                percentile([float(n) for n in backlog], 0.5),
                max(backlog, default=0),
            ],
            "worker_starts_ready": f"{len(start_s)} of {len(starts)}",
            "worker_start_p50_s": round(percentile(start_s, 0.5), 2),
            "worker_start_max_s": round(max(start_s, default=float("nan")), 2),
            "worker_start_imports_p50_s": round(percentile(import_s, 0.5), 2),
            "worker_start_checks_p50_max_s": [
                round(percentile(checks_s, 0.5), 2),
                round(max(checks_s, default=float("nan")), 2),
            ],
            "lease_s": settings.lease_s,
            # getattr: the bench also runs against trees from before liveness, as a baseline.
            "liveness_s": getattr(settings, "liveness_s", None),
            "heartbeat_interval_s": getattr(settings, "heartbeat_interval_s", None),
            "sweep_interval_s": settings.sweep_interval_s,
            "cpu_hogs": options.hogs,
            "cpus": os.cpu_count(),
            "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        }
        if options.agent != "refund":
            figures["refunds_in_ledger"] = sum(refunds.values())
            for kind in kinds:
                counts = by_kind[kind]
                figures[f"{kind}: runs"] = sum(counts[k] for k in counts if k != "probed")
                for key in ("completed", "needs_reconciliation", "lost"):
                    figures[f"{kind}: {key.replace('needs_reconciliation', 'parked')}"] = counts[
                        key
                    ]
                figures[f"{kind}: probes asked"] = counts["probed"]
        if len(kinds) > 1:
            probed, unprobed = (by_kind[k]["needs_reconciliation"] for k in kinds)
            figures["parked with probe / without"] = f"{probed} / {unprobed}" + (
                f" = {probed / unprobed:.2f}" if unprobed else ""
            )
        for key, value in figures.items():
            print(f"{key:38} {value}")
        print(json.dumps(figures, sort_keys=True))
        return 0
    finally:
        for process in (*workers, beat):
            if process.popen is not None and process.popen.poll() is None:
                process.kill()
        api.ctx.close()
        redis_server.kill()
        redis_server.wait()
        for hog in hogs:
            hog.kill()
            hog.wait()
        if options.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
