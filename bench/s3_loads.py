"""What does loading a long run's snapshot cost on S3? Prints figures, not pass/fail.

One run of N saves (default 400; ``--saves``), each adding a ~2 KiB tool result
(bench/growth.py's seeded records), stored twice on one moto server: in the layout the
release before head paths wrote (one transcript object per save, found by listing:
``tests/s3_layouts.save_before_paths``), and by this release's store (a head naming at
most three compacted objects). Then a worker that never saw the run loads each one
``--loads`` times (a fresh store handle each time, so nothing is remembered).

Measured, per layout: HTTP requests per load by operation (botocore's ``before-send``
event, one per request on the wire), the median load time, requests and body bytes per
save (the last 100 saves), the objects and bytes left under the run's prefix.

    python -m bench.s3_loads                # 400 saves, 5 loads per layout
    python -m bench.s3_loads --saves 2000
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.growth import T0_MS, tool_result, vocabulary  # noqa: E402
from runtime.models import Budgets, Message, RunState, RunStatus  # noqa: E402
from store.snapshots.s3 import S3SnapshotStore  # noqa: E402
from tests.s3_layouts import requests_sent, save_before_paths  # noqa: E402
from tests.s3_server import CREDENTIALS, S3Server  # noqa: E402

Save = Callable[[S3SnapshotStore, RunState, "int | None"], None]
TAIL = 100


@dataclass
class Figures:
    layout: str
    load_requests: Counter[str]
    load_seconds: float
    save_requests: float
    save_bytes: float
    objects: int
    stored_bytes: int


def states(saves: int) -> list[RunState]:
    rng = random.Random(20240601)
    words = vocabulary(rng)
    state = RunState(
        run_id="long-run",
        seq=1,
        agent="growth",
        agent_file="bench/growth.toml",
        binding="0" * 64,
        input="Reconcile every order of the quarter.",
        status=RunStatus.MODEL,
        budgets=Budgets(max_turns=100_000, max_tool_calls=100_000),
        created_at_ms=T0_MS,
        transcript=(Message(role="user", content="Reconcile every order of the quarter."),),
    )
    made = [state]
    for seq in range(2, saves + 1):
        result = Message(role="tool", content=tool_result(rng, words, seq), name="lookup")
        state = state.model_copy(update={"seq": seq, "transcript": state.transcript + (result,)})
        made.append(state)
    return made


def measure(layout: str, url: str, run: list[RunState], save: Save, loads: int) -> Figures:
    store = S3SnapshotStore.from_url(url)
    per_save: list[int] = []
    written: list[int] = []
    previous: int | None = None
    for state in run:
        before = store.bytes_written
        with requests_sent(store) as sent:
            save(store, state, previous)
        per_save.append(sum(sent.values()))
        written.append(store.bytes_written - before)
        previous = state.seq
    requests: Counter[str] = Counter()
    seconds: list[float] = []
    for _ in range(loads):
        reader = S3SnapshotStore.from_url(url)
        with requests_sent(reader) as sent:
            started = time.perf_counter()
            loaded = reader.load(run[-1].run_id)
            seconds.append(time.perf_counter() - started)
        if loaded != run[-1]:
            raise SystemExit(f"{layout}: the load did not return the last state saved")
        requests = sent
        reader.close()
    listing = store._client.get_paginator("list_objects_v2").paginate(
        Bucket=store._bucket, Prefix=store._transcript_prefix(run[-1].run_id)
    )
    sizes = [o["Size"] for page in listing for o in page.get("Contents", ())]
    store.close()
    return Figures(
        layout,
        requests,
        statistics.median(seconds),
        statistics.mean(per_save[-TAIL:]),
        statistics.mean(written[-TAIL:]),
        len(sizes),
        sum(sizes),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=400)
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    if args.saves < TAIL:
        parser.error(f"--saves must be at least {TAIL}")
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    run = states(args.saves)
    with tempfile.TemporaryDirectory(prefix="ratchet-s3-loads-") as tmp:
        moto = S3Server(Path(tmp))
        moto.start()
        try:
            figures = []
            for layout, save in (
                ("before paths", save_before_paths),
                ("head paths", S3SnapshotStore.save),
            ):
                bucket = layout.replace(" ", "-")
                moto.create_bucket(bucket)
                figures.append(measure(layout, moto.url(bucket), run, save, args.loads))
        finally:
            moto.close()
    print(f"{args.saves} saves of a ~2 KiB tool result each, moto on 127.0.0.1")
    print(f"load: a fresh store handle, median of {args.loads}; save: mean of the last {TAIL}")
    print(
        f"{'layout':<14}{'load requests':>15}{'load ms':>10}{'save requests':>15}"
        f"{'save KiB':>10}{'objects':>9}{'stored KiB':>12}"
    )
    for f in figures:
        print(
            f"{f.layout:<14}{sum(f.load_requests.values()):>15}{f.load_seconds * 1000:>10.1f}"
            f"{f.save_requests:>15.2f}{f.save_bytes / 1024:>10.1f}{f.objects:>9}"
            f"{f.stored_bytes / 1024:>12.0f}"
        )
    for f in figures:
        detail = ", ".join(f"{n} {op}" for op, n in sorted(f.load_requests.items()))
        print(f"  {f.layout}: a load sent {detail}")
    before, after = figures
    print(
        f"head paths / before paths: load requests "
        f"{sum(after.load_requests.values()) / sum(before.load_requests.values()):.3f}x, "
        f"load time {after.load_seconds / before.load_seconds:.3f}x, "
        f"bytes per save {after.save_bytes / before.save_bytes:.2f}x"
    )


if __name__ == "__main__":
    main()
