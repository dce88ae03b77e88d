"""A start names its run's agent on the first turn's message without reading the run back,
and a turn names it on the next turn's.

Every ``ratchet.*`` message is labelled ``agent='…', run_id='…', seq=N`` as it is
published (worker/observe.py). The process that creates a run knows its agent: the label
of the first turn it sends comes from what it just saved, not from a read of the run
store (one round trip a start, on Redis); a process that takes a turn knows it from the
state it holds. Real Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tasks.context import Context
from tasks.observers import Observer, Observers
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, installed_context, turn, write_agent
from tests.workers import redis_context
from worker.observe import describe


@pytest.fixture
def ctx(redis_url: str) -> Iterator[Context]:
    context = redis_context(redis_url)
    yield context
    context.close()


def calls_by_command(client: redis.Redis) -> dict[str, int]:
    return {k: v["calls"] for k, v in client.info("commandstats").items()}


def test_the_first_turn_of_a_run_started_here_is_labelled_without_a_store_read(
    ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, [turn("look", call("lookup_order", order_id="B2"))], name="desk")
    client = redis.Redis.from_url(redis_url)
    with installed_context(ctx):
        run_id = create_run(ctx, agent, "refund B2").run_id
        before = calls_by_command(client)
        label = describe("ratchet.turn", (run_id, 1), {})
        after = calls_by_command(client)
    client.close()

    assert label == f"agent='desk', run_id='{run_id}', seq=1"
    spent = {k: n - before.get(k, 0) for k, n in after.items() if k != "cmdstat_info"}
    assert {k: n for k, n in spent.items() if n} == {}, spent


def test_a_run_another_process_started_is_still_labelled_from_the_store(
    ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, [turn("look", call("lookup_order", order_id="B2"))], name="desk")
    run_id = create_run(ctx, agent, "refund B2").run_id
    other = redis_context(redis_url)  # a process that remembers nothing of the run
    try:
        with installed_context(other):
            assert describe("ratchet.turn", (run_id, 1), {}) == (
                f"agent='desk', run_id='{run_id}', seq=1"
            )
    finally:
        other.close()


def test_a_turn_taken_here_labels_its_next_turn_without_a_store_read(
    ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    # The message that chains a turn's next one is built before the turn's last checkpoint
    # (the outbox goes with it): the answer's checkpoint before it is its events alone, so
    # nothing this process saved names the run's agent then, unless the turn noted it.
    script = [turn("look", call("lookup_order", order_id="B2")), turn("ok")]
    agent = write_agent(tmp_path, script, name="desk")
    run_id = create_run(ctx, agent, "refund B2").run_id
    other = redis_context(redis_url)  # a process that remembers nothing of the run
    client = redis.Redis.from_url(redis_url)
    labels: list[tuple[str | None, dict[str, int]]] = []

    class LabelAfterTheTool(Observer):
        def reached(self, point: str, model_calls: int) -> None:
            if point == "tool.completed":
                before = calls_by_command(client)
                label = describe("ratchet.turn", (run_id, 5), {})
                after = calls_by_command(client)
                spent = {k: n - before.get(k, 0) for k, n in after.items()}
                labels.append(
                    (label, {k: n for k, n in spent.items() if n and k != "cmdstat_info"})
                )

    other.observers = Observers([LabelAfterTheTool()])
    try:
        with installed_context(other):
            assert advance(other, run_id, 1).outcome == "next"
    finally:
        other.close()
        client.close()

    assert labels == [(f"agent='desk', run_id='{run_id}', seq=5", {})]
