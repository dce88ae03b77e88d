"""Streaming at scale: what a delta's trip costs the worker, and how long it takes to a reader.

    python -m bench.streaming [--quick] [--runs 200] [--turns 3] [--rounds 5]
                              [--pieces 20] [--pace-ms 20] [--observers 4]

Starts its own redis-server (AOF on: broker, run store and snapshot store), a paced
OpenAI-compatible model (bench/stream_server.py, a process of its own: every answer is
``--pieces`` pieces of text, one each ``--pace-ms``, streamed or whole as the request
asks, each piece carrying its send time), and one ``celery -A worker worker -P gevent
-c RUNS``. Two agents differ only in ``[provider] stream``. Each round runs three
phases, in an order that rotates from round to round so that none always goes first:

- **a** ``stream = false``: the answer arrives whole after the same wait;
- **b** ``stream = true``, no observer: nobody watches, so the worker asks for each
  answer whole (store/live ``watched``: one read per model call);
- **c** ``stream = true``, one ``Ratchet.stream`` reader per run (threads in
  ``--observers`` processes of their own), started before the runs are sent.

Each phase sends ``--runs`` runs at once, ``--turns`` model turns each (a
``lookup_order`` call each turn but the last). Per phase: the worker's CPU per model
turn (main and pool process, from /proc, from the first send to the last run's end),
redis-server's (INFO cpu), turns/s, how busy the worker was (CPU s per wall s: near 1.0
a gevent worker is saturated and queues), and for **c** the delay of each delta from
the server's write to the reader's receipt (CLOCK_MONOTONIC, one clock for every
process on the machine), p50 / p99, with the deltas shown of those sent (worker/watch.py
drops a piece written after its answer's ``model.responded`` was read: the event carries
the whole answer, so a reader's text is complete either way). Printed:
each round's paired ratios b/a and c/a of worker CPU per turn and their medians (the
same moment of the machine on both sides of a ratio), and the load average at start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stream_server import sent_ns  # noqa: E402
from bench.turns import group_cpu_s  # noqa: E402
from tests.redis_server import RedisServer, _free_port  # noqa: E402

PHASES = {"a": "stream off", "b": "on, unread", "c": "on, read"}
FINISHED = ("completed", "failed", "cancelled", "dead_lettered", "stalled",
            "needs_reconciliation")  # fmt: skip


@dataclass
class Phase:
    round: int
    name: str
    runs: int
    turns: int
    elapsed_s: float
    worker_cpu_s: float
    redis_cpu_s: float
    bad_runs: int
    delays_ms: list[float] = field(default_factory=list)
    deltas_expected: int = 0
    observers_cpu_s: float = 0.0

    def per_turn_ms(self, cpu_s: float) -> float:
        return cpu_s * 1000 / (self.runs * self.turns)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def redis_cpu_s(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def cut(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100)[q - 1]


def write_agent(directory: Path, stream: bool, url: str, turns: int) -> Path:
    name = "stream-on" if stream else "stream-off"
    path = directory / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\nsystem = "Look the order up, then answer."\n'
        'tools = ["examples.refunds:lookup_order"]\nmodel = "openai:stream-bench"\n'
        f'model_timeout_s = 300\n[provider]\nbase_url = "{url}"\ntimeout_s = 120\n'
        f"stream = {'true' if stream else 'false'}\n"
        f"[budgets]\nmax_turns = {turns + 1}\nmax_tool_calls = {turns + 1}\n"
    )
    return path


class ModelProcess:
    """bench/stream_server.py in a process of its own; stops when its stdin closes."""

    def __init__(self, turns: int, pieces: int, pace_ms: float) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "bench.stream_server", "--turns", str(turns),
             "--pieces", str(pieces), "--pace-ms", str(pace_ms)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.popen.stdout is not None
        self.url = self.popen.stdout.readline().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            raise SystemExit(f"the model server did not start: {self.url!r}")

    def stop(self) -> dict[str, Any]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.close()
        lines = self.popen.stdout.read().strip().splitlines()
        self.popen.wait(timeout=30)
        return dict(json.loads(lines[-1])) if lines else {}


def start_worker(concurrency: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "celery", "-A", "worker", "worker", "-P", "gevent",
               "-c", str(concurrency), "--loglevel", "WARNING", "--without-mingle",
               "--without-gossip", "--hostname", f"stream-bench-{os.getpid()}@%h"]  # fmt: skip
    with log.open("ab") as handle:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def observe(url: str, ids_file: Path, out_file: Path, timeout_s: float) -> None:
    """An observer process: one ``Ratchet.stream`` reader per run id, each in a thread.

    Prints ``ready`` once every reader has read its run's first event (so none joins
    late), and writes each delta's delay (ms) and the CPU seconds it spent from then on to ``out_file``."""
    from store import open_run_store, open_snapshot_store
    from tasks.context import Context
    from tasks.settings import Settings
    from worker.api import Ratchet

    ids = ids_file.read_text().split()
    # A reader holds a connection while its XREAD blocks: one each, and a few to spare.
    runs = open_run_store(url, max_connections=len(ids) + 8)
    api = Ratchet(Context(Settings(), open_snapshot_store(url, max_connections=4), runs))
    delays_ms: list[float] = []
    started = threading.Semaphore(0)

    def follow(run_id: str) -> None:
        seen = iter(api.stream(run_id, timeout_s=timeout_s))
        next(seen, None)  # the run's first event, written when it was created
        started.release()
        for item in seen:
            text = item.data.get("text") if item.kind == "model.delta" else None
            at = sent_ns(text) if isinstance(text, str) else None
            if at is not None:
                delays_ms.append((time.monotonic_ns() - at) / 1e6)

    readers = [threading.Thread(target=follow, args=(i,), daemon=True) for i in ids]
    for reader in readers:
        reader.start()
    for _ in readers:
        started.acquire(timeout=60)
    cpu_s = time.process_time()  # what reading costs, not what importing ratchet did
    print("ready", flush=True)
    for reader in readers:
        reader.join(timeout_s + 10)
    cpu_s = time.process_time() - cpu_s
    out_file.write_text(json.dumps({"delays_ms": delays_ms, "cpu_s": cpu_s}))


