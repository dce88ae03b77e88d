"""A turn's own CPU, without Celery: does it stay flat as the transcript grows? Prints figures.

    python -m bench.turn_cpu [--turns 300] [--backend redis|sqlite|both]

Drives one run through ``tasks.turn.advance`` in this process — the lease, the
load, the model call, the tool call, every checkpoint, exactly what a worker's
``ratchet.turn`` does minus Celery's delivery — and times each turn with
``time.process_time`` (CPU, not wall: this machine's speed drifts between runs
and within one, which a wall-clock slope over a second of turns picks up as
growth). Each message is ~1 KiB of prose-like text, one tool call a turn.

Two ways to take the turns, side by side in the same invocation on the same
stores (turn i of one run, then turn i of the other, so both see the same moment
of the machine):

1. **one process** (the baseline): every turn in the process that took the last,
   which remembers the run's state (``Context.remember_checkpoint``);
2. **two processes**: turns alternate between two contexts with stores of their
   own, as a prefork pool's two processes may take a chain's turns: each
   remembers the state of two turns ago and reads only the messages since.

For each: CPU ms per turn over the first and the last 20 turns (medians), the
slope of per-turn CPU against the turn number (least squares over medians of
20-turn blocks, µs per turn per turn: ~0 means a turn costs the same at turn
300 as at turn 1), that slope less the baseline's (turn by turn: what is left
once the machine's own drift, which both saw, is taken out), and the mean as a
ratio to the baseline's.
The Redis backend starts its own ``redis-server`` on a free port.

``--against PATH``: before and after a change. Each of ``--rounds`` rounds runs this
bench once on this checkout's code and once on the checkout at PATH (each in a fresh
process, the order alternated round by round, so both see the same phases of the
machine) and prints, per backend and way, this checkout's mean CPU ms per turn over
PATH's: the median of the rounds' ratios and each round's.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store import open_run_store, open_snapshot_store  # noqa: E402
from tasks.context import Context  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from tasks.start import create_run  # noqa: E402
from tasks.turn import advance  # noqa: E402
from tests.helpers import call, turn, write_agent  # noqa: E402
from tests.redis_server import running_redis_server  # noqa: E402

WINDOW = 20
WORDS = (
    "the of and to in is that for it as was with be by on not this are or from at which "
    "order refund customer account policy shipping invoice amount date status request"
).split()


def script(turns: int, seed: int = 7) -> list[dict[str, object]]:
    rng = random.Random(seed)
    return [
        turn(" ".join(rng.choice(WORDS) for _ in range(170)), call("lookup_order", order_id="A1"))
        for _ in range(turns)
    ] + [turn("done")]


def interleaved(ways: dict[str, Callable[[int], Context]], run_ids: list[str]) -> list[list[float]]:
    """Take the runs' turns side by side, turn i of each in turn, run k's on
    ``ways[k](i)``: every way sees the same moment of the machine. CPU seconds per turn."""
    dones = [
        advance(contexts(0), run_id, None)
        for contexts, run_id in zip(ways.values(), run_ids, strict=True)
    ]
    cpu: list[list[float]] = [[] for _ in run_ids]
    while all(done.outcome == "next" for done in dones):
        for k, (contexts, run_id) in enumerate(zip(ways.values(), run_ids, strict=True)):
            ctx = contexts(len(cpu[k]) + 1)
            started = time.process_time()
            dones[k] = advance(ctx, run_id, dones[k].seq)
            cpu[k].append(time.process_time() - started)
    if any(done.outcome != "completed" for done in dones):
        raise SystemExit(f"the runs ended {[done.outcome for done in dones]}, not completed")
    return [turns[:-1] for turns in cpu]  # the last turn answers without a tool call


def slope_us(cpu: list[float]) -> float:
    """µs per turn per turn: least squares over the medians of WINDOW-turn blocks."""
    blocks = [
        statistics.median(cpu[i : i + WINDOW]) for i in range(0, len(cpu) - WINDOW + 1, WINDOW)
    ]
    xs = [i * WINDOW + WINDOW / 2 for i in range(len(blocks))]
    return statistics.linear_regression(xs, blocks).slope * 1e6


def measure(backend: str, turns: int, directory: Path, url: str) -> None:
    agent = write_agent(
        directory,
        script(turns),
        tools=["examples.refunds:lookup_order"],
        budgets={"max_turns": turns + 5, "max_tool_calls": turns + 5},
    )
    store = f"{url}/1" if backend == "redis" else f"sqlite://{directory / 'runs.sqlite3'}"
    settings = Settings(data_dir=directory / "data", allow_volatile_store=True)
    opened = [
        Context(settings, open_snapshot_store(store), open_run_store(store)) for _ in range(3)
    ]
    one, two = opened[0], opened[1:]
    ways: dict[str, Callable[[int], Context]] = {
        "one process": lambda i: one,
        "two processes": lambda i: two[i % 2],
    }
    try:
        run_ids = [create_run(one, agent, "bench").run_id for _ in ways]
        measured = interleaved(ways, run_ids)
        base = measured[0]
        for name, cpu in zip(ways, measured, strict=True):
            mean = statistics.fmean(cpu)
            first = statistics.median(cpu[:WINDOW]) * 1000
            last = statistics.median(cpu[-WINDOW:]) * 1000
            over = slope_us([a - b for a, b in zip(cpu, base, strict=True)])
            print(
                f"{backend:6} {name:26} {len(cpu)} turns: CPU ms/turn {first:5.2f} first "
                f"{WINDOW} -> {last:5.2f} last {WINDOW}, slope {slope_us(cpu):6.2f} µs/turn² "
                f"({over:+6.2f} over one process), mean {mean * 1000:5.2f} ms "
                f"({mean / statistics.fmean(base):4.2f}x one process)"
            )
    finally:
        for ctx in opened:
            ctx.close()


MEAN = re.compile(r"^(\w+)\s+(one process|two processes)\s.*\smean\s+([\d.]+) ms", re.M)


def means(checkout: Path, turns: int, backend: str) -> dict[tuple[str, str], float]:
    """One run of this bench on ``checkout``'s code in a fresh process: its mean CPU ms per
    turn by (backend, way)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, "-m", "bench.turn_cpu", "--turns", str(turns), "--backend", backend]
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=1800, check=False)  # fmt: skip
    found = {(b, way): float(ms) for b, way, ms in MEAN.findall(done.stdout)}
    if done.returncode != 0 or not found:
        raise SystemExit(f"bench.turn_cpu on {checkout} failed:\n{done.stdout}{done.stderr}")
    return found


