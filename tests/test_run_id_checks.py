"""How often a turn checks its run id (issue 32: "checked again and again instead of once").

Counted with ``sys.setprofile`` as tests/test_decide_once.py counts ``decide``, on a turn
of a run whose stores share one SQLite file (the transitions commit in one call).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.errors import InvalidRunId
from runtime.models import Event
from store.runs import RunRecord
from tasks.context import Context
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, calls_while, combined_sqlite_context, turn, write_agent


@pytest.fixture
def ctx(tmp_path: Path, ledger: Path) -> Iterator[Context]:
    with combined_sqlite_context(tmp_path / "runs.sqlite3") as context:
        yield context


def test_a_tool_turn_checks_its_run_id_once_per_store_call_it_makes(
    ctx: Context, tmp_path: Path
) -> None:
    # Given a run whose turns each look an order up, its first turn taken
    looks = [turn(f"look {i}", call("lookup_order", order_id="B2")) for i in range(4)]
    agent = write_agent(tmp_path, [*looks, turn("Done.")])
    run_id = create_run(ctx, agent, "refund B2").run_id
    done = advance(ctx, run_id, None)
    assert done.outcome == "next"
    # When the next turn is taken
    count = calls_while(lambda: advance(ctx, run_id, done.seq), "validate_run_id")
    # Then the id is checked once by each store call that takes it from outside (the
    # lease, the journal's append, the two commits) and once as the next turn's message
    # is built: five times, where each commit checked it twice before (seven)
    assert count == 5, count


def test_a_commit_still_refuses_a_run_id_that_is_not_one(ctx: Context) -> None:
    record = RunRecord.model_construct(run_id="../etc", last_seq=1)
    with pytest.raises(InvalidRunId):
        ctx.runs.commit(record, [Event(seq=1, type="run.created", at_ms=1, data={})], None)
