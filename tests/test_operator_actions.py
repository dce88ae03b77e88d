"""What an operator may ask of a run in each status: one table in the core
(``runtime.models.OPERATOR_ACTIONS``), which the console's run page and
``ratchet runs show`` both offer, word for word."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime.models import OPERATOR_ACTIONS, Event, RunStatus
from store.runs import RunRecord
from tasks.context import Context
from tasks.start import create_run
from tests.helpers import installed_context, memory_context, turn, write_agent
from worker.api import Ratchet
from worker.cli import main
from worker.console.views import run_page

EXPECTED = {
    RunStatus.QUEUED: ["resume", "cancel"],
    RunStatus.MODEL: ["resume", "cancel"],
    RunStatus.TOOLS: ["resume", "cancel"],
    RunStatus.NEEDS_USER_INPUT: ["answer", "cancel"],
    RunStatus.BLOCKED: ["answer", "cancel"],
    RunStatus.AWAITING_APPROVAL: ["approve", "deny", "cancel"],
    RunStatus.WAITING: ["cancel"],
    RunStatus.COMPLETED: [],
    RunStatus.FAILED: [],
    RunStatus.CANCELLED: [],
    RunStatus.NEEDS_RECONCILIATION: ["reconcile", "cancel"],
    RunStatus.STALLED: ["resume", "cancel"],
    RunStatus.DEAD_LETTERED: ["resume", "cancel"],
}


def test_every_status_has_an_entry_in_the_table() -> None:
    assert set(OPERATOR_ACTIONS) == set(RunStatus)


@pytest.mark.parametrize("status", list(RunStatus), ids=str)
def test_each_status_offers_what_an_operator_can_do_to_it(status: RunStatus) -> None:
    assert list(status.operator_actions) == EXPECTED[status]


@pytest.mark.parametrize("status", list(RunStatus), ids=str)
def test_the_offer_follows_the_statuses_own_classes(status: RunStatus) -> None:
    offered = status.operator_actions
    # A finished run's course is over; anything not terminal can still be cancelled.
    assert ("cancel" in offered) == (not status.is_terminal)
    # A run waiting for a person (not a timer) is the only one that can be answered.
    answers = {"answer", "approve", "deny"} & set(offered)
    assert bool(answers) == (status.is_suspended and status != RunStatus.WAITING)
    # Resume is offered where a worker, not a person, is what the run lacks.
    resumable = status.is_live or status in (RunStatus.STALLED, RunStatus.DEAD_LETTERED)
    assert ("resume" in offered) == resumable


@pytest.fixture
def ctx(ledger: Path) -> Iterator[Context]:
    with installed_context(memory_context()) as context:
        yield context


def in_status(ctx: Context, agent: Path, status: RunStatus) -> str:
    """A run whose record says ``status`` (the offer reads the record's status only)."""
    run_id = create_run(ctx, agent, "refund B2").run_id
    record = ctx.runs.get(run_id)
    assert record is not None
    # An event the fold reads past, so the page's and the CLI's reads of the log still work.
    event = Event(
        seq=record.last_seq + 1,
        type="run.resume_refused",
        at_ms=record.updated_at_ms,
        data={"reason": "test"},
    )
    moved: RunRecord = record.model_copy(update={"status": status, "last_seq": event.seq})
    ctx.runs.append(moved, [event], None)
    return run_id


def test_the_cli_and_the_console_offer_exactly_the_cores_list_for_every_status(
    ctx: Context, tmp_path: Path
) -> None:
    # Given one run in each status
    agent = write_agent(tmp_path, [turn("Done.")])
    runs = {status: in_status(ctx, agent, status) for status in RunStatus}
    for status, run_id in runs.items():
        core = [action.value for action in status.operator_actions]
        # When the console's run page and `ratchet runs show` (text and JSON) show it
        page = run_page(Ratchet(ctx), run_id)
        text = CliRunner().invoke(main, ["runs", "show", run_id])
        as_json = CliRunner().invoke(main, ["runs", "show", run_id, "--json"])
        assert text.exit_code == 0 and as_json.exit_code == 0, text.output + as_json.output
        # Then each offers the core's list, in the core's order
        assert page.record.status == status
        assert page.actions == core
        shown = [line for line in text.output.splitlines() if line.startswith("actions ")]
        assert shown == [f"actions    {', '.join(core) or 'none'}"], text.output
        assert json.loads(as_json.output)["actions"] == core
