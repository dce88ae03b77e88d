"""Redis commands per turn, and the worker's CPU per turn, for a fixed workload. Prints figures.

    python -m bench.commands [--runs 40] [--turns 3] [--pool prefork] [--concurrency 2] \\
        [--variants default,events=0] [--against PATH] [--rounds 2] [--no-monitor]

Starts its own redis-server (broker and both stores on one database, as a Redis
deployment runs them; ``--broker amqp``: the broker on the RabbitMQ at 127.0.0.1:5672,
in a virtual host of its own, and only the stores' commands counted; ``--broker filesystem``: the
embedded default, the folder broker and SQLite stores under a data dir, worker CPU only, no
Redis at all), a local OpenAI-compatible model server answering at once
(tests/model_server.py: the real provider path, so a limit key exists), and per
slice a fresh ``celery -A worker worker``. A slice warms the worker with one run,
reads ``INFO commandstats``, sends ``--runs`` runs of ``--turns`` model turns (the
first T-1 ask for one tool call) and waits for them, then reads it again: the
difference, over the turns taken, is what a turn costs the Redis server. It is
deterministic up to the broker's own polling (a ``BRPOP`` that times out once a
second while a worker is idle, printed separately as ``idle/s``), so it is the
figure to compare on a busy box. With the monitor on (the default) a ``MONITOR``
connection splits the commands into those a client sent and those Lua scripts ran.

The bench's own reads (the ``ZCARD`` polls that see the runs finish, and the two
``INFO`` calls) are taken out; the runs' first messages, sent by the bench, are in.

``--variants`` names settings given to the worker's environment, one slice each,
alternated for ``--rounds`` rounds so every variant sees the same phases of the
machine: ``default`` (nothing), or ``NAME=VALUE`` pairs joined by ``+`` with the
``RATCHET_`` prefix left off (``events=0`` is short for ``TASK_EVENTS=0``), or
``src=PATH``: the worker runs the code of the checkout at PATH (``src=/work/main``
beside ``default``: before and after a change, in one invocation; ``--against PATH`` is
short for putting ``src=PATH`` first, the baseline the others are paired with, and
prints the commands per turn by command for each variant side by side). CPU ms
per turn is the worker's process group (parent and pool) and the redis-server's,
from /proc/PID/task/*/schedstat.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.io_fleet import (  # noqa: E402
    TERMINAL_OR_PARKED,
    ModelProcess,
    finished_count,
    loadavg,
    write_agent,
)
from tests.redis_server import RedisServer  # noqa: E402

ALIASES = {"events": "TASK_EVENTS"}


def cpu_s(pids: set[int] | None = None, group: int | None = None) -> float:
    """CPU seconds of the processes ``pids`` or of process group ``group``: every thread's
    run time from /proc/PID/task/*/schedstat (nanoseconds; a thread that ended is gone)."""
    total_ns = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if not ((pids is not None and int(entry.name) in pids) or int(fields[2]) == group):
                continue
            for task in (entry / "task").iterdir():
                total_ns += int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue
    return total_ns / 1e9


def commandstats(client: Any) -> Counter[str]:
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})


class Monitor:
    """A MONITOR connection counting commands by (name, sent by a client or run by Lua)."""

    def __init__(self, client: Any) -> None:
        self.counts: Counter[tuple[str, bool]] = Counter()
        self.on = False
        self._stop = threading.Event()
        self._monitor = client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                seen = self._monitor.next_command()
            except Exception:  # the connection closed at stop
                return
            if self.on:
                name = str(seen["command"]).split(" ", 1)[0].lower()
                self.counts[(name, seen.get("client_type") == "lua")] += 1

    def stop(self) -> None:
        self._stop.set()
        self._monitor.connection.disconnect()
        self._thread.join(timeout=5)


def worker_env(url: str, broker_url: str, workdir: Path, variant: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(workdir / "data"))
    if url:  # else the embedded default: the folder broker and SQLite under the data dir
        env.update(RATCHET_BROKER_URL=broker_url, RATCHET_SNAPSHOT_STORE=url,
                   RATCHET_RUN_STORE=url, RATCHET_ALLOW_VOLATILE_STORE="1")  # fmt: skip
    if variant != "default":
        for pair in variant.split("+"):
            name, _, value = pair.partition("=")
            if name == "src":  # another checkout's code in the worker (a before/after pair)
                env["PYTHONPATH"] = value
            else:
                env[f"RATCHET_{ALIASES.get(name, name).upper()}"] = value
    return env


def start_worker(args: argparse.Namespace, env: dict[str, str], log: Path) -> Any:
    import subprocess

    command = [sys.executable, "-m", "celery", "-A", "worker", "worker", "-P", args.pool,
               "-c", str(args.concurrency), "--loglevel", "WARNING", "--without-mingle",
               "--without-gossip", "--hostname", f"commands-{os.getpid()}-{time.monotonic_ns()}@%h"]  # fmt: skip
    with log.open("ab") as handle:
        return subprocess.Popen(command, cwd=env["PYTHONPATH"], env=env, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def wait_finished(raw: Any, want: int, worker: Any, log: Path, timeout_s: float) -> int:
    """Poll until ``want`` runs finished; the number of polls (each len(TERMINAL_OR_PARKED) ZCARDs)."""
    polls = 0
    deadline = time.monotonic() + timeout_s
    while True:
        polls += 1
        if finished_count(raw, "ratchet")[1] >= want:
            return polls
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the runs did not finish; see {log}")
        time.sleep(0.05)


def run_slice(  # noqa: PLR0915 - one slice, read top to bottom
    variant: str, args: argparse.Namespace, server: RedisServer, index: int, workdir: Path,
    model: ModelProcess,
) -> dict[str, Any]:  # fmt: skip
    import redis

    from runtime.models import RunStatus
    from store import open_run_store, open_snapshot_store
    from tasks.context import Context
    from tasks.messages import enqueue_turn
    from tasks.settings import Settings
    from tasks.start import create_run
    from worker.app import make_app

    url = f"{server.url}/1"
    broker_url = args.broker_url or url
    env = worker_env(url, broker_url, workdir, variant)
    agent = write_agent(workdir / f"agent-{index}", "openai", args.turns, 0.0, model.url)
    log = workdir / f"worker-{index}.log"
    raw = redis.Redis.from_url(url)
    raw.flushall()
    redis_pid = int(raw.info("server")["process_id"])
    worker = start_worker(args, env, log)
    client = make_app(Settings(broker_url=broker_url))
    ctx = Context(Settings(), open_snapshot_store(url), open_run_store(url))
    monitor = Monitor(raw) if args.monitor else None
    try:
        probe = create_run(ctx, agent, "probe")
        enqueue_turn(run_id=probe.run_id, expected_seq=probe.seq, app=client)
        wait_finished(raw, 1, worker, log, 120)
        states = [create_run(ctx, agent, f"look up order A1 ({i})") for i in range(args.runs)]
        time.sleep(0.5)
        idle_before = commandstats(raw)
        time.sleep(args.idle_s)
        before = commandstats(raw)
        idle = before - idle_before
        idle["info"] -= 1
        cpu_before = cpu_s(group=worker.pid), cpu_s(pids={redis_pid})
        if monitor is not None:
            monitor.on = True
        started = time.monotonic()
        for state in states:
            enqueue_turn(run_id=state.run_id, expected_seq=state.seq, app=client)
        polls = wait_finished(raw, args.runs + 1, worker, log, args.timeout)
        elapsed_s = time.monotonic() - started
        if monitor is not None:
            monitor.on = False
        after = commandstats(raw)
        cpu_after = cpu_s(group=worker.pid), cpu_s(pids={redis_pid})
    finally:
        if monitor is not None:
            monitor.stop()
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        client.close()
    bad = [s.run_id for s in states if (r := ctx.runs.get(s.run_id)) is None
           or r.status != RunStatus.COMPLETED]  # fmt: skip
    ctx.close()
    if bad:
        raise SystemExit(f"{len(bad)} runs did not complete (e.g. {bad[0]}); see {log}")
    used = after - before
    used["zcard"] -= polls * len(TERMINAL_OR_PARKED)
    used["info"] -= 1
    used = +used
    split = Counter[tuple[str, bool]]()
    if monitor is not None:
        split = monitor.counts
        split[("zcard", False)] -= polls * len(TERMINAL_OR_PARKED)
        split = +split
    turns = args.runs * args.turns
    return {
        "variant": variant,
        "turns": turns,
        "elapsed_s": elapsed_s,
        "per_turn": {name: n / turns for name, n in used.most_common()},
        "total": sum(used.values()) / turns,
        "client": sum(n for (_, lua), n in split.items() if not lua) / turns,
        "lua": sum(n for (_, lua), n in split.items() if lua) / turns,
        "split": {
            f"{'lua ' if lua else ''}{name}": n / turns for (name, lua), n in split.most_common()
        },
        "idle_per_s": {name: n / args.idle_s for name, n in (+idle).most_common()},
        "worker_cpu_ms": (cpu_after[0] - cpu_before[0]) * 1000 / turns,
        "redis_cpu_ms": (cpu_after[1] - cpu_before[1]) * 1000 / turns,
    }


def run_embedded_slice(
    variant: str, args: argparse.Namespace, index: int, workdir: Path, model: ModelProcess
) -> dict[str, Any]:
    """One slice on the embedded default (``--broker filesystem``): no Redis, so no command
    counts; the worker's CPU per turn, measured as :func:`run_slice` does."""
    from runtime.models import RunStatus
    from store import open_run_store, open_snapshot_store
    from tasks.context import Context
    from tasks.messages import enqueue_turn
    from tasks.settings import Settings
    from tasks.start import create_run
    from worker.app import make_app

    slice_dir = workdir / f"slice-{index}"
    env = worker_env("", "", slice_dir, variant)
    settings = Settings(data_dir=slice_dir / "data")
    agent = write_agent(slice_dir / "agent", "openai", args.turns, 0.0, model.url)
    log = slice_dir / "worker.log"
    worker = start_worker(args, env, log)
    client = make_app(settings)
    ctx = Context(
        settings,
        open_snapshot_store(settings.resolved_snapshot_store),
        open_run_store(settings.resolved_run_store),
    )

    def wait(run_ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        left = list(run_ids)
        while left:
            left = [r for r in left if (rec := ctx.runs.get(r)) is None or rec.status.is_live]
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the runs did not finish; see {log}")
            time.sleep(0.05)

    try:
        probe = create_run(ctx, agent, "probe")
        enqueue_turn(run_id=probe.run_id, expected_seq=probe.seq, app=client)
        wait([probe.run_id], 120)
        states = [create_run(ctx, agent, f"look up order A1 ({i})") for i in range(args.runs)]
        time.sleep(0.5)
        cpu_before = cpu_s(group=worker.pid)
        started = time.monotonic()
        for state in states:
            enqueue_turn(run_id=state.run_id, expected_seq=state.seq, app=client)
        wait([s.run_id for s in states], args.timeout)
        elapsed_s = time.monotonic() - started
        cpu_after = cpu_s(group=worker.pid)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        client.close()
    bad = [s.run_id for s in states if (r := ctx.runs.get(s.run_id)) is None
           or r.status != RunStatus.COMPLETED]  # fmt: skip
    ctx.close()
    if bad:
        raise SystemExit(f"{len(bad)} runs did not complete (e.g. {bad[0]}); see {log}")
    turns = args.runs * args.turns
    return {"variant": variant, "turns": turns, "elapsed_s": elapsed_s, "per_turn": {},
            "total": 0.0, "client": 0.0, "lua": 0.0, "split": {}, "idle_per_s": {},
            "worker_cpu_ms": (cpu_after - cpu_before) * 1000 / turns, "redis_cpu_ms": 0.0}  # fmt: skip


def report(slices: list[dict[str, Any]], args: argparse.Namespace) -> None:
    variants = list(dict.fromkeys(s["variant"] for s in slices))
    print(f"\n{'variant':24} {'cmds/turn':>9} {'client':>7} {'in Lua':>7} "
          f"{'worker CPU ms/turn':>19} {'redis CPU ms/turn':>18}   (median of rounds; min-max)")  # fmt: skip
    for variant in variants:
        mine = [s for s in slices if s["variant"] == variant]

        def med(key: str, mine: list[dict[str, Any]] = mine) -> str:
            values = [s[key] for s in mine]
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

        client = (
            f"{statistics.median(s['client'] for s in mine):7.2f}" if args.monitor else "      -"
        )
        lua = f"{statistics.median(s['lua'] for s in mine):7.2f}" if args.monitor else "      -"
        total = (
            f"{statistics.median(s['total'] for s in mine):9.2f}"
            if args.broker != "filesystem"
            else "        -"
        )
        print(f"{variant:24} {total} {client} {lua} "
              f"{med('worker_cpu_ms'):>19} {med('redis_cpu_ms'):>18}")  # fmt: skip
    if len(variants) > 1:
        base = variants[0]
        for variant in variants[1:]:
            ratios = [
                b["worker_cpu_ms"] / a["worker_cpu_ms"]
                for a, b in zip(
                    [s for s in slices if s["variant"] == base],
                    [s for s in slices if s["variant"] == variant],
                    strict=False,
                )
            ]
            print(f"  worker CPU {variant} / {base}, paired by round: median "
                  f"{statistics.median(ratios):.3f} (rounds: "
                  + ", ".join(f"{r:.3f}" for r in ratios) + ")")  # fmt: skip
        if args.broker != "filesystem":
            by_command(slices, variants, args.monitor)
    for variant in variants:
        last = [s for s in slices if s["variant"] == variant][-1]
        print(
            f"\n{variant}: commands per turn (last round, {last['turns']} turns, "
            f"{last['elapsed_s']:.1f} s)"
        )
        shown = last["split"] if args.monitor else last["per_turn"]
        print("  " + ", ".join(f"{name} {n:.2f}" for name, n in shown.items()))
        print(
            "  idle/s: " + (", ".join(f"{n} {v:.1f}" for n, v in last["idle_per_s"].items()) or "-")
        )


def by_command(slices: list[dict[str, Any]], variants: list[str], monitor: bool) -> None:
    """Commands per turn by command (client and inside Lua apart, with the monitor on), the
    median of the rounds for each variant, and each variant's change from the first."""
    key = "split" if monitor else "per_turn"
    names = list(dict.fromkeys(name for s in slices for name in s[key]))
    medians = {
        variant: {
            name: statistics.median(
                s[key].get(name, 0.0) for s in slices if s["variant"] == variant
            )
            for name in names
        }
        for variant in variants
    }
    base = variants[0]
    names.sort(key=lambda name: (name.startswith("lua "), -medians[base][name], name))
    width = max(12, *(len(v) for v in variants))
    print(f"\ncommands per turn by command (median of rounds; change from {base}):")
    print(f"  {'command':16}" + "".join(f" {v[-width:]:>{width}}" for v in variants))
    for name in names:
        row = [f"{medians[variants[0]][name]:>{width}.2f}"]
        for variant in variants[1:]:
            change = medians[variant][name] - medians[base][name]
            row.append(f"{medians[variant][name]:.2f} ({change:+.2f})".rjust(width))
        print(f"  {name:16} " + " ".join(row))


def rabbitmq_vhost() -> str:
    """A new RabbitMQ virtual host (deleted at exit) and its URL."""
    import atexit
    import json
    import subprocess
    import uuid

    vhost = f"ratchet-bench-{uuid.uuid4().hex[:12]}"
    permissions = {"user": "guest", "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}
    subprocess.run(["rabbitmqctl", "-q", "import_definitions", "--format", "json"],
                   input=json.dumps({"vhosts": [{"name": vhost}], "permissions": [permissions]}).encode(),
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    atexit.register(subprocess.run, ["rabbitmqctl", "-q", "delete_vhost", vhost],
                    capture_output=True, timeout=60)  # fmt: skip
    return f"amqp://guest:guest@127.0.0.1:5672/{vhost}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--pool", default="prefork", choices=["prefork", "threads", "gevent", "solo"]
    )
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--variants", default="default")
    parser.add_argument("--against", type=Path,
                        help="another checkout: its code first, as the baseline (src=PATH)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--no-monitor", dest="monitor", action="store_false")
    parser.add_argument("--broker", default="redis", choices=["redis", "amqp", "filesystem"],
                        help="amqp: a virtual host of its own on the RabbitMQ at 127.0.0.1:5672; "
                        "filesystem: the embedded default (folder broker, SQLite stores)")  # fmt: skip
    args = parser.parse_args()
    args.broker_url = None
    if args.broker == "amqp":
        args.broker_url = rabbitmq_vhost()
    if args.broker == "filesystem":
        args.monitor = False
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.against is not None:
        variants.insert(0, f"src={args.against.resolve()}")
    print(f"commands: {args.runs} runs x {args.turns} turns, {args.broker} broker, -P {args.pool} -c "
          f"{args.concurrency}, variants {variants}, {args.rounds} rounds; load average "
          f"{loadavg()} at start", flush=True)  # fmt: skip
    slices: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ratchet-commands-") as tmp:
        workdir = Path(tmp)
        server = RedisServer(workdir)
        server.start()
        model = ModelProcess(0.0, args.turns)
        try:
            for round_ in range(args.rounds):
                order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
                for variant in order:
                    if args.broker == "filesystem":
                        slices.append(
                            run_embedded_slice(variant, args, len(slices), workdir, model)
                        )
                    else:
                        slices.append(run_slice(variant, args, server, len(slices), workdir, model))
                    counted = (
                        ""
                        if args.broker == "filesystem"
                        else f"{slices[-1]['total']:.2f} cmds/turn, "
                    )
                    print(f"  round {round_ + 1} {variant}: {counted}"
                          f"worker {slices[-1]['worker_cpu_ms']:.2f} CPU ms/turn", flush=True)  # fmt: skip
        finally:
            model.stop()
            server.stop()
    report(slices, args)
    print(f"\nload average {loadavg()} at end")


if __name__ == "__main__":
    main()
