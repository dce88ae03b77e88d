"""I/O fleets: how many runs one worker keeps in flight while they wait on a model.

    python bench/io_fleet.py --pool threads --concurrency 500 --runs 1000 --turns 3 \\
        --latency 1,2 [--provider openai|scripted]

Starts its own redis-server (broker and both stores), and for each phase a fresh
``celery -A worker worker -P POOL -c CONCURRENCY`` and, with ``--provider openai``
(the default), a local asynchronous OpenAI-compatible server (tests/model_server.py,
a process of its own) that answers after the phase's latency — so the real
provider path (httpx, the shared client, retries, parsing) is exercised. With
``--provider scripted`` the scripted provider sleeps out the latency instead.

Each run has ``--turns`` model turns: the first T-1 ask for one tool call
(``lookup_order``), the last answers; every transition is checkpointed. Phases:

1. **ceiling** — latency 0: turns/s is what the CPU (worker, Redis, model server,
   all on this box) allows for this pool and concurrency;
2. one phase per ``--latency`` L: turns/s against the ideal
   ``min(in_flight / L, ceiling)`` with ``in_flight = min(runs, slots)``.

``--floor-rounds N`` runs the ceiling N times beside bench/io_floor.py's plain Celery
task per turn (the same HTTP call and tool, no durability), the order alternated;
``--durable-floor`` adds a third phase each round, that task with the writes the mission
asks of a turn and no more (three Lua calls a tool turn, as ratchet makes), to split
ratchet's cost above the floor into what durability needs and what ratchet adds.

Per phase it prints: turns/s, the ratio to the ideal, the per-turn overhead
beyond L (from the run's own events: one ``model.requested`` to the next, or
to completion, minus L; p50 / p99), resident memory per run in flight (peak RSS
of the worker's processes minus their RSS after boot, over in_flight), lost
leases (the heartbeat's ``ratchet_leases_lost_total`` plus turns fenced by a
lost lease), errors (ERROR/CRITICAL lines in the worker log, and runs that
failed, stalled or parked), runs not finished, and the heartbeat's worst
lateness (``ratchet_heartbeat_max_lateness_seconds``), and ``steady``: turns/s
while every run was in flight (from the last run's first model call to the first
run's completion), with its ratio to the ideal. Runs sent in the same instant
stay in lockstep (every slot's CPU work lands together, then all wait on the
model); ``--stagger S`` spreads their starts over S seconds, as arrivals in a
real fleet are spread. The machine's load
average is printed at start and end: the figures are only as quiet as the box.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.redis_server import RedisServer, _free_port  # noqa: E402

TERMINAL_OR_PARKED = ("completed", "failed", "cancelled", "dead_lettered", "stalled",
                      "needs_reconciliation")  # fmt: skip


@dataclass
class Phase:
    label: str
    latency_s: float
    turns_per_s: float
    elapsed_s: float
    overheads_s: list[float]
    rss_per_run_mib: float
    idle_rss_mib: float
    peak_rss_mib: float
    lost_leases: int
    error_lines: int
    bad_runs: int
    not_finished: int
    heartbeat_late_s: float
    model_in_flight: int | None
    in_flight: int
    steady_turns_per_s: float
    window_s: float
    cpu_ms_per_turn: dict[str, float]
    """CPU ms per turn of the timed part, by process: worker (its group), redis, model."""


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def group_rss_mib(leader: int) -> float:
    """Resident memory of every process in ``leader``'s process group (worker + pool)."""
    total_kib = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != leader:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total_kib / 1024


