"""A turn on Redis takes the lease, reads the record and reads the snapshot in one script.

When both stores are one Redis (``RunStore.reads_with``), :func:`tasks.lease.holding`
with ``reads_snapshot`` hands :func:`tasks.persistence.load` the snapshot read with the
lease. Loading from that read gives the state the separate reads give, heals a snapshot
that lags the log from the events, and sets a damaged one aside as they do. Real Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from runtime.fsm import rebuild
from store.runs.redis import RedisRunStore
from store.snapshots.redis import RedisSnapshotStore
from tasks import lease
from tasks.context import Context
from tasks.persistence import Loaded, append_events, load
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, turn, write_agent
from tests.workers import redis_context


@pytest.fixture
def ctx(redis_url: str) -> Iterator[Context]:
    context = redis_context(redis_url)
    yield context
    context.close()


def one_turn_in(ctx: Context, directory: Path) -> str:
    """A run one turn in: its snapshot at the log's last seq, saved by this process."""
    path = write_agent(
        directory,
        [
            turn("look", call("lookup_order", order_id="B2")),
            turn("ask", call("request_user_input", prompt="which card?")),
            turn("Refunded."),
        ],
    )
    run_id = create_run(ctx, path, "refund B2", run_id="the-run").run_id
    assert advance(ctx, run_id, None).outcome == "next"
    return run_id


def combined(ctx: Context, run_id: str) -> Loaded:
    """The run as a turn loads it: the snapshot read with the lease."""
    with lease.holding(ctx, run_id, reads_snapshot=True) as held:
        assert held.snapshot is not None  # both stores are one Redis: read with the lease
        return load(ctx, run_id, record=held.record, snapshot=held.snapshot)


def apart(redis_url: str, run_id: str) -> Loaded:
    """The run as a process that knows nothing of it loads it with separate reads."""
    other = redis_context(redis_url)
    try:
        return load(other, run_id, set_aside=False)
    finally:
        other.close()


@pytest.mark.parametrize("knows", [True, False], ids=["this-process-saved-it", "another-did"])
def test_the_combined_read_loads_what_the_separate_reads_load(
    ctx: Context, redis_url: str, tmp_path: Path, knows: bool
) -> None:
    run_id = one_turn_in(ctx, tmp_path)
    ctx.forget_checkpoint(run_id)  # else the remembered state is used, not the snapshot
    if not knows:
        ctx.snapshots.forget_transcript(run_id)

    loaded = combined(ctx, run_id)

    separate = apart(redis_url, run_id)
    assert loaded.state == separate.state == rebuild(ctx.runs.events(run_id))
    assert loaded.snapshot_seq == separate.snapshot_seq == loaded.state.seq


