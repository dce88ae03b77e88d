"""The sweeper's decisions, pure (runtime/recovery.py): what it does with each run it
finds due, from the run's record alone. tests/test_recovery.py and tests/test_expiry.py
show the shell carrying them out on real stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.continuation import expiry_is_due
from runtime.models import Event, RunStatus, Suspension
from runtime.recovery import SweepKind, SweepStep, dead_holder_step, due_after_ms, sweep_step
from tests.test_fsm import agent, started, step

LEASE_MS = 30_000
NOW_MS = 1_700_000_000_000


def suspended(reason: RunStatus, tool: str) -> Suspension:
    return Suspension(reason=reason, call_id="c1", tool=tool, seq=4, since_ms=NOW_MS - 5_000)


ASKED = suspended(RunStatus.NEEDS_USER_INPUT, "request_user_input")
BLOCKED = suspended(RunStatus.BLOCKED, "blocked")
APPROVAL = suspended(RunStatus.AWAITING_APPROVAL, "issue_refund")
TIMER = suspended(RunStatus.WAITING, "wait")
CHILD = suspended(RunStatus.WAITING, "run_child")

RESUME = SweepStep(SweepKind.RESUME, postpone_ms=LEASE_MS)
EXPIRE = SweepStep(SweepKind.EXPIRE)
LEAVE = SweepStep(SweepKind.LEAVE)

OVERDUE = [
    # (status, suspension, step): the due index says the run is overdue, its lease expired
    (RunStatus.QUEUED, None, RESUME),
    (RunStatus.MODEL, None, RESUME),
    (RunStatus.TOOLS, None, RESUME),
    (RunStatus.NEEDS_USER_INPUT, ASKED, EXPIRE),
    (RunStatus.BLOCKED, BLOCKED, EXPIRE),
    (RunStatus.AWAITING_APPROVAL, APPROVAL, EXPIRE),
    (RunStatus.WAITING, TIMER, SweepStep(SweepKind.WAKE)),
    # A parent waiting for its child: the expiry looks again and leaves it (no
    # max_suspended_s bounds a wait that is not for a person).
    (RunStatus.WAITING, CHILD, EXPIRE),
    # Terminal and due: a child whose parent was not told yet
    (RunStatus.COMPLETED, None, SweepStep(SweepKind.TELL_PARENT)),
    (RunStatus.FAILED, None, SweepStep(SweepKind.TELL_PARENT)),
    (RunStatus.CANCELLED, None, SweepStep(SweepKind.TELL_PARENT)),
    # Parked or given up on: a person acts, not the sweeper
    (RunStatus.NEEDS_RECONCILIATION, None, LEAVE),
    (RunStatus.STALLED, None, LEAVE),
    (RunStatus.DEAD_LETTERED, None, LEAVE),
]


def test_the_overdue_table_covers_every_status() -> None:
    assert {status for status, _, _ in OVERDUE} == set(RunStatus)


@pytest.mark.parametrize(("status", "suspension", "step"), OVERDUE, ids=lambda v: str(v)[:30])
def test_the_sweeper_wakes_expires_tells_resumes_or_leaves_an_overdue_run(
    status: RunStatus, suspension: Suspension | None, step: SweepStep
) -> None:
    assert sweep_step(status, suspension, LEASE_MS) == step


def test_a_resumed_run_is_postponed_by_the_lease_it_is_given() -> None:
    assert sweep_step(RunStatus.MODEL, None, 1234).postpone_ms == 1234


DEAD_HOLDER = [
    # (status, due_at_ms, step): the process holding the run's lease is dead
    (RunStatus.QUEUED, None, SweepStep(SweepKind.RESUME)),
    (RunStatus.MODEL, NOW_MS + 60_000, SweepStep(SweepKind.RESUME)),
    (RunStatus.TOOLS, NOW_MS - 1, SweepStep(SweepKind.RESUME)),
    (RunStatus.NEEDS_USER_INPUT, NOW_MS, EXPIRE),
    (RunStatus.BLOCKED, NOW_MS - 1, EXPIRE),
    (RunStatus.AWAITING_APPROVAL, NOW_MS - 60_000, EXPIRE),
    (RunStatus.NEEDS_USER_INPUT, NOW_MS + 1, LEAVE),
    (RunStatus.AWAITING_APPROVAL, None, LEAVE),
    (RunStatus.WAITING, NOW_MS - 1, LEAVE),
    (RunStatus.COMPLETED, NOW_MS - 1, LEAVE),
    (RunStatus.CANCELLED, None, LEAVE),
    (RunStatus.NEEDS_RECONCILIATION, NOW_MS - 1, LEAVE),
    (RunStatus.STALLED, NOW_MS - 1, LEAVE),
    (RunStatus.DEAD_LETTERED, NOW_MS - 1, LEAVE),
]


@pytest.mark.parametrize(("status", "due_at_ms", "step"), DEAD_HOLDER, ids=str)
def test_a_dead_holders_run_is_resumed_at_once_expired_when_due_or_left(
    status: RunStatus, due_at_ms: int | None, step: SweepStep
) -> None:
    assert dead_holder_step(status, due_at_ms, NOW_MS) == step


@pytest.mark.parametrize("status", list(RunStatus), ids=str)
def test_only_a_run_waiting_for_a_person_is_ever_due_to_expire(status: RunStatus) -> None:
    waits_for_a_person = status.is_suspended and status != RunStatus.WAITING
    assert expiry_is_due(status, NOW_MS - 1, NOW_MS) == waits_for_a_person
    assert expiry_is_due(status, NOW_MS, NOW_MS) == waits_for_a_person
    assert not expiry_is_due(status, NOW_MS + 1, NOW_MS)
    assert not expiry_is_due(status, None, NOW_MS)


LEAD_MS = 5_000


@pytest.mark.parametrize(
    ("ending", "kind", "data", "due_ms"),
    [
        # A throttled run is overdue one lease after its countdown, however long that is
        (None, "run.throttled", {"until_ms": NOW_MS + 1_000}, NOW_MS + 1_000 + LEASE_MS),
        (None, "run.throttled", {"until_ms": NOW_MS + 30_000}, NOW_MS + 30_000 + LEASE_MS),
        (None, "run.throttled", {"until_ms": NOW_MS - 500}, NOW_MS - 500 + LEASE_MS),
        # Any other write leaves a live run overdue one lease from now
        (None, "model.requested", {"turn": 1}, NOW_MS + LEASE_MS),
        (None, "model.failed", {"turn": 1, "error": "x", "timeout": True}, NOW_MS + LEASE_MS),
        # A throttle the run stalled on is not due: a stall has no countdown to wait out
        ("run.stalled", "run.stalled", {"reason": "held"}, None),
    ],
)
def test_a_throttled_run_is_due_once_its_countdown_ran_out_and_any_other_as_its_state_says(
    tmp_path: Path, ending: str | None, kind: str, data: dict[str, Any], due_ms: int | None
) -> None:
    state = started(agent(tmp_path))
    if ending is not None:
        state = step(state, ending, **data)
    last = Event(seq=state.seq, type=kind, at_ms=NOW_MS, data=data)

    assert due_after_ms(state, last, NOW_MS, LEASE_MS, LEAD_MS) == due_ms
