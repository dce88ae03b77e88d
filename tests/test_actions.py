"""The rules that decide a run's fate, pure (runtime/actions.py, runtime/recovery.py).

The tasks only carry these out; the turn-level tests (test_turns.py,
test_turn_guarantees.py, test_recovery.py) show each carried out on stores. Here
each rule is asked directly, at its edges.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.actions import (
    TOOL_TIMEOUT_ATTEMPTS,
    CallModel,
    CheckBinding,
    Fail,
    Stall,
    TurnOutcome,
    after_model_timeout,
    after_probe,
    after_store_failure,
    after_tool_timeout,
    binding_stall,
    model_failed,
    park,
)
from runtime.errors import SnapshotFailed
from runtime.fsm import ENDINGS, decide
from runtime.models import Event, RunStatus, ToolCall
from runtime.probes import Answer, Probed, Rule
from runtime.recovery import (
    OPERATOR,
    SWEEPER,
    Disposition,
    Verdict,
    dead_letter,
)
from runtime.tools import ToolOutcome
from tests.test_fsm import T0_MS, agent, started, step

CALL = ToolCall(id="call_1_0", name="issue_refund", arguments={"order_id": "B2"})


def test_a_retryable_provider_error_stalls_the_run_for_a_resume_and_any_other_fails_it() -> None:
    stall = model_failed("run-1", 3, "503 from the provider", retryable=True)
    fail = model_failed("run-1", 3, "401 unauthorized", retryable=False)

    assert isinstance(stall, Stall)
    assert "`ratchet runs resume run-1`" in stall.reason
    assert stall.preceded_by == (("model.failed", {"turn": 3, "error": "503 from the provider"}),)
    assert isinstance(fail, Fail) and fail.budget is None
    assert fail.reason == "model call for turn 3 failed: 401 unauthorized"
    assert fail.preceded_by == (("model.failed", {"turn": 3, "error": "401 unauthorized"}),)


@pytest.mark.parametrize(
    ("max_turns", "timed_out", "next_step"),
    [
        (3, 1, CallModel),  # the first timeout: asked again
        (3, 2, CallModel),  # the second: the last attempt is still allowed
        (3, 3, Fail),  # the third uses the turn budget up: the run fails on it
        (1, 1, Fail),
    ],
)
def test_a_model_call_that_times_out_is_a_counted_attempt_asked_again_within_max_turns(
    tmp_path: Path, max_turns: int, timed_out: int, next_step: type
) -> None:
    # Given a run whose model calls outlived their timeout ``timed_out`` times in a row
    a = agent(tmp_path, max_turns=max_turns)
    state = started(a)
    for turn in range(1, timed_out + 1):
        state = step(state, "model.requested", turn=turn)
        for kind, data in after_model_timeout(turn, f"model call for turn {turn} timed out"):
            state = step(state, kind, **data)

    # When the run decides what next
    action = decide(state, a, T0_MS)

    # Then it calls the model again, or fails on its turn budget; it never stalls on it
    assert state.status.is_live and state.usage.model_attempts == timed_out
    assert isinstance(action, next_step)
    assert not isinstance(action, Fail) or action.budget == "max_turns"


def test_a_model_timeout_records_one_failed_attempt_that_says_it_timed_out() -> None:
    assert after_model_timeout(2, "model call for turn 2 did not return") == (
        (
            "model.failed",
            {"turn": 2, "error": "model call for turn 2 did not return", "timeout": True},
        ),
    )


@pytest.mark.parametrize(
    ("seq", "problem"),
    [(1, "redis: connection refused"), (57, "disk full"), (3, "")],
)
def test_a_checkpoint_the_stores_refuse_ends_the_turn_and_stalls_the_run_saying_so(
    seq: int, problem: str
) -> None:
    error, stall = after_store_failure("run-1", seq, problem)

    assert isinstance(error, SnapshotFailed) and (error.run_id, error.seq) == ("run-1", seq)
    assert isinstance(stall, Stall) and stall.preceded_by == ()
    assert stall.reason == str(error)
    assert f"checkpoint at seq {seq} could not be saved ({problem})" in stall.reason
    assert "`ratchet runs resume run-1`" in stall.reason


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (RunStatus.QUEUED, TurnOutcome.NEXT),
        (RunStatus.TOOLS, TurnOutcome.NEXT),
        (RunStatus.WAITING, TurnOutcome.SUSPENDED),
        (RunStatus.AWAITING_APPROVAL, TurnOutcome.SUSPENDED),
        (RunStatus.NEEDS_RECONCILIATION, TurnOutcome.PARKED),
        (RunStatus.STALLED, TurnOutcome.STALLED),
        (RunStatus.COMPLETED, TurnOutcome.COMPLETED),
        (RunStatus.FAILED, TurnOutcome.FAILED),
        (RunStatus.CANCELLED, TurnOutcome.CANCELLED),
        (RunStatus.DEAD_LETTERED, TurnOutcome.DEAD_LETTERED),
    ],
)
def test_a_turn_that_leaves_the_run_in_a_status_has_the_outcome_that_names_it(
    status: RunStatus, outcome: TurnOutcome
) -> None:
    assert TurnOutcome.of(status) is outcome


def test_every_status_a_turn_can_leave_has_an_outcome() -> None:
    for status in RunStatus:
        assert isinstance(TurnOutcome.of(status), TurnOutcome)


def test_an_idempotent_tool_that_times_out_is_tried_again_until_its_tries_run_out() -> None:
    for attempt in range(1, TOOL_TIMEOUT_ATTEMPTS):
        assert after_tool_timeout(CALL, True, attempt, 0.5) == Rule.RERUN
    last = after_tool_timeout(CALL, True, TOOL_TIMEOUT_ATTEMPTS, 0.5)
    assert last == ToolOutcome(
        False, f"`issue_refund` did not return within 0.5 s, {TOOL_TIMEOUT_ATTEMPTS} times"
    )


def test_any_other_tool_that_times_out_gets_one_try_and_its_outcome_is_left_unknown() -> None:
    assert after_tool_timeout(CALL, False, 1, 0.5) is None


@pytest.mark.parametrize(
    ("answer", "then"),
    [
        (Answer.RAN, None),
        (Answer.NOT_RUN, Rule.RERUN),
        (Answer.UNKNOWN, Rule.PARK),
        (Answer.FAILED, Rule.PARK),
        (Answer.TIMED_OUT, Rule.PARK),
    ],
)
def test_a_probe_that_cannot_say_the_call_ran_or_did_not_parks_it(
    answer: Answer, then: Rule | None
) -> None:
    assert after_probe(answer) == then


def test_a_park_names_the_first_unknown_call_its_probe_and_the_others() -> None:
    other = ToolCall(id="call_1_1", name="issue_refund", arguments={})
    parked = park("run-1", [(CALL, Probed(Answer.UNKNOWN)), (other, None)], timed_out_s=None)

    assert parked.data["call_id"] == CALL.id and parked.data["probe"] == "unknown"
    assert parked.data["also_unknown"] == [other.id]
    assert f"`ratchet runs reconcile run-1 {CALL.id}`" in parked.data["reason"]


def test_decide_stalls_a_live_run_whose_agent_binding_changed_but_not_a_finished_one(
    tmp_path: Path,
) -> None:
    a = agent(tmp_path)
    state = started(a).model_copy(update={"binding": "another binding"})
    done = step(started(a), "run.completed", output="done").model_copy(
        update={"binding": "another binding"}
    )

    assert isinstance(decide(state, a, T0_MS), CheckBinding)
    assert not isinstance(decide(done, a, T0_MS), CheckBinding)
    stall = binding_stall(state, a, None)
    assert "run-1" in stall.reason and "start the run again" in stall.reason


def resumed(by: str, seq: int) -> Event:
    return Event(seq=seq, type="run.resumed", at_ms=T0_MS, data={"by": by, "attempt": seq})


def test_only_the_sweeper_dead_letters_and_only_at_the_limit_or_when_it_can_never_resume() -> None:
    eligible = Verdict(Disposition.RESUME_ELIGIBLE)
    refused = Verdict(Disposition.RESTART_REQUIRED)
    under = [resumed(SWEEPER, 2)]
    at = [resumed(SWEEPER, 2), resumed(SWEEPER, 3)]

    assert dead_letter("run-1", SWEEPER, eligible, under, 2) is None
    assert dead_letter("run-1", OPERATOR, eligible, at, 2) is None
    assert dead_letter("run-1", OPERATOR, refused, [], 2) is None
    at_limit = dead_letter("run-1", SWEEPER, eligible, at, 2)
    assert at_limit is not None and len(at_limit.data["attempts"]) == 2
    never = dead_letter("run-1", SWEEPER, refused, [], 2)
    assert never is not None
    assert never.data["reason"].startswith("the sweeper cannot resume it: ")


def test_each_ending_leaves_the_run_in_the_status_a_record_written_without_the_state_shows(
    tmp_path: Path,
) -> None:
    # A cancel and a dead letter of a run with no usable state change its record by
    # ENDINGS alone: the fold must make the same change.
    a = agent(tmp_path)
    for kind, status in ENDINGS.items():
        ended = step(started(a), kind, reason="why", output="out")
        assert ended.status == status, kind
        assert (ended.output if status == RunStatus.COMPLETED else ended.error) is not None
