"""What the message contract costs a sender: ``enqueue_turn`` against a bare ``send_task``.

Both publish a ``ratchet.turn`` through the same ratchet app on Celery's in-process
``memory://`` broker (so the broker costs nothing and the sender's own work shows):
the baseline is the previous release's ``send_task("ratchet.turn", (run_id, seq))``,
the contract is ``enqueue_turn(run_id=…, expected_seq=…)`` (a strict pydantic model,
keyword arguments, the version header). Rounds alternate so a busy machine slows
both alike; the figure is the median round's per-message time and their ratio.

    python -m bench.messages [--messages 5000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.messages import enqueue_turn  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from worker.app import make_app  # noqa: E402


def per_message_us(send: Callable[[int], object], messages: int) -> float:
    started = time.perf_counter()
    for i in range(messages):
        send(i)
    return (time.perf_counter() - started) / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    app = make_app(Settings(broker_url="memory://"))

    def bare(i: int) -> object:
        return app.send_task("ratchet.turn", (f"run-{i}", i), queue="ratchet.turns")

    def contract(i: int) -> object:
        return enqueue_turn(run_id=f"run-{i}", expected_seq=i, app=app)

    bare(0), contract(0)  # connect and declare before anything is timed
    baseline, measured = [], []
    for _ in range(args.rounds):
        baseline.append(per_message_us(bare, args.messages))
        measured.append(per_message_us(contract, args.messages))
    base, ours = statistics.median(baseline), statistics.median(measured)
    print(f"messages per round       {args.messages} x {args.rounds} rounds, memory:// broker")
    print(f"send_task (positional)   {base:8.1f} us/message  (baseline)")
    print(f"enqueue_turn (contract)  {ours:8.1f} us/message")
    print(f"ratio contract/baseline  {ours / base:8.2f}")
    app.close()


if __name__ == "__main__":
    main()