def scrape(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def write_agent(directory: Path, provider: str, turns: int, latency_s: float, url: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        f'name = "io-fleet-{provider}"',
        'system = "Look the order up, then answer."',
        'tools = ["examples.refunds:lookup_order"]',
        f"model_timeout_s = {latency_s + 120:g}",
    ]
    if provider == "openai":
        lines += ['model = "openai:io-fleet"', "[provider]", f'base_url = "{url}"',
                  f"timeout_s = {latency_s + 60:g}"]  # fmt: skip
    else:
        import json

        call = {"name": "lookup_order", "arguments": {"order_id": "A1"}}
        script = [
            {"content": "", "tool_calls": [call], "sleep_s": latency_s,
             "usage": {"input_tokens": 100, "output_tokens": 12}}
            for _ in range(turns - 1)
        ] + [{"content": "done", "sleep_s": latency_s,
              "usage": {"input_tokens": 100, "output_tokens": 5}}]  # fmt: skip
        (directory / "fleet.script.json").write_text(json.dumps({"turns": script}))
        lines += ['model = "scripted"', 'script = "fleet.script.json"']
    lines += ["[budgets]", f"max_turns = {turns + 1}", f"max_tool_calls = {turns + 1}"]
    path = directory / "fleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class ModelProcess:
    """tests/model_server.py in a process of its own; stops when its stdin closes."""

    def __init__(self, latency_s: float, turns: int) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.model_server", "--latency", str(latency_s),
             "--turns", str(turns)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.popen.stdout is not None
        self.url = self.popen.stdout.readline().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            raise SystemExit(f"the model server did not start: {self.url!r}")

    def stop(self) -> int:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.close()
        summary = self.popen.stdout.read().strip().splitlines()
        self.popen.wait(timeout=30)
        import json

        return int(json.loads(summary[-1])["most_in_flight"]) if summary else -1


def start_worker(
    args: argparse.Namespace, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "celery", "-A", "worker", "worker", "-P", args.pool,
               "-c", str(args.concurrency), "--loglevel", "WARNING", "--without-mingle",
               "--without-gossip", "--hostname", f"io-fleet-{os.getpid()}-{time.monotonic_ns()}@%h"]  # fmt: skip
    with log.open("ab") as handle:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def finished_count(client: object, prefix: str) -> tuple[int, int]:
    """(completed, finished or parked) from the status indexes: two ZCARDs, no record reads."""
    pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
    for status in TERMINAL_OR_PARKED:
        pipe.zcard(f"{prefix}:runs:status:{status}")
    counts = pipe.execute()
    return int(counts[0]), int(sum(counts))


def run_phase(  # noqa: C901, PLR0915 - one phase, read top to bottom
    label: str, latency_s: float, args: argparse.Namespace, server: RedisServer, db: int,
    workdir: Path,
) -> Phase:  # fmt: skip
    import redis

    from runtime.models import RunStatus
    from store import open_run_store, open_snapshot_store
    from tasks.context import Context
    from tasks.messages import enqueue_turn
    from tasks.settings import Settings
    from tasks.start import create_run
    from worker.app import make_app

    url = f"{server.url}/{db}"
    metrics_port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(workdir / "data"),
               RATCHET_BROKER_URL=url, RATCHET_SNAPSHOT_STORE=url, RATCHET_RUN_STORE=url,
               RATCHET_METRICS_PORT=str(metrics_port))  # fmt: skip
    model = ModelProcess(latency_s, args.turns) if args.provider == "openai" else None
    agent = write_agent(workdir / label, args.provider, args.turns, latency_s,
                        model.url if model else "")  # fmt: skip
    log = workdir / f"worker-{label}.log"
    worker = start_worker(args, env, log)
    client = make_app(Settings(broker_url=url))
    ctx = Context(Settings(), open_snapshot_store(url, max_connections=4),
                  open_run_store(url, max_connections=4))  # fmt: skip
    raw = redis.Redis.from_url(url)
    peak = {"rss": 0.0}
    sampling = threading.Event()
    try:
        # A probe run proves the worker consumes (and warms it up) before anything is timed.
        probe = create_run(ctx, agent, "probe")
        enqueue_turn(run_id=probe.run_id, expected_seq=probe.seq, app=client)
        deadline = time.monotonic() + 120
        while finished_count(raw, "ratchet")[1] < 1:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the worker did not take the probe run; see {log}")
            time.sleep(0.05)
        idle_rss = group_rss_mib(worker.pid)
        cpu_before = cpu_by_process(worker.pid, server, model)

        def sample() -> None:
            while not sampling.wait(0.25):
                peak["rss"] = max(peak["rss"], group_rss_mib(worker.pid))

        states = [create_run(ctx, agent, f"look up order A1 ({i})") for i in range(args.runs)]
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started_ms = time.time_ns() // 1_000_000
        # Sends spread over --stagger seconds (0 for the ceiling): runs started all in the
        # same instant stay in lockstep, and their CPU bursts queue behind each other.
        spread_s = args.stagger if latency_s > 0 else 0.0
        for i, state in enumerate(states):
            due_s = spread_s * i / len(states)
            while time.time() - started_ms / 1000 < due_s:
                time.sleep(0.001)
            enqueue_turn(run_id=state.run_id, expected_seq=state.seq, app=client)
        want = args.runs + 1
        deadline = time.monotonic() + args.timeout
        while finished_count(raw, "ratchet")[1] < want and time.monotonic() < deadline:
            if worker.poll() is not None:
                break
            time.sleep(0.1)
        cpu_spent = cpu_by_process(worker.pid, server, model, since=cpu_before)
        sampling.set()
        sampler.join()
        samples = scrape(metrics_port)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        most_in_flight = model.stop() if model else None
        client.close()
    overheads: list[float] = []
    ends: list[int] = []
    firsts: list[int] = []
    asks: list[int] = []
    bad = not_finished = 0
    for state in states:
        record = ctx.runs.get(state.run_id)
        if record is None or record.status.is_live:
            not_finished += 1
            continue
        if record.status != RunStatus.COMPLETED:
            bad += 1
            continue
        events = ctx.runs.events(state.run_id)
        asked = [e.at_ms for e in events if e.type == "model.requested"]
        done = [e.at_ms for e in events if e.type == "run.completed"]
        marks = asked + done[:1]
        firsts += asked[:1]
        asks += asked
        overheads += [(b - a) / 1000 - latency_s for a, b in zip(marks, marks[1:], strict=False)]
        ends += done[:1]
    ctx.close()
    elapsed_s = (max(ends) - started_ms) / 1000 if ends else float("nan")
    # While every run is in flight: from the last run's first model call to the first
    # run's completion, the model calls made per second.
    window_ms = (min(ends) - max(firsts)) if ends and firsts else 0
    in_window = sum(1 for at in asks if max(firsts) <= at <= min(ends)) if window_ms > 0 else 0
    steady = in_window / (window_ms / 1000) if window_ms > 0 else float("nan")
    completed_turns = len(ends) * args.turns
    errors = [
        line for line in log.read_text(errors="replace").splitlines()
        if "ERROR/" in line or "CRITICAL/" in line
    ]  # fmt: skip
    for line in dict.fromkeys(e.split("]", 1)[-1][:240] for e in errors[:20]):
        print(f"  [{label}] worker log: {line.strip()}", file=sys.stderr)
    lost = int(samples.get("ratchet_leases_lost_total", 0)) + int(
        samples.get('ratchet_turns_total{outcome="fenced"}', 0)
    )
    slots = 1 if args.pool == "solo" else args.concurrency
    in_flight = min(args.runs, slots)
    peak_rss = peak["rss"]  # the ceiling phase's in_flight uses its own (maybe fewer) runs
    return Phase(
        label=label,
        latency_s=latency_s,
        turns_per_s=completed_turns / elapsed_s if ends else 0.0,
        elapsed_s=elapsed_s,
        overheads_s=overheads,
        rss_per_run_mib=(peak_rss - idle_rss) / in_flight,
        idle_rss_mib=idle_rss,
        peak_rss_mib=peak_rss,
        lost_leases=lost,
        error_lines=len(errors),
        bad_runs=bad,
        not_finished=not_finished,
        heartbeat_late_s=samples.get("ratchet_heartbeat_max_lateness_seconds", float("nan")),
        model_in_flight=most_in_flight,
        in_flight=in_flight,
        steady_turns_per_s=steady,
        window_s=window_ms / 1000,
        cpu_ms_per_turn=per_turn_ms(cpu_spent, completed_turns),
    )


