"""A fleet on one machine: durable turns/s, checkpoint latency, and the sweep's cost.

    python bench/fleet.py [--runs 1000] [--turns 10] [--workers 4] [--suspended 100000]

Starts its own redis-server (and a moto S3 server) on free ports of 127.0.0.1, then:

1. **fleet** — ``--workers`` ``celery -A worker worker`` processes (prefork,
   concurrency 1 each), Redis broker and stores; ``--runs`` runs of an agent with
   ``--turns`` turns (a model call plus one tool call each, every transition
   checkpointed). Durable turns/s from the first enqueue to the last completion.
2. **checkpoint latency** — in-process, ``SnapshotStore.save`` of one run's state
   growing by a model response and a ~2 KiB tool result per turn (bench.growth's
   workload), on the Redis and the S3 snapshot stores: p50 / p99.
3. **sweep** — ``sweep_orphans`` (the ``ratchet.sweep`` task's body; its enqueue
   replaced by a counter) and ``RunStore.overdue`` with ``--suspended`` suspended
   runs present vs none, plus 10 overdue live runs in both cases: the ratio says
   whether the sweeper's cost grows with all runs or only the overdue ones.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.growth import T0_MS, created, tool_result, vocabulary  # noqa: E402
from bench.turns import start_worker, stop, wait_for, warm_up, write_agent  # noqa: E402
from runtime.fsm import apply  # noqa: E402
from runtime.models import Event, RunState, RunStatus, Suspension  # noqa: E402
from store.runs import RunRecord  # noqa: E402
from store.runs.redis import RedisRunStore, _packed  # noqa: E402
from store.snapshots import SnapshotStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def bench_fleet(url: str, env: dict[str, str], args: argparse.Namespace, workdir: Path) -> None:
    stores, broker = f"{url}/2", f"{url}/3"
    env = {
        **env,
        "RATCHET_BROKER_URL": broker,
        "RATCHET_SNAPSHOT_STORE": stores,
        "RATCHET_RUN_STORE": stores,
    }
    agent = write_agent(workdir, args.turns)
    workers = [
        start_worker("worker", env, 1, workdir / f"worker-{i}.log") for i in range(args.workers)
    ]
    try:
        warm_up(env, workers=args.workers)
        from store import open_run_store, open_snapshot_store
        from tasks.context import Context
        from tasks.messages import send_through
        from tasks.settings import Settings
        from worker.api import Ratchet
        from worker.app import make_app

        send_through(make_app(Settings(broker_url=broker)))
        api = Ratchet(Context(Settings(), open_snapshot_store(stores), open_run_store(stores)))
        started = time.perf_counter()
        ids = [api.start(agent, f"fleet run {i}") for i in range(args.runs)]
        enqueued = time.perf_counter() - started
        wait_for(lambda: len(api.list(RunStatus.COMPLETED, limit=args.runs + 1)) >= args.runs, 900)
        elapsed = time.perf_counter() - started
        wrong = sum(api.get(i).usage.model_turns != args.turns for i in ids)
    finally:
        for worker in workers:
            stop(worker)
    turns = args.runs * args.turns
    print(
        f"fleet: {args.runs} runs x {args.turns} turns on {args.workers} workers "
        f"(prefork c=1 each), Redis broker and stores, {os.cpu_count()} cores"
    )
    print(
        f"  durable turns/s:          {turns / elapsed:8.1f}   ({turns} turns in {elapsed:.1f} s)"
    )
    print(f"  runs enqueued in:         {enqueued:8.1f} s")
    if wrong:
        print(f"  WARNING: {wrong} runs did not take exactly {args.turns} turns")


def growing_states(turns: int) -> list[RunState]:
    """The states a run checkpoints, two per turn, as its transcript grows."""
    rng = random.Random(20240601)
    words = vocabulary(rng)
    state = apply(None, created("fleet-checkpoint"))
    states = [state]

    def fold(kind: str, data: dict[str, object], now: int) -> None:
        nonlocal state
        state = apply(state, Event(seq=state.seq + 1, type=kind, at_ms=now, data=data))

    for turn in range(1, turns + 1):
        now = T0_MS + turn * 1000
        call = {"id": f"call-{turn}", "name": "lookup_orders", "arguments": {"page": turn}}
        fold("model.requested", {"turn": turn}, now)
        fold(
            "model.responded",
            {
                "content": f"Looking up batch {turn}.",
                "tool_calls": [call],
                "usage": {"input_tokens": 900, "output_tokens": 40},
            },
            now,
        )
        states.append(state)
        fold("tool.requested", {"call_id": call["id"], "name": call["name"], "arguments": {}}, now)
        result = tool_result(rng, words, turn)
        fold("tool.completed", {"call_id": call["id"], "name": call["name"], "result": result}, now)
        states.append(state)
    return states


def save_latencies(snapshots: SnapshotStore, states: list[RunState]) -> list[float]:
    snapshots.save(states[0], None)
    seconds = []
    for before, state in zip(states, states[1:], strict=False):
        started = time.perf_counter()
        snapshots.save(state, before.seq)
        seconds.append(time.perf_counter() - started)
    return seconds


def percentiles(seconds: list[float]) -> str:
    cuts = statistics.quantiles(seconds, n=100)
    return f"p50 {cuts[49] * 1000:6.2f} ms   p99 {cuts[98] * 1000:6.2f} ms   ({len(seconds)} saves)"


def bench_checkpoints(url: str, turns: int, workdir: Path) -> None:
    from store.snapshots.redis import RedisSnapshotStore
    from store.snapshots.s3 import S3SnapshotStore
    from tests.s3_server import CREDENTIALS, S3Server

    states = growing_states(turns)
    redis_store = RedisSnapshotStore.from_url(f"{url}/4")
    redis_s = save_latencies(redis_store, states)
    redis_store.close()
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    moto = S3Server(workdir)
    moto.start()
    try:
        moto.create_bucket("fleet")
        s3_store = S3SnapshotStore.from_url(moto.url("fleet"))
        s3_s = save_latencies(s3_store, states)
        s3_store.close()
    finally:
        moto.close()
    print(f"checkpoint (SnapshotStore.save, one run growing ~2 KiB a turn, {turns} turns):")
    print(f"  redis:  {percentiles(redis_s)}")
    print(f"  s3:     {percentiles(s3_s)}   (moto server on loopback)")


def suspended_records(runs: RedisRunStore, count: int, batch: int = 2000) -> None:
    """Write ``count`` suspended runs through the store's own create script, pipelined."""
    client = runs._client
    for start in range(0, count, batch):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + batch, count)):
            run_id = f"waiting-{i:06d}"
            first = created(run_id)
            record = RunRecord.from_state(apply(None, first), T0_MS, None).model_copy(
                update={
                    "status": RunStatus.NEEDS_USER_INPUT,
                    "suspension": Suspension(
                        reason=RunStatus.NEEDS_USER_INPUT,
                        seq=1,
                        since_ms=T0_MS,
                        call_id="ask-1",
                        tool="request_user_input",
                    ),
                }
            )
            shard = runs._keys.of(run_id)
            runs._scripts["create"](
                keys=[
                    shard.run_key(run_id, "record"),
                    shard.run_key(run_id, "events"),
                    shard.by_created,
                    runs._status_key(shard, record.status),
                    shard.due,
                    shard.finished,
                ],
                args=[*runs._record_args(record), "1", _packed(first), ""],
                client=pipe,
            )
        pipe.execute()


