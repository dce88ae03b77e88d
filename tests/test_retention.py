"""Retention: the sweep purges finished runs older than ``retention_s``; ``ratchet runs purge``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from store.runs.memory import MemoryRunStore
from store.snapshots.memory import MemorySnapshotStore
from tasks.context import Context, set_context
from tasks.control import cancel
from tasks.recovery import sweep
from tasks.settings import Settings
from tasks.start import create_run
from tests.contract.conftest import FakeClock
from tests.helpers import turn, write_agent
from worker.cli import main
from worker.cli_recovery import cutoff_ms

DAY_MS = 86_400_000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ctx(clock: FakeClock) -> Iterator[Context]:
    context = Context(
        settings=Settings(retention_s=7 * 86_400),
        snapshots=MemorySnapshotStore(),
        runs=MemoryRunStore(clock=clock),
    )
    set_context(context)
    yield context
    set_context(None)


def finished_run(ctx: Context, agent: Path, name: str) -> str:
    run_id = create_run(ctx, agent, name, run_id=name).run_id
    cancel(ctx, run_id, "done with it")
    return run_id


def test_the_sweep_purges_finished_runs_older_than_the_retention_and_keeps_the_rest(
    ctx: Context, clock: FakeClock, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, [turn("done")])
    # Given a run finished 8 days ago, one finished 6 days ago, and one never finished
    old = finished_run(ctx, agent, "old")
    clock.advance(2 * DAY_MS)
    recent = finished_run(ctx, agent, "recent")
    waiting = create_run(ctx, agent, "waiting", run_id="waiting").run_id
    ctx.runs.acquire_lease(waiting, "a-worker", 10 * DAY_MS / 1000)
    clock.advance(6 * DAY_MS)
    # When the sweep runs
    sweep()
    # Then only the run finished more than 7 days ago is gone, events and all
    assert ctx.runs.get(old) is None and ctx.runs.events(old) == []
    assert {r.run_id for r in ctx.runs.list()} == {recent, waiting}


def test_runs_purge_from_the_cli_counts_what_it_purged(
    ctx: Context, clock: FakeClock, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, [turn("done")])
    for name in ("a", "b", "c"):
        finished_run(ctx, agent, name)
    clock.advance(3 * DAY_MS)
    finished_run(ctx, agent, "d")
    runner = CliRunner()

    purged = runner.invoke(main, ["runs", "purge", "--older-than", "2d", "--yes"])

    assert purged.exit_code == 0, purged.output
    assert purged.output.strip() == "purged 3 finished run(s)"
    assert [r.run_id for r in ctx.runs.list()] == ["d"]
    refused = runner.invoke(main, ["runs", "purge", "--older-than", "soon"])
    assert refused.exit_code == 2 and "is not an age" in refused.output


def test_a_purge_cutoff_is_a_date_a_datetime_or_an_age() -> None:
    now = 1_700_000_000_000
    assert cutoff_ms("2023-11-14", None, now) == 1_699_920_000_000
    assert cutoff_ms("2023-11-14T00:00:01+00:00", None, now) == 1_699_920_001_000
    assert cutoff_ms(None, "90m", now) == now - 90 * 60_000
    assert cutoff_ms(None, "1w", now) == now - 7 * DAY_MS
    for before, older_than in ((None, None), ("2023-11-14", "7d"), ("yesterday", None)):
        with pytest.raises(Exception, match="--before|--older-than"):
            cutoff_ms(before, older_than, now)