def test_a_remembered_state_is_not_read_again_and_one_that_is_not_this_runs_is_not_used(
    ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    run_id = one_turn_in(ctx, tmp_path)
    saved = ctx.snapshots.load(run_id)
    assert saved is not None and ctx.remembered_seq(run_id) == saved.seq
    # This process saved the last checkpoint: the lease comes without the snapshot
    with lease.holding(ctx, run_id, reads_snapshot=True) as held:
        assert held.snapshot is None
        loaded = load(ctx, run_id, record=held.record, snapshot=held.snapshot)
    assert loaded.state == saved == rebuild(ctx.runs.events(run_id))

    # Given a remembered state at the log's seq that is not this run's (an earlier run
    # with this id): it is not read with the lease, nor used; the snapshot is read apart
    ctx.remember_checkpoint(saved.model_copy(update={"created_at_ms": saved.created_at_ms - 1}))
    with lease.holding(ctx, run_id, reads_snapshot=True) as held:
        assert held.snapshot is None
        loaded = load(ctx, run_id, record=held.record, snapshot=held.snapshot)
    assert loaded.state == saved and loaded.snapshot_seq == saved.seq


def test_a_snapshot_that_lags_the_log_is_healed_from_the_events(
    ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    # Given events appended after the snapshot (a turn that died before its checkpoint)
    run_id = one_turn_in(ctx, tmp_path)
    saved = ctx.snapshots.load(run_id)
    assert saved is not None
    with lease.holding(ctx, run_id) as held:
        append_events(
            ctx, saved, [("run.resume_refused", {"reason": "after the snapshot"})], held.owner
        )
    ctx.forget_checkpoint(run_id)

    # When a turn loads it with the lease's read
    loaded = combined(ctx, run_id)

    # Then the state is the events' fold, and the next save expects the stored snapshot
    assert loaded.state == rebuild(ctx.runs.events(run_id))
    assert loaded.state.seq == saved.seq + 1 and loaded.snapshot_seq == saved.seq
    assert apart(redis_url, run_id)[1:3] == loaded[1:3]


def problem(message: str) -> str:
    """What a WARNING about an unusable snapshot says is wrong (not what was done about it)."""
    return message.split("; moved it to")[0].split("; rebuilding the state from the run's")[0]


@pytest.mark.parametrize("knows", [True, False], ids=["this-process-saved-it", "another-did"])
@pytest.mark.parametrize("damaged", ["head", "transcript"])
def test_a_damaged_snapshot_read_with_the_lease_is_treated_as_the_separate_reads_treat_it(
    ctx: Context,
    redis_url: str,
    tmp_path: Path,
    knows: bool,
    damaged: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_id = one_turn_in(ctx, tmp_path)
    ctx.forget_checkpoint(run_id)
    if not knows:
        ctx.snapshots.forget_transcript(run_id)
    client = redis.Redis.from_url(redis_url)
    # Given the head, or the transcript's last message, overwritten with bytes that do not unpack
    if damaged == "head":
        client.hset(f"ratchet:run:{{{run_id}}}:snapshot", "head", b"\xff garbage")
    else:
        client.execute_command("LSET", f"ratchet:run:{{{run_id}}}:transcript", -1, b"\xff garbage")
    # (what the separate reads of this same process make of it, leaving it in place)
    separate, warned_apart = warnings_of(lambda: load(ctx, run_id, set_aside=False), caplog)

    # When a turn loads it with the lease's read
    loaded, warned = warnings_of(lambda: combined(ctx, run_id), caplog)

    # Then the same state, and the same problem named. (A message this process saved is
    # not read again: a damaged one it already holds goes unnoticed, as apart.)
    assert loaded.state == separate.state == rebuild(ctx.runs.events(run_id))
    assert loaded.snapshot_seq == separate.snapshot_seq
    assert [problem(w) for w in warned] == [problem(w) for w in warned_apart]
    unnoticed = knows and damaged == "transcript"
    assert len(warned) == (0 if unnoticed else 1)
    aside = client.keys(f"ratchet:quarantine:{{{run_id}}}:*:snapshot")
    client.close()
    if not unnoticed:
        assert loaded.snapshot_seq is None and len(aside) == 1  # moved aside, not deleted
        assert ctx.snapshots.load(run_id) is None


T = TypeVar("T")


def warnings_of(action: Callable[[], T], caplog: pytest.LogCaptureFixture) -> tuple[T, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        done = action()
    return done, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_turn_opens_its_run_in_one_round_trip(
    ctx: Context, redis_url: str, tmp_path: Path
) -> None:
    run_id = one_turn_in(ctx, tmp_path)
    ctx.forget_checkpoint(run_id)
    combined(ctx, run_id)  # (loads the script into the server)
    ctx.forget_checkpoint(run_id)
    client = redis.Redis.from_url(redis_url)
    before = client.info("commandstats")

    with lease.holding(ctx, run_id, reads_snapshot=True) as held:
        spent = {
            k: v["calls"] - before.get(k, {"calls": 0})["calls"]
            for k, v in client.info("commandstats").items()
            if v["calls"] != before.get(k, {"calls": 0})["calls"]
        }
        load(ctx, run_id, record=held.record, snapshot=held.snapshot)
        after = client.info("commandstats")
    client.close()
    loading = {
        k: v["calls"] - before.get(k, {"calls": 0})["calls"] - spent.get(k, 0)
        for k, v in after.items()
        if k != "cmdstat_info"
    }
    # The lease took one script (its process's liveness beat may add a script of its own);
    # the load none: the snapshot came with the lease.
    assert 1 <= spent.get("cmdstat_evalsha", 0) <= 2, spent
    assert {k: n for k, n in loading.items() if n} == {}, loading
    assert isinstance(ctx.runs, RedisRunStore) and isinstance(ctx.snapshots, RedisSnapshotStore)
