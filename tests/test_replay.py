"""The core still steers every recorded run the way it went: Temporal's replay check, for runs.

``bench/replay.py`` folds each golden event log (``tests/golden/events/``) event by
event and, at every prefix, holds the recorded event against what ``decide`` and the
rules beside it would do there; events from outside the core (a model's answer, a
tool's result, a person, an operator) are checked to be allowed there and counted.
A change to the core that would choose another next step for a recorded run fails
here (``bench/mutant_list.py``'s ``Y`` mutants are such changes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay import golden_logs, main, read_log, replay
from runtime.models import Event
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent

LOGS = golden_logs()


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_the_core_predicts_every_choice_a_golden_run_made(path: Path) -> None:
    # Given a log an earlier build recorded
    events = read_log(path)
    # When it is replayed through this build's core
    done = replay(events, path.name)
    # Then every event the core chooses is the one it chooses now, and every other one
    # came from outside at a point where the core allowed it
    assert done.divergences == []
    assert done.predicted > 0 and done.matched == done.predicted
    assert done.predicted + done.outside == len(events) - 1  # all but run.created


def test_the_replay_of_the_golden_logs_predicts_every_kind_of_choice() -> None:
    # A replay that predicted nothing could not fail: each kind of choice is held somewhere.
    predicted: set[str] = set()
    for path in LOGS:
        events = read_log(path)
        for end, event in enumerate(events[1:], start=1):
            before = replay(events[:end], path.name)
            after = replay(events[: end + 1], path.name)
            if after.predicted > before.predicted:
                predicted.add(event.type)
    assert predicted == {
        "model.requested",
        "tool.requested",
        "tool.failed",
        "run.suspended",
        "run.parked",
        "run.failed",
        "run.stalled",
        "run.completed",
    }


def _edited(name: str, seq: int, kind: str, data: dict[str, object]) -> list[Event]:
    events = read_log(next(p for p in LOGS if p.name.endswith(name)))
    events[seq - 1] = events[seq - 1].model_copy(update={"type": kind, "data": data})
    return events


def test_a_run_that_went_on_past_its_budget_diverges_where_it_did() -> None:
    # Given the budget-failed run, recorded as asking the model a third time
    events = _edited("budget-failed.jsonl", 6, "model.requested", {"turn": 3})
    # When it is replayed
    done = replay(events, "edited")
    # Then the core would have failed it there
    assert done.first_divergence == "seq 6 model.requested: the core would Fail"


def test_a_tool_run_without_its_approval_diverges() -> None:
    # Given the approvals run, recorded as running the refund instead of asking a person
    events = _edited(
        "approvals.jsonl",
        4,
        "tool.requested",
        {"call_id": "call_1_1", "name": "issue_refund", "arguments": {}},
    )[:4]
    # When it is replayed, then the core would have suspended it for approval
    assert replay(events, "edited").first_divergence == (
        "seq 4 tool.requested: the core would Suspend"
    )


def test_an_outside_answer_where_the_core_allowed_none_diverges() -> None:
    # Given a model answer recorded where no model call was under way
    events = _edited("tools-and-answer.jsonl", 5, "model.responded", {"content": "?"})[:5]
    # Then the replay names it
    assert replay(events, "edited").first_divergence == (
        "seq 5 model.responded: a model answer with no model call under way"
    )


def test_a_run_of_this_build_replays_as_it_ran(tmp_path: Path) -> None:
    # Given a run of this build: tools side by side, a call to a tool it lacks, an answer
    ctx = memory_context()
    agent = write_agent(
        tmp_path,
        [
            turn(
                "Looking.", call("lookup_order", order_id="B2"), call("refund_policy", reason="x")
            ),
            turn("Hm.", call("no_such_tool")),
            turn("Done."),
        ],
    )
    run = create_run(ctx, agent, "Refund B2.", "replayed-run")
    assert drive(ctx, run.run_id).outcome == "completed"
    # When its log is replayed
    done = replay(list(ctx.runs.events(run.run_id, after_seq=0)), "replayed-run")
    # Then it replays as it ran
    assert done.divergences == [] and done.matched == done.predicted >= 6


def test_the_command_prints_each_log_and_fails_on_a_divergence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a golden log as recorded, and the same log edited to run past its budget
    good = next(p for p in LOGS if p.name.endswith("budget-failed.jsonl"))
    bad = tmp_path / "bad.jsonl"
    events = _edited("budget-failed.jsonl", 6, "model.requested", {"turn": 3})
    bad.write_text("".join(json.dumps(e.model_dump(mode="json")) + "\n" for e in events))
    # When the command replays each
    assert main([str(good)]) == 0
    assert main([str(bad)]) == 1
    # Then it says per log what it predicted and where the run would part
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{good.name}: events 6, predicted 3, matched 3, outside 2")
    assert out[2] == (
        "bad.jsonl: events 6, predicted 3, matched 2, outside 2, first divergence: "
        "seq 6 model.requested: the core would Fail"
    )