def cpu_by_process(
    worker: int,
    server: RedisServer,
    model: ModelProcess | None,
    since: dict[str, float] | None = None,
) -> dict[str, float]:
    """CPU seconds of the worker's process group, the redis-server and the model server
    (``since``: less what they had spent then)."""
    from bench.commands import cpu_s

    spent = {
        "worker": cpu_s(group=worker),
        "redis": cpu_s(pids={server.pid}),
        "model": cpu_s(pids={model.popen.pid}) if model else 0.0,
    }
    return {k: v - (since or {}).get(k, 0.0) for k, v in spent.items()}


def per_turn_ms(spent: dict[str, float], turns: int) -> dict[str, float]:
    return {k: v * 1000 / turns if turns else float("nan") for k, v in spent.items()}


@dataclass
class FloorPhase:
    turns_per_s: float
    cpu_ms_per_turn: dict[str, float]
    not_finished: int
    without_every_event: int = 0
    """Durable floor: runs whose event list lacks an event the mission asks for."""


def run_floor_phase(  # noqa: PLR0915 - one phase, read top to bottom
    args: argparse.Namespace, server: RedisServer, db: int, workdir: Path, durable: bool = False
) -> FloorPhase:
    """The same runs as :func:`run_phase`'s ceiling, on bench/io_floor.py: a plain Celery
    task per turn doing the same model call and tool, same broker, pool and concurrency.
    ``durable``: the durable floor (the writes the mission asks of a turn, and no more),
    whose every run's event list is checked for the count of events it must hold."""
    import redis

    from bench.io_floor import DONE_KEY, EVENTS_KEY, QUEUE

    url = f"{server.url}/{db}"
    model = ModelProcess(0.0, args.turns)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(PYTHONPATH=str(ROOT), RATCHET_BROKER_URL=url, IO_FLOOR_MODEL_URL=model.url)
    log = workdir / "worker-floor.log"
    command = [sys.executable, "-m", "celery", "-A", "bench.io_floor", "worker", "-P", args.pool,
               "-c", str(args.concurrency), "-Q", QUEUE, "--loglevel", "WARNING",
               "--without-mingle", "--without-gossip",
               "--hostname", f"io-floor-{os.getpid()}-{time.monotonic_ns()}@%h"]  # fmt: skip
    with log.open("ab") as handle:
        worker = subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    raw = redis.Redis.from_url(url)
    raw.delete(DONE_KEY)
    client = _floor_client(url)
    system = {"role": "system", "content": "Look the order up, then answer."}

    def send(text: str, run: str) -> None:
        messages = [system, {"role": "user", "content": text}]
        client.send_task("bench.io_floor.turn", (messages, run if durable else None),
                         queue=QUEUE)  # fmt: skip

    def wait_done(want: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while raw.llen(DONE_KEY) < want and time.monotonic() < deadline:
            if worker.poll() is not None:
                raise SystemExit(f"the floor's worker exited; see {log}")
            time.sleep(0.05)

    try:
        send("probe", "probe")
        wait_done(1, 120)
        if raw.llen(DONE_KEY) < 1:
            raise SystemExit(f"the floor's worker did not take the probe run; see {log}")
        cpu_before = cpu_by_process(worker.pid, server, model)
        started_ms = time.time_ns() // 1_000_000
        for i in range(args.runs):
            send(f"look up order A1 ({i})", f"r{i}")
        wait_done(args.runs + 1, args.timeout)
        cpu_spent = cpu_by_process(worker.pid, server, model, since=cpu_before)
        done = [int(v) for v in raw.lrange(DONE_KEY, 1, -1)]
        short = 0
        if durable:  # T-1 turns of four events, the last of three
            with raw.pipeline(transaction=False) as pipe:
                for i in range(args.runs):
                    pipe.llen(EVENTS_KEY.format(f"r{i}"))
                short = sum(n != 4 * (args.turns - 1) + 3 for n in pipe.execute())
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        model.stop()
        client.close()
        raw.close()
    errors = [line for line in log.read_text(errors="replace").splitlines()
              if "ERROR/" in line or "CRITICAL/" in line]  # fmt: skip
    for line in dict.fromkeys(e.split("]", 1)[-1][:240] for e in errors[:20]):
        print(f"  [floor] worker log: {line.strip()}", file=sys.stderr)
    turns = len(done) * args.turns
    elapsed_s = (max(done) - started_ms) / 1000 if done else float("nan")
    return FloorPhase(
        turns_per_s=turns / elapsed_s if done else 0.0,
        cpu_ms_per_turn=per_turn_ms(cpu_spent, turns),
        not_finished=args.runs - len(done),
        without_every_event=short,
    )


def _floor_client(url: str) -> Any:
    from celery import Celery

    return Celery("bench-io-floor-driver", broker=url, set_as_current=False)


def floor_rounds(
    args: argparse.Namespace, server: RedisServer, workdir: Path, first: Phase
) -> list[dict[str, Any]]:
    """``--floor-rounds`` rounds of ratchet's ceiling beside the floor's (and, with
    ``--durable-floor``, the durable floor's), the order rotated every round so all see
    the same phases of the machine; ``first`` is round 1's ratchet phase, already run.
    The floors run on databases 8 and 7, ratchet's later rounds on 9, each emptied
    before its phase. One dict per round: ``ratchet``, ``floor`` and ``durable``."""
    import redis

    def emptied(db: int) -> int:
        with redis.Redis.from_url(f"{server.url}/{db}") as client:
            client.flushdb()
        return db

    runs: dict[str, Callable[[int], Any]] = {
        "ratchet": lambda i: run_phase(f"ceiling{i + 1}", 0.0, args, server, emptied(9), workdir),
        "floor": lambda i: run_floor_phase(args, server, emptied(8), workdir),
    }
    if args.durable_floor:
        runs["durable"] = lambda i: run_floor_phase(args, server, emptied(7), workdir, True)
    names = list(runs)
    rounds: list[dict[str, Any]] = []
    for i in range(args.floor_rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        found: dict[str, Any] = {"ratchet": first} if i == 0 else {}
        for name in order:
            if name not in found:
                found[name] = runs[name](i)
        rounds.append(found)
        print(f"  round {i + 1} ({' '.join(order)}): "
              + ", ".join(f"{n} {found[n].turns_per_s:.1f}" for n in names)
              + f" turns/s; ratchet / floor {found['ratchet'].turns_per_s / found['floor'].turns_per_s:.2f}",
              file=sys.stderr, flush=True)  # fmt: skip
    return rounds


def report_floor(rounds: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The paired ceiling: turns/s ratios round by round (ratchet over the floor, and with
    the durable floor: it over the floor, ratchet over it), and CPU per turn by process
    (medians of rounds, and the median of per-round ratios)."""
    pairs = [("ratchet", "floor")]
    if "durable" in rounds[0]:
        pairs += [("durable", "floor"), ("ratchet", "durable")]
    print(f"  ceiling beside the plain-Celery floor (bench/io_floor.py), {len(rounds)} rounds "
          f"rotated, -P {args.pool} -c {args.concurrency}:")  # fmt: skip
    for mine, base in pairs:
        ratios = [r[mine].turns_per_s / r[base].turns_per_s for r in rounds]
        print(f"    {mine} / {base} turns/s, per round: {' '.join(f'{x:.2f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.2f}")  # fmt: skip
    for name in ("worker", "redis", "model"):
        medians = {
            k: statistics.median(r[k].cpu_ms_per_turn[name] for r in rounds) for k in rounds[0]
        }
        paired = []
        for mine, base in pairs:
            ratios = [r[mine].cpu_ms_per_turn[name] / r[base].cpu_ms_per_turn[name]
                      for r in rounds if r[base].cpu_ms_per_turn[name] > 0]  # fmt: skip
            if ratios:
                paired.append(f"{mine} / {base} {statistics.median(ratios):.2f}")
        print(f"    {name:6} CPU ms/turn: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items())
              + (f" (paired: {'; '.join(paired)})" if paired else ""))  # fmt: skip
    for name in ("floor", "durable"):
        unfinished = sum(r[name].not_finished for r in rounds if name in r)
        if unfinished:
            print(f"    the {name} floor left {unfinished} runs unfinished: its turns/s is not a "
                  "ceiling")  # fmt: skip
        short = sum(r[name].without_every_event for r in rounds if name in r)
        if short:
            print(f"    the {name} floor left {short} runs without every event: not a floor")


def cut(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100)[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pool", default="threads", choices=["prefork", "threads", "gevent", "solo"]
    )
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--latency", default="1,2", help="model latencies in seconds, comma-separated"
    )
    parser.add_argument("--provider", default="openai", choices=["openai", "scripted"])
    parser.add_argument("--timeout", type=float, default=600, help="seconds per phase, at most")
    parser.add_argument(
        "--stagger", type=float, default=0.0, help="spread the runs' starts over this many seconds"
    )
    parser.add_argument(
        "--ceiling-runs",
        type=int,
        default=None,
        help="runs of the zero-latency phase (default --runs)",
    )
    parser.add_argument(
        "--floor-rounds",
        type=int,
        default=0,
        help="rounds of the ceiling phase beside the plain-Celery floor (bench/io_floor.py), "
        "alternated; 0: no floor",
    )
    parser.add_argument(
        "--durable-floor",
        action="store_true",
        help="with --floor-rounds: a third phase each round, the durable floor (the writes "
        "the mission asks of a turn and no more: bench/io_floor.py)",
    )
    args = parser.parse_args()
    if args.floor_rounds and args.provider != "openai":
        parser.error("--floor-rounds needs --provider openai: the floor calls the model over HTTP")
    latencies = [float(x) for x in args.latency.split(",") if x.strip()]
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="ratchet-io-fleet-") as tmp:
        workdir = Path(tmp)
        server = RedisServer(workdir)
        server.start()
        try:
            ceiling_args = argparse.Namespace(
                **{**vars(args), "runs": args.ceiling_runs or args.runs}
            )
            phases = [run_phase("ceiling", 0.0, ceiling_args, server, 1, workdir)]
            paired = floor_rounds(ceiling_args, server, workdir, phases[0])
            for i, latency_s in enumerate(latencies):
                phases.append(
                    run_phase(f"L={latency_s:g}s", latency_s, args, server, 2 + i, workdir)
                )
        finally:
            server.stop()
    slots = 1 if args.pool == "solo" else args.concurrency
    in_flight = min(args.runs, slots)
    ceiling = phases[0].turns_per_s
    print(
        f"io fleet: {args.runs} runs x {args.turns} turns (ceiling: {args.ceiling_runs or args.runs} runs), -P {args.pool} -c {args.concurrency}, "
        f"{args.provider} provider, Redis broker and stores, {os.cpu_count()} cores; "
        f"load average {load_before} at start, {loadavg()} at end"
    )
    print(f"  {'phase':9} {'turns/s':>8} {'ideal':>8} {'ratio':>6} {'elapsed':>8} "
          f"{'ovh p50':>8} {'ovh p99':>8} {'MiB/run':>8} {'all/run':>8} {'lost':>5} {'errors':>6} "
          f"{'unfin':>5} {'hb late':>8} {'model∥':>7} {'steady':>7} {'ratio':>6}")  # fmt: skip
    for phase in phases:
        ideal = ceiling if phase.latency_s == 0 else min(in_flight / phase.latency_s, ceiling)
        print(
            f"  {phase.label:9} {phase.turns_per_s:8.1f} {ideal:8.1f} "
            f"{phase.turns_per_s / ideal if ideal else float('nan'):6.2f} "
            f"{phase.elapsed_s:7.1f}s {cut(phase.overheads_s, 50) * 1000:6.0f}ms "
            f"{cut(phase.overheads_s, 99) * 1000:6.0f}ms {phase.rss_per_run_mib:8.3f} "
            f"{phase.peak_rss_mib / phase.in_flight:8.2f} "
            f"{phase.lost_leases:5d} {phase.error_lines + phase.bad_runs:6d} "
            f"{phase.not_finished:5d} {phase.heartbeat_late_s * 1000:6.0f}ms "
            f"{phase.model_in_flight if phase.model_in_flight is not None else '-':>7} "
            f"{phase.steady_turns_per_s:7.1f} {phase.steady_turns_per_s / ideal if ideal else 0:6.2f}"
        )
    print(
        "  steady = turns/s while every run was in flight (last first model call to first "
        "completion: " + ", ".join(f"{p.label} {p.window_s:.1f} s" for p in phases) + ")"
    )
    print(f"  in flight = min(runs, slots) = {in_flight}; ideal = min(in_flight / L, ceiling); "
          "overhead = per-turn time beyond L; MiB/run = (peak - idle RSS) / in flight; "
          "all/run = peak RSS / in flight "
          + ", ".join(f"[{p.label}: {p.idle_rss_mib:.0f} -> {p.peak_rss_mib:.0f} MiB]" for p in phases))  # fmt: skip
    print("  CPU ms/turn by process: " + "; ".join(
        f"{p.label} " + ", ".join(f"{k} {v:.2f}" for k, v in p.cpu_ms_per_turn.items())
        for p in phases))  # fmt: skip
    if paired:
        report_floor(paired, args)


if __name__ == "__main__":
    main()
