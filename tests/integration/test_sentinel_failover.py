"""Redis behind Sentinel: a worker whose broker and stores are one ``redis+sentinel://``
URL carries on through a failover, finding the promoted replica by itself."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from runtime.models import RunStatus
from tests.helpers import paced_lookups, write_agent
from tests.sentinel_servers import running_sentinel_group
from tests.workers import status_is, swept_worker, wait_for_run

pytestmark = pytest.mark.slow

TURNS = 5
"""Model turns of each run, a lookup each but the last, every one ~0.4 s."""


@pytest.mark.timeout(90)
def test_a_worker_on_sentinel_urls_finishes_runs_across_a_failover_of_its_primary(
    tmp_path: Path, ledger: Path
) -> None:
    agent = write_agent(tmp_path / "agent", paced_lookups(TURNS - 1))
    # Given a worker whose broker and both stores are the group's sentinel URL, with beat's
    # sweeper in it (a turn cut off by the failover is resumed by the sweeper once its lease
    # expires: the broker's redelivery is never the guarantee)
    with (
        running_sentinel_group(tmp_path / "redis") as group,
        swept_worker(tmp_path, ledger, group.url(0)) as worker,
    ):
        ctx = worker.ctx
        # And a run under way when the primary goes
        before = worker.under_way(agent, "before the failover")

        # When the primary is SIGKILLed and the sentinels promote its replica
        took_s = group.fail_over()

        # Then the run goes on, and a run started afterwards runs, on the same worker
        after = worker.start(agent, "after the failover")
        for run_id in (before, after):
            wait_for_run(ctx, run_id, status_is(RunStatus.COMPLETED), timeout_s=45)
        assert worker.alive(), worker.process.log()
        assert group.primary_port() == group.replica.port
        for run_id in (before, after):
            events = ctx.runs.events(run_id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            responded = [e for e in events if e.type == "model.responded"]
            # Every turn answered once: no turn was lost to the failover nor taken twice
            assert [e.data["content"] for e in responded] == [
                *(f"look {n}" for n in range(TURNS - 1)),
                "Done.",
            ], _story(took_s, events, worker.process.log())


def _story(took_s: float, events: Sequence[object], log: str) -> str:
    return f"failover took {took_s:.1f} s; events {events}\n--- worker log ---\n{log[-6000:]}"
