"""What a chained turn's publish costs the pool process: Celery's ``send_task`` against the lean path.

Both publish the same ``ratchet.turn`` from inside a running task (as tasks/turn.py's
``enqueue_next`` does), to a redis-server of the bench's own (a real LPUSH round
trip) or to Celery's in-process ``memory://`` broker (the sender's own work only):
the baseline is what tasks/messages.py gave ``send_task`` before tasks/broker/next_turn.py,
the other is :func:`tasks.broker.next_turn.lean_turns`. Rounds alternate so a busy machine
slows both alike; the figures are the median round's wall and CPU time per message.

    python -m bench.lean_publish [--messages 3000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.broker.next_turn import lean_turns  # noqa: E402
from tasks.messages import VERSION, VERSION_HEADER  # noqa: E402
from tasks.queues import TURNS_QUEUE  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from worker.app import make_app  # noqa: E402

HEADERS = {VERSION_HEADER: VERSION}


def timed(send: Callable[[int], object], messages: int) -> tuple[float, float]:
    """(wall, CPU) microseconds per message."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(messages):
        send(i)
    return (
        (time.perf_counter() - wall) / messages * 1e6,
        (time.process_time() - cpu) / messages * 1e6,
    )


def compare(broker_url: str, messages: int, rounds: int) -> None:
    app = make_app(Settings(broker_url=broker_url))
    app.finalize()

    def celery(i: int) -> object:
        kwargs = {"run_id": f"run-{i}", "expected_seq": i}
        return app.send_task(
            "ratchet.turn", kwargs=kwargs, headers=dict(HEADERS), queue=TURNS_QUEUE, priority=7
        )

    def lean(i: int) -> object:
        kwargs = {"run_id": f"run-{i}", "expected_seq": i}
        sent = lean_turns(app).publish(kwargs, TURNS_QUEUE, 7, dict(HEADERS))
        assert sent is not None, "the lean path did not publish"
        return sent

    def rounds_in_a_task() -> tuple[list[Any], list[Any]]:
        celery(0), lean(0)  # connect and declare before anything is timed
        baseline, measured = [], []
        for _ in range(rounds):
            baseline.append(timed(celery, messages))
            measured.append(timed(lean, messages))
        return baseline, measured

    probe = app.task(name="bench.lean_publish", shared=False)(rounds_in_a_task)
    baseline, measured = probe.apply().get()
    for what, index in (("wall", 0), ("CPU", 1)):
        base = statistics.median(r[index] for r in baseline)
        ours = statistics.median(r[index] for r in measured)
        print(
            f"{broker_url.split('://')[0]:7} {what:4}  send_task {base:7.1f} us/message, "
            f"lean {ours:7.1f} us/message, lean/send_task {ours / base:5.2f}"
        )
    app.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"messages per round {args.messages} x {args.rounds} rounds, sent from a running task")
    compare("memory://", args.messages, args.rounds)
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(Path(directory), appendonly=False)
        server.start()
        try:
            compare(f"{server.url}/0", args.messages, args.rounds)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