class Observers:
    """``count`` observer processes sharing ``ids`` between them."""

    def __init__(self, ids: list[str], count: int, url: str, env: dict[str, str],
                 workdir: Path, timeout_s: float) -> None:  # fmt: skip
        self.outs: list[Path] = []
        self.popens: list[subprocess.Popen[str]] = []
        for n in range(count):
            share = ids[n::count]
            if not share:
                continue
            ids_file, out = workdir / f"observe-{n}.ids", workdir / f"observe-{n}.json"
            ids_file.write_text("\n".join(share))
            out.unlink(missing_ok=True)
            self.outs.append(out)
            self.popens.append(subprocess.Popen(
                [sys.executable, "-m", "bench.streaming", "--observe", url,
                 "--ids", str(ids_file), "--out", str(out), "--timeout", str(timeout_s)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
            ))  # fmt: skip
        for popen in self.popens:
            assert popen.stdout is not None
            if popen.stdout.readline().strip() != "ready":
                raise SystemExit("an observer process did not start (see its stderr above)")

    def results(self, timeout_s: float) -> tuple[list[float], float]:
        delays: list[float] = []
        cpu_s = 0.0
        for popen, out in zip(self.popens, self.outs, strict=True):
            popen.wait(timeout=timeout_s)
            found = json.loads(out.read_text())
            delays += found["delays_ms"]
            cpu_s += found["cpu_s"]
        return delays, cpu_s


def finished(client: Any, prefix: str = "ratchet") -> int:
    pipe = client.pipeline(transaction=False)
    for status in FINISHED:
        pipe.zcard(f"{prefix}:runs:status:{status}")
    return int(sum(pipe.execute()))


def run_phase(  # noqa: PLR0913 - one phase, read top to bottom
    name: str, number: int, agent: Path, args: argparse.Namespace, bench: Bench
) -> Phase:
    from runtime.models import RunStatus
    from tasks.messages import enqueue_turn
    from tasks.start import create_run

    states = [create_run(bench.ctx, agent, f"look up order A1 ({i})") for i in range(args.runs)]
    ids = [state.run_id for state in states]
    observers = None
    if name == "c":
        observers = Observers(ids, args.observers, bench.url, bench.env, bench.workdir,
                              args.timeout)  # fmt: skip
    before = finished(bench.raw)
    cpu, server = group_cpu_s(bench.pgid), redis_cpu_s(bench.raw)
    started = time.monotonic()
    for state in states:
        enqueue_turn(run_id=state.run_id, expected_seq=state.seq, app=bench.app)
    deadline = started + args.timeout
    while finished(bench.raw) < before + args.runs and time.monotonic() < deadline:
        if bench.worker.poll() is not None:
            raise SystemExit(f"the worker exited; see {bench.log}")
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    phase = Phase(
        number, name, args.runs, args.turns, elapsed,
        group_cpu_s(bench.pgid) - cpu, redis_cpu_s(bench.raw) - server, 0,
    )  # fmt: skip
    for run_id in ids:
        record = bench.ctx.runs.get(run_id)
        if record is None or record.status != RunStatus.COMPLETED:
            phase.bad_runs += 1
        elif record.usage.model_turns != args.turns:
            phase.bad_runs += 1
    if observers is not None:
        phase.delays_ms, phase.observers_cpu_s = observers.results(args.timeout)
        phase.deltas_expected = args.runs * args.turns * args.pieces
    return phase


@dataclass
class Bench:
    url: str
    env: dict[str, str]
    workdir: Path
    worker: subprocess.Popen[bytes]
    log: Path
    ctx: Any
    app: Any
    raw: Any

    @property
    def pgid(self) -> int:
        return self.worker.pid


def warm_up(bench: Bench, agents: list[Path]) -> None:
    """One run per agent, through to its end: the worker consumes, has loaded both agents
    and opened its connections before anything is timed."""
    from tasks.messages import enqueue_turn
    from tasks.start import create_run

    before = finished(bench.raw)
    for agent in agents:
        state = create_run(bench.ctx, agent, "probe")
        enqueue_turn(run_id=state.run_id, expected_seq=state.seq, app=bench.app)
    deadline = time.monotonic() + 120
    while finished(bench.raw) < before + len(agents):
        if bench.worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the worker did not finish the probe runs; see {bench.log}")
        time.sleep(0.05)


def run_all(args: argparse.Namespace, workdir: Path, model: ModelProcess) -> list[Phase]:
    import redis

    from store import open_run_store, open_snapshot_store
    from tasks.context import Context
    from tasks.settings import Settings
    from worker.app import make_app

    server = RedisServer(workdir)
    server.start()
    url = f"{server.url}/1"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(workdir / "data"),
               RATCHET_BROKER_URL=url, RATCHET_SNAPSHOT_STORE=url, RATCHET_RUN_STORE=url,
               RATCHET_METRICS_PORT=str(_free_port()))  # fmt: skip
    agents = {"a": write_agent(workdir, False, model.url, args.turns)}
    agents["b"] = agents["c"] = write_agent(workdir, True, model.url, args.turns)
    log = workdir / "worker.log"
    worker = start_worker(args.runs, env, log)
    observer_env = {k: v for k, v in env.items() if k != "RATCHET_METRICS_PORT"}
    bench = Bench(
        url, observer_env, workdir, worker, log,
        Context(Settings(), open_snapshot_store(url, max_connections=8),
                open_run_store(url, max_connections=8)),
        make_app(Settings(broker_url=url)), redis.Redis.from_url(url),
    )  # fmt: skip
    phases: list[Phase] = []
    try:
        warm_up(bench, [agents["a"], agents["b"]])
        print(f"  worker pid {worker.pid}, log {log}", file=sys.stderr)
        for number in range(1, args.rounds + 1):
            shift = (number - 1) % len(args.phases)
            order = args.phases[shift:] + args.phases[:shift]
            for name in order:
                phase = run_phase(name, number, agents[name], args, bench)
                phases.append(phase)
                print(f"  round {number} {name}: {phase.per_turn_ms(phase.worker_cpu_s):.2f} "
                      f"worker ms/turn, {phase.elapsed_s:.1f} s", file=sys.stderr)  # fmt: skip
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        bench.app.close()
        bench.ctx.close()
        server.stop()
    errors = [line for line in log.read_text(errors="replace").splitlines()
              if "ERROR/" in line or "CRITICAL/" in line or "WARNING/" in line]  # fmt: skip
    for line in dict.fromkeys(e.split("]", 1)[-1][:200].strip() for e in errors[:20]):
        print(f"  worker log: {line}", file=sys.stderr)
    return phases


