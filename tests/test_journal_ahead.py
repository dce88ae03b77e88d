"""A turn this process chained sends its model call's journal with the lease (tasks/ahead.py).

The process that checkpointed a run and chained its next turn knows that turn's first
step and first write before it takes the lease: the ``model.requested`` goes in the
round trip that takes the lease, fenced by the lease, the seq and the record the
process remembers. The log is the one the turn writes without it, one round trip fewer;
refused by a fence, nothing is written and the turn goes the usual way. Real Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from runtime.actions import Advanced
from runtime.fsm import rebuild
from runtime.models import Event
from tasks.context import Context
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, calls_while, turn, write_agent
from tests.workers import redis_context


@pytest.fixture
def ctx(redis_url: str) -> Iterator[Context]:
    context = redis_context(redis_url)
    yield context
    context.close()


def agent(directory: Path) -> Path:
    return write_agent(
        directory,
        [
            turn("look", call("lookup_order", order_id="B2")),
            turn("again", call("lookup_order", order_id="B3")),
            turn("Refunded."),
        ],
    )


def shape(events: list[Event]) -> list[tuple[int, str, dict[str, Any]]]:
    """A log as two runs of the same script write it alike: all but the times and ids."""
    return [
        (e.seq, e.type, {k: v for k, v in e.data.items() if k not in ("run_id", "created_at_ms")})
        for e in events
    ]


def turned(ctx: Context, run_id: str, seq: int, done: list[Advanced]) -> None:
    done.append(advance(ctx, run_id, seq))


def round_trips(work: Any) -> int:
    """Connections taken from redis-py's pools while ``work()`` runs: one per round trip."""
    return calls_while(work, "get_connection", "redis/connection.py")


def test_a_chained_turn_journals_its_model_call_with_the_lease_one_round_trip_fewer(
    ctx: Context, tmp_path: Path
) -> None:
    path = agent(tmp_path)
    mine = create_run(ctx, path, "refund B2", run_id="journaled").run_id
    apart = create_run(ctx, path, "refund B2", run_id="forgotten").run_id
    seqs = {run_id: advance(ctx, run_id, None).seq for run_id in (mine, apart)}

    trips: dict[str, list[int]] = {mine: [], apart: []}
    while any(seq > 0 for seq in seqs.values()):
        for run_id, seq in seqs.items():
            if seq < 0:
                continue
            if run_id == apart:
                ctx.forget_checkpoint(run_id)  # as a turn of another process of the pool
            done: list[Advanced] = []
            trips[run_id].append(round_trips(partial(turned, ctx, run_id, seq, done)))
            seqs[run_id] = done[0].seq if done[0].outcome == "next" else -1

    # The same log, whichever way the journal went
    journaled, forgotten = ctx.runs.events(mine), ctx.runs.events(apart)
    assert shape(journaled) == shape(forgotten)
    ended, alike = rebuild(journaled), rebuild(forgotten)
    assert ended is not None and alike is not None
    assert ended.status == alike.status == "completed" and ended.usage.model_attempts == 3
    # Every chained turn of the run this process remembers: one round trip fewer
    assert [a - b for a, b in zip(trips[apart], trips[mine], strict=True)] == [1, 1]


def test_a_remembered_record_that_is_not_the_runs_sends_nothing_with_the_lease(
    ctx: Context, tmp_path: Path
) -> None:
    # Given what this process remembers of the run is another run's past (one that had
    # this id), at the seq the message expects
    run_id = create_run(ctx, agent(tmp_path), "refund B2").run_id
    first = advance(ctx, run_id, None)
    kept = ctx.last_checkpoint(run_id)
    assert kept is not None and kept[0].seq == first.seq
    state, record = kept
    ctx.remember_checkpoint(state, record.model_copy(update={"updated_at_ms": 1}))

    # When the turn runs, its journal goes the usual way: appended after the lease (and then
    # the answer, appended alone: the lookup runs next, and the turn's snapshot waits for it)
    appends = calls_while(lambda: advance(ctx, run_id, first.seq), "_append", "runs/redis.py")

    assert appends == 2, appends
    events = ctx.runs.events(run_id)
    requested = [e.data["turn"] for e in events if e.type == "model.requested"]
    assert requested == [1, 2]
    after = rebuild(events)
    assert after is not None and after.usage.model_attempts == 2


def test_a_turn_whose_run_moved_on_writes_nothing_with_the_lease(
    ctx: Context, tmp_path: Path
) -> None:
    # Given a late duplicate of a turn's message: the run moved on past the seq it expects
    run_id = create_run(ctx, agent(tmp_path), "refund B2").run_id
    first = advance(ctx, run_id, None)
    second = advance(ctx, run_id, first.seq)
    assert second.outcome == "next"
    before = ctx.runs.events(run_id)

    # When it arrives, nothing is written and the message is dropped as stale
    assert advance(ctx, run_id, first.seq).outcome == "stale"
    assert ctx.runs.events(run_id) == before
