"""Fleet-wide rate limits against a provider that enforces its own, and answers 429 beyond.

    python bench/limits.py [--runs 500] [--rpm 600] [--tpm 150000] [--workers 2] \\
        [--concurrency 16] [--latency 0.2] [--no-baseline]

Starts its own redis-server (broker and both stores), a local OpenAI-compatible
server (tests/model_server.py in a process of its own) that enforces ``--rpm``
requests and ``--tpm`` tokens a minute with token buckets two seconds deep and
answers 429 with ``Retry-After`` beyond them, and ``--workers`` worker processes
(``-P threads -c CONCURRENCY``). Every run makes two model calls (one tool call
between them). ``--rpm 1200`` halves the time the bench takes.

Two phases, the same runs:

1. **limited** — the agent file sets the provider's own limits in ``[limits]``
   (``requests_per_minute``, ``tokens_per_minute``): the fleet holds itself to them;
2. **baseline** — the same agent without them: the fleet learns the limit from
   the 429s alone (each is a countdown on the queue, the whole key held off for the
   ``Retry-After``).

Per phase it prints: runs completed, failed or stalled (and not finished); the
server's accepted requests a minute over the whole phase and over its steady part
(10th to 90th percentile of the accepted requests) as a ratio to ``--rpm``, its
tokens a minute against ``--tpm``, and the 429s; worker slot time (workers x
concurrency x the phase's wall time) against the time inside turn tasks that
ended waiting on a limit, and the time spent asking the limit store, from the
workers' metrics (``ratchet_turn_seconds_total{throttled="yes"}``,
``ratchet_limit_check_seconds_total``) — nothing sleeps in a slot, so what a wait
costs is that bookkeeping; the order runs finished in: the share of pairs of runs
that finished in the opposite order to the one they started in (0: every run
started earlier finished earlier), and the most runs under way at once (started,
not finished). The load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.redis_server import RedisServer, _free_port  # noqa: E402

FINISHED = ("completed", "failed", "cancelled", "dead_lettered", "stalled", "needs_reconciliation")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


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


def write_agent(directory: Path, url: str, args: argparse.Namespace, limited: bool) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        f'name = "limits-{"limited" if limited else "baseline"}"',
        'model = "openai:limits-bench"',
        'system = "Look the order up, then answer."',
        'tools = ["examples.refunds:lookup_order"]',
        "model_timeout_s = 60",
        "[provider]",
        f'base_url = "{url}"',
        "timeout_s = 30",
        "[limits]",
        'key = "bench-provider"',
        "completion_tokens = 16",
        "max_wait_s = 1800",
    ]
    if limited:
        lines += [f"requests_per_minute = {args.rpm:g}", f"tokens_per_minute = {args.tpm:g}",
                  f"burst_s = {args.burst:g}"]  # fmt: skip
    lines += ["[budgets]", "max_turns = 10", "max_tool_calls = 5"]
    path = directory / "limits.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class ModelProcess:
    """tests/model_server.py with its limits, in a process of its own."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.model_server", "--latency", str(args.latency),
             "--turns", "2", "--rpm", str(args.rpm), "--tpm", str(args.tpm), "--burst", "2"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.popen.stdout is not None
        self.url = self.popen.stdout.readline().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            raise SystemExit(f"the model server did not start: {self.url!r}")

    def stop(self) -> dict[str, object]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.close()
        lines = self.popen.stdout.read().strip().splitlines()
        self.popen.wait(timeout=30)
        return json.loads(lines[-1]) if lines else {}


@dataclass
class Phase:
    label: str
    completed: int
    bad: int
    not_finished: int
    accepted: int
    refused: int
    rate: float
    steady_rate: float
    tokens_rate: float
    wall_s: float
    slot_s: float
    throttled_turn_s: float
    turn_s: float
    check_s: float
    throttled: dict[str, float]
    inversions: float
    most_under_way: int
    mean_under_way: float


def per_minute(times: list[float]) -> float:
    if len(times) < 2 or times[-1] <= times[0]:
        return float("nan")
    return (len(times) - 1) / (times[-1] - times[0]) * 60


def inverted_share(pairs: list[tuple[int, int]]) -> float:
    """Of all pairs of runs, the share that finished in the opposite order to their start."""
    ordered = [end for _, end in sorted(pairs)]
    inversions, seen = 0, list[int]()  # merge-free count: fine for a few thousand runs
    for end in reversed(ordered):
        inversions += bisect.bisect_left(seen, end)
        bisect.insort(seen, end)
    total = len(ordered) * (len(ordered) - 1) // 2
    return inversions / total if total else float("nan")


