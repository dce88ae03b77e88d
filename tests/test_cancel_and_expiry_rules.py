"""The cancel cascade's and the expiry's rules, pure (runtime/children.py,
runtime/continuation.py). tests/test_control_tasks.py, tests/test_expiry.py and
tests/integration/test_run_trees.py show tasks/control.py carrying them out."""

from __future__ import annotations

import pytest

from runtime.children import (
    CancelCascade,
    cancel_reaches,
    child_run_id,
    parent_cancelled_reason,
)
from runtime.continuation import (
    MAX_CANCEL_REASON_CHARS,
    cancel_reason,
    expired_event_data,
    expiry_of,
)
from runtime.errors import RunRefused
from runtime.models import RunState, RunStatus, Suspension

NOW_MS = 1_700_000_000_000
SINCE_MS = NOW_MS - 10_000


def suspended(reason: RunStatus, tool: str, call_id: str = "c1") -> Suspension:
    return Suspension(reason=reason, call_id=call_id, tool=tool, seq=4, since_ms=SINCE_MS)


CHILD = suspended(RunStatus.WAITING, "run_child", "c7")
FROM_STATE = None

REACHES = [
    # (status, suspension, what the cancel goes on to)
    (RunStatus.WAITING, CHILD, [child_run_id("parent", "c7")]),
    (RunStatus.WAITING, suspended(RunStatus.WAITING, "wait"), []),
    (RunStatus.NEEDS_USER_INPUT, suspended(RunStatus.NEEDS_USER_INPUT, "request_user_input"), []),
    (RunStatus.BLOCKED, suspended(RunStatus.BLOCKED, "blocked"), []),
    (RunStatus.AWAITING_APPROVAL, suspended(RunStatus.AWAITING_APPROVAL, "issue_refund"), []),
    (RunStatus.AWAITING_APPROVAL, None, []),
    (RunStatus.COMPLETED, None, []),
    (RunStatus.QUEUED, None, FROM_STATE),
    (RunStatus.MODEL, None, FROM_STATE),
    (RunStatus.TOOLS, None, FROM_STATE),
    (RunStatus.FAILED, None, FROM_STATE),
    (RunStatus.CANCELLED, None, FROM_STATE),
    (RunStatus.NEEDS_RECONCILIATION, None, FROM_STATE),
    (RunStatus.STALLED, None, FROM_STATE),
    (RunStatus.DEAD_LETTERED, None, FROM_STATE),
]


def test_the_reach_table_covers_every_status() -> None:
    assert {status for status, _, _ in REACHES} == set(RunStatus)


@pytest.mark.parametrize(("status", "suspension", "children"), REACHES, ids=lambda v: str(v)[:30])
def test_a_cancel_reaches_the_child_a_suspension_waits_for_or_reads_the_state(
    status: RunStatus, suspension: Suspension | None, children: list[str] | None
) -> None:
    assert cancel_reaches("parent", status, suspension) == children


def walk(cascade: CancelCascade, tree: dict[str, list[str]], ended: set[str]) -> list[str]:
    """Cancel as the shell does, over a tree of ids: the order runs are reached in."""
    order = []
    while (step := cascade.next()) is not None:
        child, parent = step
        assert parent in tree and child in tree[parent]
        order.append(child)
        cascade.reached(child, tree.get(child, []), child not in ended)
    return order


def test_the_cascade_goes_breadth_first_through_ended_runs_and_each_run_once() -> None:
    # Given a tree where b had ended already and d is named twice (a forged id)
    tree = {"root": ["a", "b"], "a": ["c"], "b": ["d"], "c": ["d", "root"], "d": []}
    cascade = CancelCascade("root", tree["root"], ended=False)
    # When the shell walks it
    order = walk(cascade, tree, ended={"b"})
    # Then every run below is reached once, level by level, b's child too
    assert order == ["a", "b", "c", "d"]
    assert cascade.ended == 3
    assert cascade.refusal(RunStatus.CANCELLED) is None


