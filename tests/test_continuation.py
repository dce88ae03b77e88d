"""Continuations, cancels and expiry on memory stores, driven in-process with a clock we set.

Every refusal is checked twice: it says what is wrong, and the run's events are
exactly what they were before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.continuation import make_continuation, parse_message
from runtime.errors import (
    BindingChanged,
    InvalidContinuation,
    MalformedContinuation,
    RatchetError,
    RunNotFound,
    RunRefused,
    SuspensionAlreadyAnswered,
    SuspensionExpired,
    SuspensionMismatch,
)
from runtime.fsm import rebuild
from runtime.models import Event, RunStatus
from store.conformance import FakeClock
from store.runs.memory import MemoryRunStore
from store.snapshots.memory import MemorySnapshotStore
from tasks.context import Context
from tasks.control import apply_continuation, cancel, expire_suspended
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, drive, turn, write_agent
from worker.render import record_lines

ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ctx(clock: FakeClock) -> Context:
    return Context(Settings(lease_s=30), MemorySnapshotStore(), MemoryRunStore(clock=clock))


class Chained:
    """Stands in for the broker: records the turns a continuation chains."""

    def __init__(self) -> None:
        self.turns: list[tuple[str, int]] = []

    def __call__(self, run_id: str, seq: int) -> None:
        self.turns.append((run_id, seq))


def answer(
    ctx: Context, run_id: str, continuation_id: str = "c1", **fields: Any
) -> tuple[str, Chained]:
    chained = Chained()
    continuation = make_continuation(run_id, continuation_id, **fields)
    return apply_continuation(ctx, continuation, enqueue=chained), chained


def suspended_run(
    ctx: Context, tmp_path: Path, script: list[dict[str, Any]] = ASK, **agent: Any
) -> str:
    if "max_suspended_s" in agent:
        agent["extra"] = f"max_suspended_s = {agent.pop('max_suspended_s')}"
    path = write_agent(tmp_path, script, **agent)
    run_id = create_run(ctx, path, "refund my order").run_id
    assert drive(ctx, run_id).outcome == "suspended"
    return run_id


def events(ctx: Context, run_id: str) -> list[Event]:
    return ctx.runs.events(run_id)


def refused_without_change(
    ctx: Context, run_id: str, error: type[RatchetError], attempt: Callable[[], object]
) -> str:
    before = events(ctx, run_id)
    with pytest.raises(error) as caught:
        attempt()
    assert events(ctx, run_id) == before
    return str(caught.value)


def test_an_answer_reaches_the_model_as_the_control_tools_structured_result_and_the_run_completes(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    run_id = suspended_run(ctx, tmp_path)
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.NEEDS_USER_INPUT
    assert record.suspension is not None and record.suspension.prompt == "Which order?"
    # The suspended run holds no lease
    assert ctx.runs.lease(run_id) is None

    outcome, chained = answer(ctx, run_id, input="Order B2, the toaster")

    assert outcome == "continued"
    assert chained.turns == [(run_id, record.last_seq + 1)]
    assert drive(ctx, run_id).outcome == "completed"
    state = rebuild(events(ctx, run_id))
    assert state is not None
    tool_message = next(m for m in state.transcript if m.role == "tool")
    assert json.loads(tool_message.content) == {
        "type": "run_continuation",
        "outcome": "needs_user_input",
        "prompt": "Which order?",
        "input": "Order B2, the toaster",
        "continuation_id": "c1",
    }
    assert state.usage.tool_calls == 0  # the control tool is not a tool call the budget counts


def test_the_same_continuation_delivered_twice_is_applied_once_and_the_second_is_a_duplicate(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    run_id = suspended_run(ctx, tmp_path)
    first, _ = answer(ctx, run_id, "same", input="B2")
    # The second copy arrives before the next turn ran: acknowledged, and the turn re-chained
    second, chained = answer(ctx, run_id, "same", input="B2")
    assert (first, second) == ("continued", "duplicate")
    assert chained.turns == [(run_id, events(ctx, run_id)[-1].seq)]
    drive(ctx, run_id)
    # A third copy after the run completed is still a duplicate, not a refusal
    third, chained = answer(ctx, run_id, "same", input="B2")
    assert third == "duplicate" and chained.turns == []
    continued = [e for e in events(ctx, run_id) if e.type == "run.continued"]
    assert len(continued) == 1


def test_a_different_second_answer_to_an_answered_suspension_is_refused_and_changes_nothing(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    run_id = suspended_run(ctx, tmp_path)
    answer(ctx, run_id, "first", input="B2")

    message = refused_without_change(
        ctx, run_id, SuspensionAlreadyAnswered, lambda: answer(ctx, run_id, "second", input="A1")
    )
    assert run_id in message and "already answered by continuation first" in message
    # The same id reused with another answer is refused too, not taken as a duplicate
    message = refused_without_change(
        ctx, run_id, InvalidContinuation, lambda: answer(ctx, run_id, "first", input="A1")
    )
    assert "already used" in message and "different answer" in message


@pytest.mark.parametrize("status", ["queued", "completed", "cancelled", "failed"])
def test_a_continuation_for_a_run_that_is_not_suspended_is_refused_naming_its_status(
    ctx: Context, tmp_path: Path, ledger: Path, status: str
) -> None:
    if status == "queued":
        path = write_agent(tmp_path, ASK)
        run_id = create_run(ctx, path, "refund").run_id
    elif status == "completed":
        path = write_agent(tmp_path, [turn("Nothing to do.")])
        run_id = create_run(ctx, path, "refund").run_id
        drive(ctx, run_id)
    elif status == "cancelled":
        run_id = suspended_run(ctx, tmp_path)
        cancel(ctx, run_id, "customer hung up")
    else:
        run_id = suspended_run(ctx, tmp_path, max_suspended_s=60)
        ctx.runs.clock.advance(61_000)  # type: ignore[attr-defined]
        assert expire_suspended(ctx) == [run_id]

    message = refused_without_change(
        ctx, run_id, RunRefused, lambda: answer(ctx, run_id, input="B2")
    )
    assert message.startswith(f"run {run_id} is {status}:")


def test_a_continuation_for_an_unknown_run_is_refused_naming_the_run(ctx: Context) -> None:
    with pytest.raises(RunNotFound, match="run nosuchrun not found"):
        answer(ctx, "nosuchrun", input="B2")


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("", "is empty"),
        ("  \n\t ", "is blank"),
        ("x" * 8193, "8193 bytes, over the 8192-byte limit"),
        ("é" * 4097, "8194 bytes"),
        (b"\xff\xfe order B2", "not valid UTF-8"),
        ("order \udcff", "not valid UTF-8"),
    ],
    ids=["empty", "blank", "8193-bytes", "multibyte-over", "invalid-utf8-bytes", "lone-surrogate"],
)
def test_inputs_that_are_empty_blank_too_long_or_not_utf8_are_refused_and_change_nothing(
    ctx: Context, tmp_path: Path, ledger: Path, given: object, problem: str
) -> None:
    run_id = suspended_run(ctx, tmp_path)
    message = refused_without_change(
        ctx, run_id, InvalidContinuation, lambda: answer(ctx, run_id, input=given)
    )
    assert run_id in message and problem in message
    # The run still waits and takes a valid answer of exactly 8192 bytes
    assert answer(ctx, run_id, input="y" * 8192)[0] == "continued"


def test_an_answer_of_the_wrong_kind_for_the_suspension_is_refused(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    run_id = suspended_run(ctx, tmp_path)
    message = refused_without_change(
        ctx, run_id, RunRefused, lambda: answer(ctx, run_id, approve=True)
    )
    assert "answer with --input TEXT" in message
    message = refused_without_change(
        ctx, run_id, InvalidContinuation, lambda: answer(ctx, run_id, input="B2", deny="no")
    )
    assert "both input and deny given" in message


def test_a_text_input_to_a_tool_awaiting_approval_is_refused_not_taken_as_a_denial(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    # Given a refund waiting for a person's approval
    script = [turn("refund", call("issue_refund", order_id="B2", amount_cents=2900)), turn("ok")]
    run_id = suspended_run(ctx, tmp_path, script, require_approval=["issue_refund"])

    # When someone answers it with text, as if it were a question
    message = refused_without_change(
        ctx, run_id, RunRefused, lambda: answer(ctx, run_id, input="yes please")
    )

    # Then it is refused, saying how to answer, and the tool still waits
    assert "awaits approval, not an input" in message and "--approve or --deny" in message
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.AWAITING_APPROVAL
    assert answer(ctx, run_id, "c2", approve=True)[0] == "continued"
    assert drive(ctx, run_id).outcome == "completed"
    assert ledger.read_text().splitlines() == ["refund B2 2900"]


def test_a_continuation_naming_another_suspension_is_never_applied_to_the_current_one(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    script = [
        turn("q1", call("request_user_input", prompt="Which order?")),
        turn("q2", call("blocked", reason="I need a manager's code")),
        turn("Done."),
    ]
    run_id = suspended_run(ctx, tmp_path, script)
    first = ctx.runs.get(run_id)
    assert first is not None and first.suspension is not None
    answer(ctx, run_id, "a1", input="B2", suspension_seq=first.suspension.seq)
    assert drive(ctx, run_id).outcome == "suspended"
    second = ctx.runs.get(run_id)
    assert second is not None and second.status == RunStatus.BLOCKED
    assert second.suspension is not None

    # A late, different answer to the first question does not answer the second one
    message = refused_without_change(
        ctx,
        run_id,
        SuspensionAlreadyAnswered,
        lambda: answer(ctx, run_id, "late", input="A1", suspension_seq=first.suspension.seq),  # type: ignore[union-attr]
    )
    assert f"seq {first.suspension.seq} was already answered by continuation a1" in message
    # Nor does an answer naming a suspension that does not exist
    message = refused_without_change(
        ctx,
        run_id,
        SuspensionMismatch,
        lambda: answer(ctx, run_id, "x", input="A1", suspension_seq=999),
    )
    assert f"waiting on the one at seq {second.suspension.seq}" in message
    assert answer(ctx, run_id, "a2", input="1234", suspension_seq=second.suspension.seq)[0] == (
        "continued"
    )
    assert drive(ctx, run_id).outcome == "completed"


def test_a_continuation_is_refused_when_the_agent_changed_since_the_run_started(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    run_id = suspended_run(ctx, tmp_path)
    path = tmp_path / "test-agent.toml"
    path.write_text(path.read_text().replace("You are a test agent.", "You are a pirate."))

    message = refused_without_change(
        ctx, run_id, BindingChanged, lambda: answer(ctx, run_id, input="B2")
    )
    assert run_id in message and "changed: system" in message


def test_a_continuation_is_refused_when_the_turn_budget_would_not_allow_another_model_call(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    run_id = suspended_run(ctx, tmp_path, budgets={"max_turns": 1})
    message = refused_without_change(
        ctx, run_id, RunRefused, lambda: answer(ctx, run_id, input="B2")
    )
    assert "budget `max_turns` exhausted: 1 used of 1" in message


def test_time_suspended_does_not_count_against_the_deadline(
    ctx: Context, clock: FakeClock, tmp_path: Path, ledger: Path
) -> None:
    # Given a run with 10 s to run, that ran 3 s and then waited an hour for an answer
    path = write_agent(tmp_path, ASK, budgets={"timeout_seconds": 10})
    run_id = create_run(ctx, path, "refund").run_id
    clock.advance(3_000)
    drive(ctx, run_id)
    clock.advance(3_600_000)
    # When the answer comes and the run goes on 6 s later
    assert answer(ctx, run_id, input="B2")[0] == "continued"
    clock.advance(6_000)
    # Then it still has its running time left: 3 + 6 < 10
    assert drive(ctx, run_id).outcome == "completed"
    record = ctx.runs.get(run_id)
    assert record is not None and record.suspended_ms == 3600_000
    assert "running 9.0s of 10s, suspended 3600.0s" in "\n".join(record_lines(record, clock()))


def test_a_continuation_is_refused_when_the_run_used_up_its_running_time_before_it_suspended(
    ctx: Context, clock: FakeClock, tmp_path: Path, ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a model call that takes 11 s of a 10 s run, and then asks a question
    path = write_agent(tmp_path, ASK, budgets={"timeout_seconds": 10})
    provider = ctx.agent(path).provider
    complete = provider.complete

    def slow(*args: Any, **kwargs: Any) -> Any:
        clock.advance(11_000)
        return complete(*args, **kwargs)

    monkeypatch.setattr(provider, "complete", slow)
    run_id = create_run(ctx, path, "refund").run_id
    assert drive(ctx, run_id).outcome == "suspended"
    clock.advance(5_000)
    # Then an answer is refused: the deadline, counted without the 5 s suspended, has passed
    message = refused_without_change(
        ctx, run_id, RunRefused, lambda: answer(ctx, run_id, input="B2")
    )
    assert "budget `timeout_seconds` exhausted: 11 used of 10" in message


def test_a_run_that_waited_longer_than_max_suspended_s_expires_when_its_answer_arrives(
    ctx: Context, clock: FakeClock, tmp_path: Path, ledger: Path
) -> None:
    run_id = suspended_run(ctx, tmp_path, max_suspended_s=60)
    clock.advance(61_000)

    with pytest.raises(
        SuspensionExpired, match=f"run {run_id} waited 61s .* max_suspended_s of 60"
    ):
        answer(ctx, run_id, input="B2")

    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.FAILED
    assert record.error is not None and "max_suspended_s of 60" in record.error
    assert events(ctx, run_id)[-1].type == "run.expired"
    assert ctx.snapshots.load(run_id) is None


def test_an_answer_arriving_exactly_at_max_suspended_s_is_still_taken(
    ctx: Context, clock: FakeClock, tmp_path: Path, ledger: Path
) -> None:
    # The limit is how long a run may wait: waiting exactly that long is within it.
    on_time = suspended_run(ctx, tmp_path / "a", max_suspended_s=60)
    late = suspended_run(ctx, tmp_path / "b", max_suspended_s=60)
    clock.advance(60_000)

    assert answer(ctx, on_time, input="B2")[0] == "continued"
    clock.now_ms += 1
    with pytest.raises(SuspensionExpired, match="max_suspended_s of 60"):
        answer(ctx, late, input="B2")


def test_the_sweep_expires_only_runs_that_waited_longer_than_their_own_limit(
    ctx: Context, clock: FakeClock, tmp_path: Path, ledger: Path
) -> None:
    overdue = suspended_run(ctx, tmp_path / "a", max_suspended_s=60, name="short")
    patient = suspended_run(ctx, tmp_path / "b", max_suspended_s=600, name="long")
    forever = suspended_run(ctx, tmp_path / "c", name="forever")
    approval = suspended_run(
        ctx,
        tmp_path / "d",
        [turn("refund", call("issue_refund", order_id="B2", amount_cents=1)), turn("ok")],
        max_suspended_s=30,
        require_approval=["issue_refund"],
        name="approve",
    )
    clock.advance(120_000)

    assert sorted(expire_suspended(ctx)) == sorted([overdue, approval])

    statuses = {r: ctx.runs.get(r).status for r in (overdue, patient, forever, approval)}  # type: ignore[union-attr]
    assert statuses == {
        overdue: RunStatus.FAILED,
        patient: RunStatus.NEEDS_USER_INPUT,
        forever: RunStatus.NEEDS_USER_INPUT,
        approval: RunStatus.FAILED,
    }
    assert expire_suspended(ctx) == []  # a second sweep finds nothing more
    assert not ledger.exists()


def test_an_agent_without_max_suspended_s_keeps_the_binding_it_always_had(tmp_path: Path) -> None:
    from runtime_io.agent_files import load_agent

    plain = load_agent(write_agent(tmp_path / "a", ASK))
    limited = load_agent(write_agent(tmp_path / "b", ASK, extra="max_suspended_s = 60"))
    assert "max_suspended_s" not in plain.binding_document
    assert limited.binding_document["max_suspended_s"] == 60


def test_an_approved_tool_runs_once_and_a_denied_one_never_runs_and_the_model_is_told(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    script = [turn("refund", call("issue_refund", order_id="B2", amount_cents=2900)), turn("ok")]
    approved = suspended_run(ctx, tmp_path / "a", script, require_approval=["issue_refund"])
    denied = suspended_run(ctx, tmp_path / "b", script, require_approval=["issue_refund"])
    record = ctx.runs.get(approved)
    assert record is not None and record.status == RunStatus.AWAITING_APPROVAL
    assert record.suspension is not None and record.suspension.tool == "issue_refund"
    assert record.suspension.arguments == {"order_id": "B2", "amount_cents": 2900}
    assert not ledger.exists()  # nothing ran before the approval

    answer(ctx, approved, approve=True)
    answer(ctx, denied, deny="amount too high")
    assert drive(ctx, approved).outcome == "completed"
    assert drive(ctx, denied).outcome == "completed"

    assert ledger.read_text().splitlines() == ["refund B2 2900"]
    state = rebuild(events(ctx, denied))
    assert state is not None
    told = [m for m in state.transcript if m.role == "tool"]
    assert len(told) == 1 and told[0].is_error
    assert "denied `issue_refund`: amount too high" in told[0].content


def test_cancelling_a_suspended_run_makes_it_terminal_and_later_answers_are_refused(
    ctx: Context, tmp_path: Path, ledger: Path
) -> None:
    run_id = suspended_run(ctx, tmp_path)
    record = cancel(ctx, run_id, "customer hung up")
    assert record.status == RunStatus.CANCELLED and record.error == "customer hung up"
    assert events(ctx, run_id)[-1].type == "run.cancelled"
    assert ctx.snapshots.load(run_id) is None
    # The log folds to the record the cancel wrote
    state = rebuild(events(ctx, run_id))
    assert state is not None and state.status == RunStatus.CANCELLED
    # A second cancel is refused with the status
    with pytest.raises(RunRefused, match=f"run {run_id} is cancelled: it has already finished"):
        cancel(ctx, run_id)
    assert drive(ctx, run_id).outcome == "idle"


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("not json at all", "a JSON string, not an object"),
        (["run_id", "x"], "a JSON array"),
        ({"input": "B2"}, "`run_id` is missing"),
        ({"run_id": 7, "input": "B2"}, "`run_id` must be str, not number"),
        ({"run_id": "r", "input": 5}, "`input` must be str"),
        ({"run_id": "r", "approve": "yes"}, "`approve` must be bool, not string"),
        ({"run_id": "r", "suspension_seq": True, "input": "x"}, "`suspension_seq` must be int"),
        ({"run_id": "r", "input": "x", "reply_to": "q"}, "unknown key(s) 'reply_to'"),
    ],
)
def test_a_malformed_plain_json_message_is_refused_with_its_reason(
    body: object, problem: str
) -> None:
    with pytest.raises(MalformedContinuation) as caught:
        parse_message(body)
    assert problem in str(caught.value)


def test_a_well_formed_plain_json_message_keeps_its_fields() -> None:
    body = {"run_id": "r1", "deny": "too much", "continuation_id": "c-9", "suspension_seq": 4}
    assert parse_message(body) == body


def test_runs_show_shows_time_running_time_suspended_and_the_pending_question(
    ctx: Context, clock: FakeClock, tmp_path: Path, ledger: Path
) -> None:
    path = write_agent(tmp_path, ASK, budgets={"timeout_seconds": 100})
    run_id = create_run(ctx, path, "refund").run_id
    clock.advance(2_000)
    drive(ctx, run_id)
    record = ctx.runs.get(run_id)
    assert record is not None and record.suspension is not None
    clock.advance(30_000)

    lines = record_lines(record, clock())

    assert "time       running 2.0s of 100s, suspended 30.0s" in lines
    assert any(
        line.startswith("waiting    needs_user_input since")
        and f"seq {record.suspension.seq}" in line
        for line in lines
    )
    assert "prompt     Which order?" in lines