def under_way(pairs: list[tuple[int, int]]) -> tuple[int, float]:
    """The most runs started and not finished at once, and the mean over the phase."""
    marks = sorted([(s, 1) for s, _ in pairs] + [(e, -1) for _, e in pairs])
    level, most, area = 0, 0, 0.0
    for (at, step), (after, _) in zip(marks, marks[1:] + marks[-1:], strict=True):
        level += step
        most = max(most, level)
        area += level * (after - at)
    span = marks[-1][0] - marks[0][0] if marks else 0
    return most, area / span if span else float("nan")


def run_phase(label: str, limited: bool, args: argparse.Namespace, server: RedisServer,  # noqa: C901, PLR0915
              db: int, workdir: Path) -> Phase:  # fmt: skip
    import redis

    from runtime.models import RunStatus
    from store import open_run_store, open_snapshot_store
    from tasks.context import Context
    from tasks.messages import enqueue_turn
    from tasks.settings import Settings
    from tasks.start import create_run
    from worker.app import make_app

    url = f"{server.url}/{db}"
    model = ModelProcess(args)
    agent = write_agent(workdir / label, model.url, args, limited)
    ports = [_free_port() for _ in range(args.workers)]
    workers = []
    for i, port in enumerate(ports):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
        env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(workdir / f"data-{label}-{i}"),
                   RATCHET_BROKER_URL=url, RATCHET_SNAPSHOT_STORE=url, RATCHET_RUN_STORE=url,
                   RATCHET_METRICS_PORT=str(port),
                   RATCHET_TURN_TIME_LIMIT_S="600")  # fmt: skip
        command = [sys.executable, "-m", "celery", "-A", "worker", "worker", "-P", "threads",
                   "-c", str(args.concurrency), "--loglevel", "WARNING", "--without-mingle",
                   "--without-gossip", "--hostname", f"limits-{label}-{i}-{os.getpid()}@%h"]  # fmt: skip
        log = (workdir / f"worker-{label}-{i}.log").open("ab")
        workers.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
    client = make_app(Settings(broker_url=url))
    ctx = Context(Settings(), open_snapshot_store(url, max_connections=4),
                  open_run_store(url, max_connections=4))  # fmt: skip
    raw = redis.Redis.from_url(url)

    def finished() -> int:
        pipe = raw.pipeline(transaction=False)
        for status in FINISHED:
            pipe.zcard(f"ratchet:runs:status:{status}")
        return int(sum(pipe.execute()))

    try:
        deadline = time.monotonic() + 120
        while not all(scrape(p) for p in ports):
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                raise SystemExit(f"a worker did not start; see {workdir}/worker-{label}-*.log")
            time.sleep(0.2)
        states = [create_run(ctx, agent, f"look up order A1 ({i})") for i in range(args.runs)]
        started = time.time()
        for state in states:
            enqueue_turn(run_id=state.run_id, expected_seq=state.seq, app=client)
        deadline = time.monotonic() + args.timeout
        while finished() < args.runs and time.monotonic() < deadline:
            if any(w.poll() is not None for w in workers):
                break
            time.sleep(0.2)
        wall_s = time.time() - started
        samples = [scrape(p) for p in ports]
    finally:
        for worker in workers:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        summary = model.stop()
        client.close()
    completed = bad = not_finished = 0
    pairs = []
    for state in states:
        record = ctx.runs.get(state.run_id)
        if record is None or record.status.is_live:
            not_finished += 1
            continue
        if record.status != RunStatus.COMPLETED:
            bad += 1
            print(f"  [{label}] run {state.run_id} {record.status.value}: {record.error}",
                  file=sys.stderr)  # fmt: skip
            continue
        completed += 1
        events = ctx.runs.events(state.run_id)
        begun = next(e.at_ms for e in events if e.type == "model.requested")
        ended = next(e.at_ms for e in events if e.type == "run.completed")
        pairs.append((begun, ended))
    ctx.close()
    accepted = sorted(float(t) for t in summary.get("accepted_at", []))  # type: ignore[attr-defined]
    tenth, ninetieth = int(len(accepted) * 0.1), int(len(accepted) * 0.9)
    span_min = (accepted[-1] - accepted[0]) / 60 if len(accepted) > 1 else float("nan")

    def total(name: str) -> float:
        return sum(s.get(name, 0.0) for s in samples)

    throttled = {
        reason: total(f'ratchet_throttled_total{{reason="{reason}"}}')
        for reason in ("reserved", "over_limit", "429", "concurrency")
    }
    most, mean = under_way(pairs)
    return Phase(
        label=label,
        completed=completed,
        bad=bad,
        not_finished=not_finished,
        accepted=len(accepted),
        refused=int(summary.get("refused", 0)),  # type: ignore[call-overload]
        rate=per_minute(accepted),
        steady_rate=per_minute(accepted[tenth:ninetieth]),
        tokens_rate=int(summary.get("accepted_tokens", 0)) / span_min,  # type: ignore[call-overload]
        wall_s=wall_s,
        slot_s=wall_s * args.workers * args.concurrency,
        throttled_turn_s=total('ratchet_turn_seconds_total{throttled="yes"}'),
        turn_s=total('ratchet_turn_seconds_total{throttled="no"}'),
        check_s=total("ratchet_limit_check_seconds_total"),
        throttled=throttled,
        inversions=inverted_share(pairs),
        most_under_way=most,
        mean_under_way=mean,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--rpm", type=float, default=600, help="the provider's requests/min")
    parser.add_argument("--tpm", type=float, default=150_000, help="the provider's tokens/min")
    parser.add_argument("--burst", type=float, default=1.0, help="[limits] burst_s")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per model answer")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per phase, at most")
    parser.add_argument("--no-baseline", action="store_true", help="skip the 429-only phase")
    args = parser.parse_args()
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="ratchet-limits-") as tmp:
        workdir = Path(tmp)
        server = RedisServer(workdir)
        server.start()
        try:
            phases = [run_phase("limited", True, args, server, 1, workdir)]
            if not args.no_baseline:
                phases.append(run_phase("baseline", False, args, server, 2, workdir))
        finally:
            server.stop()
    print(
        f"limits: {args.runs} runs x 2 model calls; provider enforces {args.rpm:g} requests/min "
        f"and {args.tpm:g} tokens/min (429 + Retry-After beyond); {args.workers} workers "
        f"-P threads -c {args.concurrency}; model latency {args.latency:g} s; "
        f"{os.cpu_count()} cores; load average {load_before} at start, {loadavg()} at end"
    )
    for p in phases:
        print(f"  [{p.label}] runs: {p.completed} completed, {p.bad} failed/stalled/parked, "
              f"{p.not_finished} not finished, in {p.wall_s:.1f} s")  # fmt: skip
        print(f"  [{p.label}] provider: {p.accepted} accepted, {p.refused} answered 429 "
              f"({p.refused / max(1, p.accepted + p.refused):.1%} of requests); accepted "
              f"{p.rate:.1f}/min overall = {p.rate / args.rpm:.3f} of the limit, "
              f"{p.steady_rate:.1f}/min steady = {p.steady_rate / args.rpm:.3f}; tokens "
              f"{p.tokens_rate:.0f}/min = {p.tokens_rate / args.tpm:.3f} of the limit")  # fmt: skip
        print(f"  [{p.label}] slots: {p.slot_s:.0f} slot-s in all; turns that ended waiting "
              f"on a limit took {p.throttled_turn_s:.2f} slot-s = {p.throttled_turn_s / p.slot_s:.4f}"
              f" of them (other turns {p.turn_s:.1f} slot-s = {p.turn_s / p.slot_s:.3f}); "
              f"asking the limit store {p.check_s:.2f} s; throttled turns: "
              + ", ".join(f"{k} {int(v)}" for k, v in p.throttled.items()))  # fmt: skip
        print(f"  [{p.label}] order: {p.inversions:.3f} of run pairs finished in the opposite "
              f"order to their start; runs under way at once: at most {p.most_under_way}, "
              f"mean {p.mean_under_way:.1f} (of {args.runs})")  # fmt: skip
    if len(phases) == 2:
        limited, baseline = phases
        print(f"  limited vs baseline: 429s {limited.refused} vs {baseline.refused}; steady rate "
              f"ratio {limited.steady_rate / baseline.steady_rate:.3f}; under way at once "
              f"{limited.mean_under_way:.1f} vs {baseline.mean_under_way:.1f} (mean); wall "
              f"{limited.wall_s / baseline.wall_s:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
