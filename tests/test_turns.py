"""The turn loop on memory stores, driven in-process: what each kind of step records."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from runtime.errors import InvalidInput
from runtime.models import Event, RunState, RunStatus
from tasks.observers import Observer, Observers
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import (
    LOOK_REFUND_ANSWER,
    call,
    drive,
    memory_context,
    tool_turn_events,
    turn,
    write_agent,
)


def test_a_multi_turn_run_with_tools_completes_and_deletes_its_snapshot(
    tmp_path: Path, ledger: Path
) -> None:
    agent = write_agent(tmp_path, LOOK_REFUND_ANSWER)
    ctx = memory_context()
    run_id = create_run(ctx, agent, "refund B2").run_id

    done = drive(ctx, run_id)

    assert done.outcome == "completed"
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.COMPLETED
    assert record.output == "Refunded."
    assert record.usage.model_turns == 3 and record.usage.tool_calls == 2
    assert record.usage.total_tokens == 45
    assert ctx.snapshots.load(run_id) is None
    types = [e.type for e in ctx.runs.events(run_id)]
    assert types == tool_turn_events(2)
    assert ledger.read_text().splitlines() == ["refund B2 2900"]


@pytest.mark.parametrize(
    ("tool", "arguments", "requested_with_it"),
    [
        ("lookup_order", {"order_id": "A1"}, True),  # idempotent: a crash re-runs it anyway
        ("issue_refund", {"order_id": "A1", "amount_cents": 5}, False),  # journaled as it starts
    ],
)
def test_the_model_response_is_checkpointed_before_any_tool_runs(
    tmp_path: Path, ledger: Path, tool: str, arguments: dict[str, object], requested_with_it: bool
) -> None:
    agent = write_agent(tmp_path, [turn("look", call(tool, **arguments)), turn("ok")])
    ctx = memory_context()
    run_id = create_run(ctx, agent, "look A1").run_id
    commits: list[tuple[list[str], tuple[str, ...], bool]] = []

    class Commits(Observer):
        def committed(
            self,
            before: RunStatus,
            after: RunStatus,
            events: Sequence[Event],
            state: RunState | None,
        ) -> None:
            assert state is not None
            commits.append(([e.type for e in events], state.running, ledger.exists()))

    ctx.observers = Observers([Commits()])
    drive(ctx, run_id)
    # The answer is committed (a checkpoint in the log) before its call runs: journaled as
    # requested with it only when a crash before the call starts would run it again anyway.
    answer = next(c for c in commits if "model.responded" in c[0])
    kinds, running, refunded = answer
    assert kinds == (
        ["model.responded", "tool.requested"] if requested_with_it else ["model.responded"]
    )
    assert len(running) == int(requested_with_it) and not refunded


def test_a_tool_that_raises_or_gets_bad_arguments_answers_the_model_and_the_run_goes_on(
    tmp_path: Path, ledger: Path
) -> None:
    agent = write_agent(
        tmp_path,
        [
            turn(
                "look",
                call("lookup_order", order_id="ZZ"),
                call("lookup_order", order="A1"),
                call("no_such_tool"),
            ),
            turn("Sorry, I could not find it."),
        ],
    )
    ctx = memory_context()
    run_id = create_run(ctx, agent, "look").run_id

    assert drive(ctx, run_id).outcome == "completed"
    # The three calls run side by side: each outcome is journaled as it finishes.
    events = ctx.runs.events(run_id)
    failed = [e.data["error"] for e in sorted(events, key=lambda e: str(e.data.get("call_id")))
              if e.type == "tool.failed"]  # fmt: skip
    assert "KeyError" in failed[0] and "no order ZZ" in failed[0]
    assert "invalid arguments for `lookup_order`" in failed[1] and "order_id" in failed[1]
    assert "no tool named `no_such_tool`" in failed[2]


def test_an_exhausted_turn_budget_fails_the_run_naming_the_budget_and_its_figures(
    tmp_path: Path, ledger: Path
) -> None:
    agent = write_agent(
        tmp_path,
        [turn("a", call("lookup_order", order_id="A1"))] * 5,
        budgets={"max_turns": 2},
    )
    ctx = memory_context()
    run_id = create_run(ctx, agent, "loop").run_id

    assert drive(ctx, run_id).outcome == "failed"
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.FAILED
    assert record.error is not None
    assert "max_turns" in record.error and "2 used of 2" in record.error
    assert record.usage.model_attempts == 2


def test_token_and_tool_call_budgets_are_checked_before_the_step_they_would_exceed(
    tmp_path: Path, ledger: Path
) -> None:
    tokens = write_agent(
        tmp_path / "t",
        [turn("a", call("lookup_order", order_id="A1"), tokens=(60, 50))] * 3,
        budgets={"max_total_tokens": 100},
    )
    tools = write_agent(
        tmp_path / "c",
        [turn("a", call("lookup_order", order_id="A1"), call("lookup_order", order_id="B2"))] * 3,
        budgets={"max_tool_calls": 3},
    )
    ctx = memory_context()
    by_tokens = create_run(ctx, tokens, "x").run_id
    by_tools = create_run(ctx, tools, "x").run_id
    drive(ctx, by_tokens)
    drive(ctx, by_tools)
    token_record, tool_record = ctx.runs.get(by_tokens), ctx.runs.get(by_tools)
    assert token_record is not None and tool_record is not None
    assert token_record.error is not None and "max_total_tokens" in token_record.error
    assert token_record.usage.model_turns == 1
    assert tool_record.error is not None and "max_tool_calls" in tool_record.error
    assert tool_record.usage.tool_calls == 3


def test_a_late_or_duplicate_turn_message_changes_nothing(tmp_path: Path, ledger: Path) -> None:
    agent = write_agent(
        tmp_path,
        [
            turn("refund", call("issue_refund", order_id="B2", amount_cents=1)),
            turn("done"),
        ],
    )
    ctx = memory_context()
    run_id = create_run(ctx, agent, "refund").run_id
    first = advance(ctx, run_id, 1)
    assert first.outcome == "next"
    before = ctx.runs.events(run_id)

    # The same message delivered again expects seq 1; the run has moved on.
    again = advance(ctx, run_id, 1)

    assert again.outcome == "stale"
    assert ctx.runs.events(run_id) == before
    assert ledger.read_text().splitlines() == ["refund B2 1"]


def test_a_turn_message_finds_the_lease_taken_and_does_nothing(
    tmp_path: Path, ledger: Path
) -> None:
    agent = write_agent(tmp_path, [turn("done")])
    ctx = memory_context()
    run_id = create_run(ctx, agent, "x").run_id
    assert ctx.runs.acquire_lease(run_id, "another-worker", 30)

    assert advance(ctx, run_id, 1).outcome == "leased"
    assert [e.type for e in ctx.runs.events(run_id)] == ["run.created"]


@pytest.mark.parametrize("text", ["", "   \n\t", "\ud800"])
def test_blank_or_invalid_input_is_refused_before_a_run_exists(tmp_path: Path, text: str) -> None:
    agent = write_agent(tmp_path, [turn("done")])
    ctx = memory_context()
    with pytest.raises(InvalidInput):
        create_run(ctx, agent, text)
    assert ctx.runs.list() == []


def test_a_changed_agent_stalls_the_run_and_says_what_changed(tmp_path: Path, ledger: Path) -> None:
    agent = write_agent(tmp_path, [turn("a", call("lookup_order", order_id="A1")), turn("b")])
    ctx = memory_context()
    run_id = create_run(ctx, agent, "x").run_id
    first = advance(ctx, run_id, 1)
    agent.write_text(agent.read_text().replace("You are a test agent.", "You are different."))

    assert advance(ctx, run_id, first.seq).outcome == "stalled"
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.STALLED
    assert record.error is not None
    assert "changed: system" in record.error and "start the run again" in record.error


def test_a_turn_waits_out_a_late_duplicate_that_briefly_holds_the_lease(
    tmp_path: Path, ledger: Path
) -> None:
    # Given a late duplicate of an earlier message holding the run's lease for a moment
    agent = write_agent(tmp_path, [turn("done")])
    ctx = memory_context()
    run_id = create_run(ctx, agent, "x").run_id
    assert ctx.runs.acquire_lease(run_id, "late-duplicate", 30)
    threading.Timer(0.1, ctx.runs.release_lease, (run_id, "late-duplicate")).start()

    # When the run's real next turn arrives meanwhile, it waits instead of giving up
    assert advance(ctx, run_id, 1).outcome == "completed"


def test_a_run_nothing_disturbs_completes_without_a_single_warning(
    tmp_path: Path, ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a run on stores that save events and snapshots apart (a checkpoint per step)
    agent = write_agent(tmp_path, LOOK_REFUND_ANSWER)
    ctx = memory_context()
    run_id = create_run(ctx, agent, "refund B2").run_id
    caplog.set_level(logging.WARNING)
    # When it runs to the end with no crash, no rival and no late message
    assert drive(ctx, run_id).outcome == "completed"
    # Then nothing was worth a warning: each checkpoint expected the seq the last one saved
    # (a save that found its own last checkpoint would be healed as a late one, loudly)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
