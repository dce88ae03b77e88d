"""A turn asks :func:`runtime.fsm.decide` once per state: the checkpoint that leaves a
state (which calls go with it, is it the turn's last) and the turn's next step share the
answer; and the rule that ends a turn (:func:`runtime.fsm.ends_turn`), pure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.actions import CallModel, CheckBinding, Fail, Idle, RunTool, Suspend
from runtime.fsm import ends_turn
from runtime.models import RunStatus, ToolCall
from tasks.context import Context
from tasks.start import create_run
from tests.helpers import call, calls_while, combined_sqlite_context, drive, turn, write_agent

CALL = ToolCall(id="c1", name="lookup_order", arguments={"order_id": "B2"})
ACTIONS = [
    (CallModel((), (), 0), True),
    (RunTool(CALL, ()), False),
    (Suspend(RunStatus.NEEDS_USER_INPUT, CALL, "which?"), False),
    (Fail("over budget"), False),
    (Idle("run is completed"), False),
    (CheckBinding(), False),
]


@pytest.mark.parametrize(("action", "model_call"), ACTIONS, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("asked_model", [False, True])
def test_a_turn_ends_before_a_second_model_call_and_before_nothing_else(
    action: Any, model_call: bool, asked_model: bool
) -> None:
    assert ends_turn(action, asked_model) == (asked_model and model_call)


@pytest.fixture
def ctx(tmp_path: Path, ledger: Path) -> Iterator[Context]:
    # Both stores in one SQLite file: a checkpoint asks whether it is the turn's last.
    with combined_sqlite_context(tmp_path / "runs.sqlite3") as context:
        yield context


def test_each_turn_asks_decide_once_per_state_it_leaves(ctx: Context, tmp_path: Path) -> None:
    # Given a run of five turns that each look an order up, then an answer
    looks = [turn(f"look {i}", call("lookup_order", order_id="B2")) for i in range(5)]
    agent = write_agent(tmp_path, [*looks, turn("Done.")])
    run_id = create_run(ctx, agent, "refund B2").run_id
    # When it is driven to its end
    count = calls_while(lambda: drive(ctx, run_id), "decide", "fsm.py")
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.COMPLETED
    # Then each tool turn decided four times, once per state: at its start (a new turn
    # decides afresh), on its response (which calls go with it), on that response with
    # its calls journaled (the checkpoint's question, shared with the loop's next step),
    # and after the tool's checkpoint (the next model call, which ends the turn); the last
    # turn twice. Asked again by the loop after the checkpoint that had asked, it was five
    # times a tool turn (27 for this run).
    assert count == 5 * 4 + 2, count