def timed(call: Callable[[], object], rounds: int) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        call()
    return (time.perf_counter() - started) / rounds


def bench_sweep(url: str, suspended: int, rounds: int = 200) -> None:
    from store.snapshots.memory import MemorySnapshotStore
    from tasks.context import Context
    from tasks.recovery import sweep_orphans
    from tasks.settings import Settings

    figures = {}
    for label, count, db in (("none", 0, 5), (f"{suspended:,}", suspended, 6)):
        runs = RedisRunStore.from_url(f"{url}/{db}")
        for i in range(10):  # ten overdue live runs in both cases
            first = created(f"overdue-{i}")
            runs.create(RunRecord.from_state(apply(None, first), T0_MS, T0_MS + 1), first)
        started = time.perf_counter()
        suspended_records(runs, count)
        built = time.perf_counter() - started
        ctx = Context(Settings(), MemorySnapshotStore(), runs)
        found = sweep_orphans(ctx, enqueue=lambda run_id, seq: None)
        assert len(found) == 10, found
        figures[label] = (
            timed(runs.overdue, rounds),
            timed(partial(sweep_orphans, ctx, enqueue=lambda run_id, seq: None), rounds),
            built,
        )
        runs.close()
    none, many = figures["none"], figures[f"{suspended:,}"]
    print(f"sweep with 10 overdue runs, and N suspended runs present (mean of {rounds}):")
    for label, (overdue_s, sweep_s, built) in figures.items():
        extra = f"   (records written in {built:.1f} s)" if built > 0.01 else ""
        print(
            f"  N = {label:>8}:  overdue() {overdue_s * 1000:6.2f} ms   "
            f"sweep {sweep_s * 1000:6.2f} ms{extra}"
        )
    print(
        f"  ratio {suspended:,} / none:  overdue {many[0] / none[0]:.2f}   sweep {many[1] / none[1]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--suspended", type=int, default=100_000)
    parser.add_argument("--checkpoint-turns", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        server = RedisServer(workdir)
        server.start()
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
            env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(workdir / "data"))
            bench_fleet(server.url, env, args, workdir)
            bench_checkpoints(server.url, args.checkpoint_turns, workdir)
            bench_sweep(server.url, args.suspended)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
