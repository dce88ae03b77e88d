"""Does a checkpoint cost the same at turn 1000 as at turn 1? Prints figures, not pass/fail.

One run of N turns (default 200; ``--turns 1000``) whose transcript grows by a
~2 KiB tool result per turn — JSON records of words and ids drawn from a
seeded RNG, so zlib gets a realistic ratio, not a trivial one. Each turn goes
through the real persistence path the turn task uses: the events
(``model.requested``, ``model.responded``, ``tool.requested``,
``tool.completed``) folded by :func:`runtime.fsm.apply`, appended to a Redis
run store, and two checkpoints (after the model responded, after the tool
completed) saved with the compare-and-set, exactly as ``tasks/turn.py``
records and checkpoints.

Backends: the Redis snapshot store and the S3 one (moto's server; its saves also
rewrite compacted transcript objects, so its bytes per turn grow slowly, for loads
of at most four requests: bench/s3_loads.py), each with
the Redis run store holding the event log. The bench starts its own
``redis-server`` and moto server on 127.0.0.1 and stops them.

Measured per turn: bytes the snapshot store sent (the backend's own counter:
heads and transcript fragments as packed on the wire), for Redis also the
server's ``total_net_input_bytes`` (every command of the turn, events
included), and the wall time of the turn's appends and saves. Turns 1-20 are
compared with the last 20. At the end: bytes stored per turn, the event log
included (Redis ``MEMORY USAGE`` of the run's keys; S3 object sizes).

    python bench/growth.py                 # 200 turns, redis and s3
    python bench/growth.py --turns 1000 --backend redis
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from runtime.fsm import apply  # noqa: E402
from runtime.models import Budgets, Event, RunState  # noqa: E402
from store.runs import RunRecord  # noqa: E402
from store.runs.redis import RedisRunStore  # noqa: E402
from store.snapshots import SnapshotStore  # noqa: E402
from store.snapshots import format as snapshot_format  # noqa: E402
from tests.redis_server import running_redis_server  # noqa: E402

WINDOW = 20
T0_MS = 1_700_000_000_000
RESULT_CHARS = 2048


def vocabulary(rng: random.Random, size: int = 3000) -> list[str]:
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"] + ["qu", "th", "sh"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(size)]


def tool_result(rng: random.Random, words: list[str], turn: int) -> str:
    """~2 KiB of order records: ids, numbers and free text, different every turn."""
    records: list[dict[str, Any]] = []
    while True:
        records.append(
            {
                "order": f"ord-{rng.getrandbits(40):010x}",
                "customer": " ".join(rng.choices(words, k=2)).title(),
                "sku": f"SKU-{rng.randint(0, 99999):05d}",
                "qty": rng.randint(1, 40),
                "price": round(rng.uniform(1, 500), 2),
                "note": " ".join(rng.choices(words, k=rng.randint(4, 12))),
                "turn": turn,
            }
        )
        text = json.dumps(records, sort_keys=True)
        if len(text) >= RESULT_CHARS:
            return text


@dataclass
class Turn:
    number: int
    snapshot_bytes: int
    net_input_bytes: int
    seconds: float


@dataclass
class Result:
    backend: str
    turns: list[Turn] = field(default_factory=list)
    stored_snapshot_bytes: int = 0
    stored_event_bytes: int = 0
    load_seconds: float = 0.0


def created(run_id: str) -> Event:
    data = {
        "run_id": run_id,
        "agent": "growth",
        "agent_file": "bench/growth.toml",
        "binding": "0" * 64,
        "input": "Reconcile every order of the quarter.",
        "system": "You are a careful bookkeeper. Look orders up; never guess.",
        "budgets": Budgets(max_turns=100_000, max_tool_calls=100_000).model_dump(mode="json"),
        "created_at_ms": T0_MS,
    }
    return Event(seq=1, type="run.created", at_ms=T0_MS, data=data)


def drive(
    backend: str,
    snapshots: SnapshotStore,
    runs: RedisRunStore,
    client: redis.Redis,
    turns: int,
    sent: Callable[[], int],
) -> tuple[Result, RunState]:
    rng = random.Random(20240601)
    words = vocabulary(rng)
    run_id = f"growth-{backend}"
    first = created(run_id)
    state = apply(None, first)
    runs.create(RunRecord.from_state(state, T0_MS, None), first)
    snapshots.save(state, expected_seq=None)
    saved = state.seq
    result = Result(backend)

    def record(items: list[tuple[str, dict[str, Any]]], now: int) -> None:
        nonlocal state
        events = []
        for kind, data in items:
            event = Event(seq=state.seq + 1, type=kind, at_ms=now, data=data)
            state = apply(state, event)
            events.append(event)
        runs.append(RunRecord.from_state(state, now, now + 10_000), events, owner=None)

    def checkpoint() -> None:
        nonlocal saved
        snapshots.save(state, expected_seq=saved)
        saved = state.seq

    for turn in range(1, turns + 1):
        now = T0_MS + turn * 1000
        call_id = f"call-{turn}"
        arguments = {"query": f"orders batch {turn}", "page": turn}
        before_sent, before_net = sent(), _net_input(client)
        started = time.perf_counter()
        record([("model.requested", {"turn": turn})], now)
        response = {
            "content": f"Looking up batch {turn}.",
            "tool_calls": [{"id": call_id, "name": "lookup_orders", "arguments": arguments}],
            "usage": {"input_tokens": 900 + 500 * turn, "output_tokens": 40},
        }
        record([("model.responded", response)], now)
        checkpoint()
        record(
            [
                (
                    "tool.requested",
                    {"call_id": call_id, "name": "lookup_orders", "arguments": arguments},
                )
            ],
            now,
        )
        text = tool_result(rng, words, turn)
        record(
            [("tool.completed", {"call_id": call_id, "name": "lookup_orders", "result": text})],
            now,
        )
        checkpoint()
        seconds = time.perf_counter() - started
        result.turns.append(
            Turn(turn, sent() - before_sent, _net_input(client) - before_net, seconds)
        )
    started = time.perf_counter()
    loaded = snapshots.load(run_id)
    result.load_seconds = time.perf_counter() - started
    assert loaded == state, "the snapshot did not load back equal to the state saved"
    assert snapshots.load_document(run_id) == snapshot_format.encode(state)
    result.stored_event_bytes = sum(
        _memory(client, f"ratchet:run:{{{run_id}}}:{part}") for part in ("events", "record")
    )
    return result, state


def _net_input(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_input_bytes"])


def _memory(client: redis.Redis, key: str) -> int:
    used = client.memory_usage(key, samples=0)
    return int(used or 0)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def report(
    result: Result, turns: int, document_bytes: int, sent_target: str = "target <= 1.10"
) -> None:
    first, last = result.turns[:WINDOW], result.turns[-WINDOW:]
    kib = 1024.0
    first_b = mean([t.snapshot_bytes for t in first])
    last_b = mean([t.snapshot_bytes for t in last])
    # Medians: a GC pause or a scheduler hiccup in a 20-turn window is not growth.
    first_s = statistics.median(t.seconds for t in first)
    last_s = statistics.median(t.seconds for t in last)
    first_net = mean([t.net_input_bytes for t in first])
    last_net = mean([t.net_input_bytes for t in last])
    stored = (result.stored_snapshot_bytes + result.stored_event_bytes) / turns / kib
    print(
        f"\n== {result.backend}: {turns} turns (full snapshot document now {document_bytes / kib:,.0f} KiB)"
    )
    print(
        f"  snapshot bytes sent per turn   turns 1-{WINDOW}: {first_b:8.0f}   last {WINDOW}: {last_b:8.0f}   ratio {last_b / first_b:5.2f}  ({sent_target})"
    )
    if first_net:
        print(
            f"  redis net input per turn       turns 1-{WINDOW}: {first_net:8.0f}   last {WINDOW}: {last_net:8.0f}   ratio {last_net / first_net:5.2f}  (events, record and snapshot)"
        )
    print(
        f"  median time per turn (ms)          turns 1-{WINDOW}: {first_s * 1000:8.2f}   last {WINDOW}: {last_s * 1000:8.2f}   ratio {last_s / first_s:5.2f}  (target <= 1.10)"
    )
    print(
        f"  stored per turn, event log incl.: {stored:.2f} KiB  (snapshot {result.stored_snapshot_bytes / turns / kib:.2f} + event log {result.stored_event_bytes / turns / kib:.2f}; target <= 2.5)"
    )
    print(f"  load of the whole snapshot at the end: {result.load_seconds * 1000:.1f} ms")


def run_redis(turns: int, workdir: Path) -> None:
    from store.snapshots.redis import RedisSnapshotStore

    with running_redis_server(workdir) as server:
        url = f"{server.url}/0"
        client = redis.Redis.from_url(url)
        snapshots = RedisSnapshotStore.from_url(url)
        runs = RedisRunStore.from_url(url)
        result, state = drive(
            "redis", snapshots, runs, client, turns, lambda: snapshots.bytes_written
        )
        run = "growth-redis"
        result.stored_snapshot_bytes = sum(
            _memory(client, f"ratchet:run:{{{run}}}:{part}") for part in ("snapshot", "transcript")
        )
        report(result, turns, len(snapshot_format.encode(state)))
        snapshots.close()
        runs.close()
        client.close()


def run_s3(turns: int, workdir: Path) -> None:
    from store.snapshots.s3 import S3SnapshotStore
    from tests.s3_server import CREDENTIALS, S3Server

    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    moto = S3Server(workdir)
    moto.start()
    try:
        moto.create_bucket("growth")
        with running_redis_server(workdir) as server:
            url = f"{server.url}/0"
            client = redis.Redis.from_url(url)
            snapshots = S3SnapshotStore.from_url(moto.url("growth"))
            runs = RedisRunStore.from_url(url)
            result, state = drive(
                "s3", snapshots, runs, client, turns, lambda: snapshots.bytes_written
            )
            for turn in result.turns:
                turn.net_input_bytes = 0  # Redis holds only the event log here
            listing = snapshots._client.get_paginator("list_objects_v2").paginate(Bucket="growth")
            result.stored_snapshot_bytes = sum(
                o["Size"] for p in listing for o in p.get("Contents", ())
            )
            # S3 trades flat bytes for flat loads: a save may rewrite the last
            # compacted objects (store/snapshots/s3.py, bench/s3_loads.py).
            compacted = "S3 compacts: grows with the cube root of the run's length"
            report(result, turns, len(snapshot_format.encode(state)), compacted)
            snapshots.close()
            runs.close()
            client.close()
    finally:
        moto.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--backend", choices=["redis", "s3", "both"], default="both")
    args = parser.parse_args()
    if args.turns < 2 * WINDOW:
        parser.error(f"--turns must be at least {2 * WINDOW}")
    with tempfile.TemporaryDirectory(prefix="ratchet-growth-") as tmp:
        if args.backend in ("redis", "both"):
            run_redis(args.turns, Path(tmp))
        if args.backend in ("s3", "both"):
            run_s3(args.turns, Path(tmp))


if __name__ == "__main__":
    main()
