"""Routing: every message lands in exactly one queue, turns apart from control messages."""

from __future__ import annotations

import redis

from tasks.delivery import redis_lists
from tasks.messages import enqueue_continue, enqueue_turn
from worker.app import CONTROL_QUEUE, TURNS_QUEUE, app


def messages_in(client: redis.Redis, queue: str) -> int:
    """Messages waiting in ``queue``, over all its priority lists (tasks/delivery.py)."""
    return sum(int(client.llen(name)) for name in redis_lists(queue))


def test_a_turn_and_a_control_message_each_land_in_exactly_their_own_queue(redis_url: str) -> None:
    with app.connection_for_write(redis_url) as connection:
        # Given both queues declared and bound, as a worker declares them at start
        for queue in app.conf.task_queues:
            queue(connection.default_channel).declare()
        # When one turn and one continuation are sent
        enqueue_turn(run_id="run-1", expected_seq=1, app=app, connection=connection)
        enqueue_continue(run_id="run-1", input="x", app=app, connection=connection)
    # Then each queue holds exactly one message: nothing is delivered twice
    client = redis.Redis.from_url(redis_url)
    assert messages_in(client, TURNS_QUEUE) == 1
    assert messages_in(client, CONTROL_QUEUE) == 1
