"""The order RabbitMQ hands out ratchet's turns by priority: a classic queue against a quorum queue.

ratchet gives every turn message a priority (tasks/delivery.py): a run under way at
5-9, a new run's first turn at 0-4 (its run priority 0-4 within each class), so any
run under way goes before any new run. This bench declares ``ratchet.turns`` as a
ratchet worker declares it — classic (``x-max-priority`` 9, direct exchange) and
quorum (``RATCHET_TASK_DEFAULT_QUEUE_TYPE=quorum``) — each in a virtual host of its own
on the RabbitMQ at 127.0.0.1:5672, publishes the same shuffled mix of turns of both
classes with nobody consuming (a backlog), then takes them one by one and records the
order they came in. It prints, per queue type: how many of the first half were runs
under way (all of them under strict priorities), the pairs of a new run's turn and
one under way taken new first (none under strict priorities), whether the order was
simply the publish order, and the queue's memory with the backlog in it as
``rabbitmqctl list_queues memory`` reports it (an order of magnitude: for a quorum
queue it moved from 87 to 258 KiB between two runs of the same backlog).

    python -m bench.quorum_priorities [--messages 400] [--body-bytes 1024] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kombu import Connection  # noqa: E402

from runtime.limits import broker_priority  # noqa: E402
from tasks.delivery import MAX_PRIORITY  # noqa: E402
from tasks.queues import TURNS_QUEUE, queues  # noqa: E402

BROKER = "amqp://guest:guest@127.0.0.1:5672/"


def rabbitmqctl(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], input=stdin, capture_output=True, check=True,
        text=True, timeout=120,
    ).stdout  # fmt: skip


def make_vhost() -> str:
    vhost = f"ratchet-bench-{uuid.uuid4().hex[:12]}"
    permissions = {"user": "guest", "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}
    rabbitmqctl("import_definitions", "--format", "json",
                stdin=json.dumps({"vhosts": [{"name": vhost}], "permissions": [permissions]}))  # fmt: skip
    return vhost


def backlog(messages: int, seed: int) -> list[tuple[int, bool]]:
    """(priority, under way) of each turn, shuffled: half runs under way, half new runs."""
    rng = random.Random(seed)
    turns = [
        (broker_priority(i % 5, under_way, reversed_scale=False), under_way)
        for i in range(messages // 2)
        for under_way in (True, False)
    ]
    rng.shuffle(turns)
    return turns


def taken_order(queue_type: str, turns: list[tuple[int, bool]], body_bytes: int) -> dict[str, Any]:
    """Publish ``turns`` to a fresh ``ratchet.turns`` of ``queue_type``; take them all back."""
    vhost = make_vhost()
    try:
        with Connection(BROKER + vhost) as connection:
            declared = queues(MAX_PRIORITY if queue_type == "classic" else None, queue_type)[0]
            queue = declared(connection.default_channel)
            queue.declare()
            producer = connection.Producer()
            padding = "x" * body_bytes
            for index, (priority, _) in enumerate(turns):
                producer.publish(
                    {"index": index, "pad": padding}, exchange=TURNS_QUEUE,
                    routing_key=TURNS_QUEUE, priority=priority, delivery_mode=2,
                )  # fmt: skip
            memory = queue_memory(vhost)
            order = []
            while (message := queue.get(no_ack=True)) is not None:
                order.append(message.payload["index"])
    finally:
        rabbitmqctl("delete_vhost", vhost)
    return {"order": order, "memory": memory}


def queue_memory(vhost: str) -> int:
    out = rabbitmqctl("list_queues", "-p", vhost, "name", "memory")
    for line in out.splitlines():
        name, _, value = line.partition("\t")
        if name == TURNS_QUEUE and value.isdigit():
            return int(value)
    return -1


def new_before_under_way(order: list[int], turns: list[tuple[int, bool]]) -> int:
    """Pairs of a new run's turn and a run's under way taken new first (0 under strict
    priorities, about half of them in publish order)."""
    pairs, new_so_far = 0, 0
    for index in order:
        if turns[index][1]:
            pairs += new_so_far
        else:
            new_so_far += 1
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    turns = backlog(args.messages, args.seed)
    with Connection(BROKER) as connection:
        version = connection.default_channel.connection.server_properties.get("version")
    half = len(turns) // 2
    pairs = half * half  # pairs of one under-way and one new turn
    print(f"RabbitMQ {version}; {len(turns)} turns of {args.body_bytes} B, half runs under way "
          f"(priority 5-9) and half new runs (0-4), shuffled (seed {args.seed})")  # fmt: skip
    for queue_type in ("classic", "quorum"):
        seen = taken_order(queue_type, turns, args.body_bytes)
        order = seen["order"]
        under_way_first = sum(1 for i in order[:half] if turns[i][1])
        first_new = next(n for n, i in enumerate(order) if not turns[i][1])
        print(
            f"{queue_type:8} taken {len(order)}; runs under way among the first {half}: "
            f"{under_way_first}; first new run taken at position {first_new + 1}; "
            f"new-before-under-way pairs: {new_before_under_way(order, turns)} of {pairs}; "
            f"in publish order: "
            f"{'yes' if order == sorted(order) else 'no'}; queue memory with the backlog: "
            f"{seen['memory'] / 1024:.0f} KiB"
        )


if __name__ == "__main__":
    main()
