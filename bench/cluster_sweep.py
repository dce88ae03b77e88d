"""The stores on Redis Cluster beside one Redis: a sweep's cost, and the hottest key of a fleet.

    python -m bench.cluster_sweep [--runs 100000] [--due 1000] [--rounds 3] [--shards 64]
    python -m bench.cluster_sweep --fleet [--fleet-runs 200] [--fleet-targets cluster,single]

Starts its own servers on 127.0.0.1: one ``redis-server`` and a six-node cluster (three
primaries, a replica each; tests/cluster_servers.py), both with AOF as a store needs.

**Sweep.** ``--runs`` live runs are written straight into each target in exactly the run
store's layout (its own keyspace code names every key; pipelined HSET, RPUSH and ZADDs,
the writes create.lua makes), ``--due`` of them past due and the rest due an hour on.
Each round re-arms the due ones (the sweep before postponed them), reads ``INFO
commandstats`` on every primary, runs :func:`tasks.recovery.sweep_orphans` (its resumes
collected, not sent: no broker is involved), and reads the stats again: the
difference is what one sweep costs the servers (commands run by scripts included),
with its wall time. Printed per target, then the cluster's over one Redis.

**Fleet** (``--fleet``): real ``celery -A worker worker`` processes (two, two prefork
processes each) with their stores on the target and their broker on a Redis of its own,
beat sweeping every half second, run ``--fleet-runs`` runs of a lookup, a refund booked
once per idempotency key, and an answer; one worker is SIGKILLed a third of the way.
Counted: runs completed, runs lost (not completed within the time allowed), and
refunds booked more than once per order (the ledger). Meanwhile a ``MONITOR``
connection to every primary reads every command the stores' servers run; each is
counted against the key it touches (the first argument, for the commands ratchet's
scripts and clients send per key; an ``EVALSHA`` is counted by the commands its
script runs, which MONITOR shows as ``lua`` lines; keyless commands — TIME, INFO,
PING, CLUSTER, SCRIPT — are left out). A MONITOR sees every command, not a sample,
but it slows the server, so the fleet's wall time is not a throughput figure. Printed:
the hottest key's share of all keyed commands, and the hottest index key's share of
the index commands (index: the ``runs:*``, ``procs``, ``proc:*`` and ``snapshots``
keys) beside 1/shards.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.models import Event, RunStatus  # noqa: E402
from store.conformance.records import record  # noqa: E402
from store.runs.redis import RedisRunStore, _packed  # noqa: E402
from store.snapshots.redis import RedisSnapshotStore  # noqa: E402
from tasks.context import Context  # noqa: E402
from tasks.recovery import sweep_orphans  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from tests.cluster_servers import running_redis_cluster  # noqa: E402
from tests.redis_server import HOST, RedisServer, _client  # noqa: E402

NOW_MS = 1_800_000_000_000
"""The sweeps' clock (the store's, injected): the due runs are due a minute before it."""
WRITE_BATCH = 5_000
"""Runs written per pipeline."""
INDEX_KEY = re.compile(rb":(runs:|procs$|proc:|snapshots$)")


class Target:
    """One Redis deployment the stores are opened on: one server, or the cluster."""

    def __init__(self, name: str, url: str, primaries: list[int]) -> None:
        self.name, self.url, self.primaries = name, url, primaries

    def commandstats(self) -> Counter[str]:
        """Calls per command, summed over the primaries (INFO itself left out)."""
        totals: Counter[str] = Counter()
        for port in self.primaries:
            with _client(port) as client:
                for name, stats in client.info("commandstats").items():
                    if name != "cmdstat_info":
                        totals[name.removeprefix("cmdstat_")] += int(stats["calls"])
        return totals


def primaries_of(nodes: list[RedisServer]) -> list[int]:
    found = []
    for node in nodes:
        with _client(node.port) as client:
            if client.info("replication").get("role") == "master":
                found.append(node.port)
    return found


# --- the sweep ----------------------------------------------------------------------------


def write_runs(runs: RedisRunStore, total: int, due: int) -> float:
    """``total`` live runs in the store's layout, ``due`` of them past due; seconds taken."""
    started = time.perf_counter()
    template = record("RUNID", status=RunStatus.MODEL, due_at_ms=0).model_dump_json()
    first = _packed(Event(seq=1, type="run.created", at_ms=NOW_MS, data={"input": "hi"}))
    client: Any = runs._client
    for start in range(0, total, WRITE_BATCH):
        pipe = client.pipeline(transaction=False)
        for n in range(start, min(start + WRITE_BATCH, total)):
            run_id = f"run-{n:07d}"
            due_ms = NOW_MS - 60_000 if n < due else NOW_MS + 3_600_000
            shard = runs._keys.of(run_id)
            # What create.lua writes for a run in status model, due at due_ms.
            pipe.hset(shard.run_key(run_id, "record"), mapping={
                "record": template.replace("RUNID", run_id).replace('"due_at_ms":0',
                                                                     f'"due_at_ms":{due_ms}'),
                "last_seq": 1, "status": "model", "due": due_ms, "next": due_ms, "fin": "",
            })  # fmt: skip
            pipe.rpush(shard.run_key(run_id, "events"), first)
            pipe.zadd(shard.by_created, {run_id: NOW_MS - 86_400_000})
            pipe.zadd(f"{shard.status_prefix}model", {run_id: NOW_MS - 86_400_000})
            pipe.zadd(shard.due, {run_id: due_ms})
        pipe.execute()
    return time.perf_counter() - started