def against(other: Path, turns: int, backend: str, rounds: int) -> None:
    """This checkout's mean CPU ms per turn over ``other``'s, rounds alternated."""
    here = Path(__file__).resolve().parents[1]
    ratios: dict[tuple[str, str], list[float]] = {}
    for round_ in range(rounds):
        order = [here, other] if round_ % 2 == 0 else [other, here]
        measured = {checkout: means(checkout, turns, backend) for checkout in order}
        for key, ms in measured[here].items():
            ratios.setdefault(key, []).append(ms / measured[other][key])
        print(f"  round {round_ + 1}: " + ", ".join(
            f"{b} {way} {measured[here][(b, way)]:.2f} / {measured[other][(b, way)]:.2f} ms"
            for b, way in measured[here]), flush=True)  # fmt: skip
    print(f"\nmean CPU ms/turn, {here} / {other}, paired by round:")
    for (b, way), found in ratios.items():
        print(f"  {b:6} {way:14} median {statistics.median(found):.3f} (rounds: "
              + ", ".join(f"{r:.3f}" for r in found) + ")")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--backend", choices=["redis", "sqlite", "both"], default="both")
    parser.add_argument("--against", type=Path, help="another checkout: before and after")
    parser.add_argument("--rounds", type=int, default=4, help="with --against")
    args = parser.parse_args()
    if args.turns < 2 * WINDOW + 1:
        parser.error(f"--turns must be at least {2 * WINDOW + 1}")
    if args.against is not None:
        against(args.against.resolve(), args.turns, args.backend, args.rounds)
        return
    backends = ["redis", "sqlite"] if args.backend == "both" else [args.backend]
    for backend in backends:
        with tempfile.TemporaryDirectory() as tmp:
            if backend == "redis":
                with running_redis_server(Path(tmp)) as server:
                    measure(backend, args.turns, Path(tmp), server.url)
            else:
                measure(backend, args.turns, Path(tmp), "")


if __name__ == "__main__":
    main()