@pytest.mark.parametrize(
    ("root_ended", "below_ended", "refused"),
    [(True, set(), False), (False, {"a"}, False), (False, set(), True)],
)
def test_a_cancel_that_ended_nothing_is_refused(
    root_ended: bool, below_ended: set[str], refused: bool
) -> None:
    tree = {"root": ["a"], "a": []}
    cascade = CancelCascade("root", tree["root"], ended=root_ended)
    walk(cascade, tree, ended={"a"} - below_ended)
    refusal = cascade.refusal(RunStatus.COMPLETED)
    assert (refusal is not None) == refused
    if refusal is not None:
        assert isinstance(refusal, RunRefused)
        assert "run root" in str(refusal) and "nothing to cancel" in str(refusal)


@pytest.mark.parametrize(
    ("given", "recorded"),
    [
        (None, "cancelled by an operator"),
        ("", "cancelled by an operator"),
        (" \n\t ", "cancelled by an operator"),
        ("  the  customer\nhung up ", "the customer hung up"),
        ("x" * (MAX_CANCEL_REASON_CHARS + 5), "x" * MAX_CANCEL_REASON_CHARS),
    ],
)
def test_a_cancels_reason_is_one_line_bounded_and_never_empty(
    given: str | None, recorded: str
) -> None:
    assert cancel_reason(given) == recorded


def test_a_child_cancelled_by_its_parent_names_the_parent() -> None:
    assert parent_cancelled_reason("p1") == "its parent run p1 was cancelled"


def state_in(status: RunStatus, suspension: Suspension | None) -> RunState:
    return RunState.model_validate(
        {
            "run_id": "r1",
            "agent": "desk",
            "agent_file": "desk.toml",
            "binding": "b" * 64,
            "status": status,
            "suspension": suspension,
            "created_at_ms": SINCE_MS - 1_000,
            "seq": 5,
            "input": "refund B2",
            "budgets": {},
            "transcript": [],
        }
    )


ASKED = suspended(RunStatus.NEEDS_USER_INPUT, "request_user_input")
EXPIRY = [
    # (status, suspension, max_suspended_s, expires now)
    (RunStatus.NEEDS_USER_INPUT, ASKED, 9, True),
    (RunStatus.NEEDS_USER_INPUT, ASKED, 10, False),  # waited exactly its limit: not over it
    (RunStatus.NEEDS_USER_INPUT, ASKED, None, False),
    (RunStatus.AWAITING_APPROVAL, suspended(RunStatus.AWAITING_APPROVAL, "refund"), 1, True),
    (RunStatus.BLOCKED, suspended(RunStatus.BLOCKED, "blocked"), 1, True),
    (RunStatus.WAITING, suspended(RunStatus.WAITING, "wait"), 1, False),
    (RunStatus.WAITING, CHILD, 1, False),
    (RunStatus.NEEDS_USER_INPUT, None, 1, False),
    # A suspension left on a run no longer suspended does not expire it
    (RunStatus.MODEL, ASKED, 1, False),
    (RunStatus.CANCELLED, ASKED, 1, False),
]


@pytest.mark.parametrize(("status", "suspension", "max_s", "expires"), EXPIRY, ids=str)
def test_only_a_run_waiting_for_a_person_past_its_max_suspended_s_expires(
    status: RunStatus, suspension: Suspension | None, max_s: int | None, expires: bool
) -> None:
    reason = expiry_of(state_in(status, suspension), max_s, NOW_MS)
    assert (reason is not None) == expires
    if reason is not None:
        assert f"over the agent's max_suspended_s of {max_s}" in reason


def test_the_expired_event_names_the_suspension_and_how_long_it_lasted() -> None:
    assert expired_event_data(ASKED, "why", NOW_MS) == {
        "reason": "why",
        "suspension_seq": 4,
        "suspended_ms": 10_000,
    }