def rearm(runs: RedisRunStore, due: int) -> None:
    """Put the due runs back past due (the last sweep postponed them)."""
    client: Any = runs._client
    pipe = client.pipeline(transaction=False)
    for n in range(due):
        run_id = f"run-{n:07d}"
        shard = runs._keys.of(run_id)
        pipe.zadd(shard.due, {run_id: NOW_MS - 60_000})
        pipe.hset(shard.run_key(run_id, "record"), mapping={"due": NOW_MS - 60_000,
                                                            "next": NOW_MS - 60_000})  # fmt: skip
    pipe.execute()


def collect(into: list[str]) -> Callable[[str, int], None]:
    """An enqueue for the sweeper that collects the run ids instead of sending resumes."""

    def enqueue(run_id: str, seq: int) -> None:
        into.append(run_id)

    return enqueue


def sweep_bench(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    runs = RedisRunStore.from_url(target.url, prefix="bench", clock=lambda: NOW_MS)
    snapshots = RedisSnapshotStore.from_url(target.url, prefix="bench")
    ctx = Context(Settings(redis_prefix="bench"), snapshots, runs)
    wrote_s = write_runs(runs, args.runs, args.due)
    print(f"  {target.name}: wrote {args.runs:,} runs in {wrote_s:.1f} s", flush=True)
    results = []
    for _ in range(args.rounds):
        rearm(runs, args.due)
        enqueued: list[str] = []
        before = target.commandstats()
        started = time.perf_counter()
        sweep_orphans(ctx, enqueue=collect(enqueued))
        wall_s = time.perf_counter() - started
        spent = target.commandstats() - before
        assert len(enqueued) == args.due, (target.name, len(enqueued))
        results.append((wall_s, sum(spent.values()), spent))
    ctx.close()
    best = min(results, key=lambda r: r[0])
    print(
        f"  {target.name}: sweep of {args.due} due among {args.runs:,}: "
        f"{', '.join(f'{r[0] * 1000:.0f}' for r in results)} ms; "
        f"{best[1]} commands ({', '.join(f'{k} {v}' for k, v in best[2].most_common(6))})",
        flush=True,
    )
    return {"wall_s": best[0], "commands": best[1]}


# --- the fleet ----------------------------------------------------------------------------


class Monitor(threading.Thread):
    """Every command a server runs, counted against the key it touches (see the module)."""

    KEYLESS = frozenset({b"TIME", b"INFO", b"PING", b"CLUSTER", b"SCRIPT", b"CLIENT",
                         b"HELLO", b"READONLY", b"COMMAND", b"SELECT", b"CONFIG"})  # fmt: skip

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.keys: Counter[bytes] = Counter()
        self.stop = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        with socket_to(self.port) as sock:
            sock.sendall(b"MONITOR\r\n")
            buffer = b""
            self.ready.set()
            while not self.stop.is_set():
                try:
                    data = sock.recv(1 << 20)
                except TimeoutError:
                    continue
                if not data:
                    return
                buffer += data
                *lines, buffer = buffer.split(b"\r\n")
                for line in lines:
                    self.count(line)

    def count(self, line: bytes) -> None:
        # +1733412345.123456 [0 127.0.0.1:5555] "HSET" "key" ...   or  [0 lua] "ZADD" "key" ...
        _, _, rest = line.partition(b"] ")
        words = re.findall(rb'"((?:[^"\\]|\\.)*)"', rest)
        if len(words) < 2:
            return
        command = words[0].upper()
        if command in self.KEYLESS or command in (b"EVALSHA", b"EVAL", b"MULTI", b"EXEC"):
            return
        self.keys[words[1]] += 1


def socket_to(port: int) -> Any:
    import socket

    sock = socket.create_connection((HOST, port))
    sock.settimeout(0.5)
    return sock


def fleet_bench(target: Target, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tasks.start import create_run
    from tests.helpers import call, refunds, turn, write_agent
    from tests.workers import WorkerProcesses, worker_env
    from worker.app import make_app

    prefix = f"fleet-{target.name}"
    broker = RedisServer(workdir / f"broker-{target.name}")
    broker.directory.mkdir()
    broker.start()
    ledger = workdir / f"{target.name}.ledger"
    env = {
        **worker_env(broker.url + "/0", ledger, workdir / f"data-{target.name}",
                     RATCHET_SWEEP_INTERVAL_S="0.5"),
        "RATCHET_RUN_STORE": target.url, "RATCHET_SNAPSHOT_STORE": target.url,
        "RATCHET_REDIS_PREFIX": prefix,
    }  # fmt: skip
    ctx = Context(
        Settings(redis_prefix=prefix),
        RedisSnapshotStore.from_url(target.url, prefix=prefix),
        RedisRunStore.from_url(target.url, prefix=prefix),
    )
    monitors = [Monitor(port) for port in target.primaries]
    for monitor in monitors:
        monitor.start()
        monitor.ready.wait(5)
    workers = WorkerProcesses(env, workdir / f"logs-{target.name}")
    workers.directory.mkdir()
    beat = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "worker", "beat", "-s",
         str(workdir / f"beat-{target.name}")],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    tools = ["examples.refunds:lookup_order", "examples.refunds:send_refund"]
    started = time.monotonic()
    try:
        doomed = workers.start("--concurrency", "2")
        workers.start("--concurrency", "2")
        app = make_app(Settings(broker_url=broker.url + "/0"))
        run_ids = []
        for n in range(args.fleet_runs):
            script = [
                turn("look", call("lookup_order", order_id=f"A{n}")),
                turn("refund", call("send_refund", order_id=f"A{n}", amount_cents=100 + n)),
                turn("Done."),
            ]
            agent = write_agent(workdir / f"agents-{target.name}", script, name=f"a{n}",
                                tools=tools)  # fmt: skip
            run_ids.append(create_run(ctx, agent, f"refund A{n}").run_id)
            app.send_task("ratchet.turn", (run_ids[-1], 1), queue="ratchet.turns")
        killed = False
        deadline = time.monotonic() + args.fleet_timeout
        while time.monotonic() < deadline:
            done = sum(1 for r in (ctx.runs.get(i) for i in run_ids) if r and r.status.is_terminal)
            if not killed and done >= args.fleet_runs // 3:
                doomed.kill()
                killed = True
            if done == args.fleet_runs:
                break
            time.sleep(0.5)
        wall_s = time.monotonic() - started
        statuses = Counter(
            r.status.value if r else "missing" for r in (ctx.runs.get(i) for i in run_ids)
        )
        booked = Counter(refunds(ledger)) if ledger.exists() else Counter()
    finally:
        os.killpg(beat.pid, signal.SIGKILL)
        beat.wait()
        workers.stop_all()
        for monitor in monitors:
            monitor.stop.set()
        for monitor in monitors:
            monitor.join(5)
        ctx.close()
        broker.stop()
    keys: Counter[bytes] = sum((m.keys for m in monitors), Counter())
    index = Counter({k: v for k, v in keys.items() if INDEX_KEY.search(k)})
    total, index_total = sum(keys.values()), sum(index.values())
    hot_key, hot = keys.most_common(1)[0]
    hot_index, hot_i = index.most_common(1)[0]
    completed = statuses.get("completed", 0)
    duplicates = sum(c - 1 for c in booked.values() if c > 1)
    print(
        f"  {target.name}: {args.fleet_runs} runs in {wall_s:.0f} s, one worker killed: "
        f"completed {completed}, lost {args.fleet_runs - completed} ({dict(statuses)}), "
        f"refunds booked twice {duplicates}, orders refunded {len(booked)}\n"
        f"    keyed commands {total:,}: hottest key {hot_key.decode()} {hot / total:.1%}; "
        f"index commands {index_total:,}: hottest index key {hot_index.decode()} "
        f"{hot_i / index_total:.1%}",
        flush=True,
    )
    return {"hot_index_share": hot_i / index_total, "hot_share": hot / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--due", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--fleet", action="store_true", help="the fleet part instead")
    parser.add_argument("--fleet-runs", type=int, default=200)
    parser.add_argument("--fleet-targets", default="cluster,single")
    parser.add_argument("--fleet-timeout", type=float, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cluster-bench-") as tmp:
        workdir = Path(tmp)
        single = RedisServer(workdir / "single")
        single.directory.mkdir()
        single.start()
        try:
            with running_redis_cluster(workdir / "cluster") as cluster:
                targets = {
                    "single": Target("single", single.url + "/0", [single.port]),
                    "cluster": Target(
                        "cluster", cluster.url(args.shards), primaries_of(cluster.nodes)
                    ),
                }
                if args.fleet:
                    print(f"fleet of {args.fleet_runs} runs ({args.shards} shards on the "
                          f"cluster; 1/shards = {1 / args.shards:.1%})", flush=True)  # fmt: skip
                    for name in args.fleet_targets.split(","):
                        fleet_bench(targets[name], args, workdir)
                    return
                print(f"sweep: {args.runs:,} runs, {args.due} due, {args.shards} shards; "
                      f"best of {args.rounds} rounds", flush=True)  # fmt: skip
                found = {name: sweep_bench(t, args) for name, t in targets.items()}
                c, s = found["cluster"], found["single"]
                print(
                    f"  cluster / one Redis: time {c['wall_s'] / s['wall_s']:.2f}x, "
                    f"commands {c['commands'] / s['commands']:.2f}x"
                )
        finally:
            single.stop()


if __name__ == "__main__":
    main()