def report(
    args: argparse.Namespace, phases: list[Phase], load: str, served: dict[str, Any]
) -> None:
    print(
        f"streaming bench: {args.runs} runs at once x {args.turns} turns, each answer "
        f"{args.pieces} pieces {args.pace_ms:g} ms apart; one worker -P gevent -c {args.runs}; "
        f"Redis broker and stores (AOF); {args.observers} observer processes in c; "
        f"{os.cpu_count()} cores; load average {load} at start, {loadavg()} at end"
    )
    print(f"  {'round':>5} {'phase':12} {'worker':>7} {'redis':>6} {'turns/s':>8} "
          f"{'busy':>5} {'bad':>4} {'deltas':>13} {'p50':>7} {'p99':>7} {'obs':>6}")  # fmt: skip
    for p in phases:
        latency = (f"{len(p.delays_ms):6d}/{p.deltas_expected:<6d} {cut(p.delays_ms, 50):5.1f}ms "
                   f"{cut(p.delays_ms, 99):5.1f}ms {p.per_turn_ms(p.observers_cpu_s):6.2f}"
                   if p.name == "c" else "")  # fmt: skip
        print(
            f"  {p.round:5d} {p.name + ' ' + PHASES[p.name]:12} "
            f"{p.per_turn_ms(p.worker_cpu_s):7.2f} {p.per_turn_ms(p.redis_cpu_s):6.2f} {p.runs * p.turns / p.elapsed_s:8.1f} "
            f"{p.worker_cpu_s / p.elapsed_s:5.2f} {p.bad_runs:4d} {latency}"
        )
    print(
        "  (CPU ms per model turn: worker = its processes (a gevent worker is one), "
        "redis = redis-server, obs = the observer processes; busy = worker CPU s per wall s)"
    )
    by_round: dict[int, dict[str, Phase]] = {}
    for p in phases:
        by_round.setdefault(p.round, {})[p.name] = p
    ratios: dict[str, list[float]] = {}
    for number, row in sorted(by_round.items()):
        if "a" not in row:
            continue
        cells = []
        for name in [n for n in "bc" if n in row]:
            worker = row[name].worker_cpu_s / row["a"].worker_cpu_s
            server = row[name].redis_cpu_s / row["a"].redis_cpu_s
            ratios.setdefault(name, []).append(worker)
            ratios.setdefault(f"redis {name}", []).append(server)
            cells.append(f"{name}/a {worker:5.3f} (redis {server:5.3f})")
        print(f"  round {number}: worker CPU per turn " + ", ".join(cells))
    medians = [f"{name}/a {statistics.median(ratios[name]):5.3f} "
               f"(redis {statistics.median(ratios[f'redis {name}']):5.3f})"
               for name in "bc" if name in ratios]  # fmt: skip
    if medians:
        print("  median: worker CPU per turn " + ", ".join(medians) + "   (target: b/a <= 1.05)")
    delays = [d for p in phases for d in p.delays_ms]
    expected = sum(p.deltas_expected for p in phases)
    print(f"  delta delay, server write -> reader, all rounds: p50 {cut(delays, 50):.1f} ms, "
          f"p99 {cut(delays, 99):.1f} ms, max {max(delays, default=float('nan')):.1f} ms; "
          f"{len(delays)} of {expected} deltas shown live (the rest came after their answer)")  # fmt: skip
    print(f"  model server: {served.get('requests')} answers on {served.get('connections')} "
          f"connections, {served.get('streamed')} pieces "
          f"streamed, most in flight {served.get('most_in_flight')}, wrote a piece up to "
          f"{served.get('late_ms', float('nan')):.1f} ms after it was due")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 runs x 2 turns, 2 rounds")
    parser.add_argument("--runs", type=int, default=None, help="runs at once (default 200)")
    parser.add_argument("--turns", type=int, default=None, help="model turns a run (default 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of a, b, c (default 5)")
    parser.add_argument("--pieces", type=int, default=20)
    parser.add_argument("--pace-ms", type=float, default=20.0)
    parser.add_argument("--observers", type=int, default=4, help="observer processes in c")
    parser.add_argument(
        "--phases", default="abc", help="which phases a round runs (a is needed for the ratios)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds a phase, at most")
    parser.add_argument("--observe", metavar="REDIS_URL", help=argparse.SUPPRESS)
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.observe:
        observe(args.observe, args.ids, args.out, args.timeout)
        return
    quick = {"runs": 40, "turns": 2, "rounds": 2} if args.quick else {}
    for key, default in {"runs": 200, "turns": 3, "rounds": 5}.items():
        if getattr(args, key) is None:
            setattr(args, key, quick.get(key, default))
    load = loadavg()
    with tempfile.TemporaryDirectory(prefix="ratchet-streaming-") as tmp:
        model = ModelProcess(args.turns, args.pieces, args.pace_ms)
        try:
            phases = run_all(args, Path(tmp), model)
        finally:
            served = model.stop()
    report(args, phases, load, served)


if __name__ == "__main__":
    main()
