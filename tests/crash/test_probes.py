"""A real worker dies with a probed call's outcome unknown; the probe decides, per call.

Like tests/crash/test_failpoints.py (and on its rig): a ``celery -A worker
worker`` (solo pool, a broker database of its own) runs the turn and dies —
at a failpoint (``os._exit(137)``), or SIGKILLed by this test while one of three
parallel calls hangs — and the sweeper hands the run to a healthy worker. The
tools (tests/probed_tools.py) log each effect with the call's idempotency key,
so "at most once" is counted per call, across both workers.

For each answer a probe can give: ``ran`` records the effect's result without
running it again, ``not_run`` runs it now (once), and ``unknown``, a probe that
raises and one that hangs past ``probe_timeout_s`` park the run naming the call.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from runtime.models import Event, RunStatus
from runtime.probes import idempotency_key
from tasks.start import create_run
from tests.crash.test_failpoints import (
    DYING_BROKER_DB,
    Rig,
    duplicated_transitions,
    rig,
    settle,
)
from tests.helpers import call, turn, write_agent

__all__ = ["rig"]  # the module-scoped fixture, shared with the turn failpoints

TOOLS = [
    "tests.probed_tools:effect",
    "tests.probed_tools:effect_unknown",
    "tests.probed_tools:effect_probe_raises",
    "tests.probed_tools:effect_probe_hangs",
]


def effects(rig: Rig) -> Counter[str]:
    """Effects so far, by idempotency key."""
    path = Path(str(rig.ledger) + ".effects")
    lines = path.read_text().splitlines() if path.exists() else []
    return Counter(line.split(" ", 1)[0] for line in lines)


def probes(events: list[Event]) -> dict[str, str]:
    return {e.data["call_id"]: e.data["answer"] for e in events if e.type == "tool.probed"}


# tool, failpoint, what the probe answers, how the run ends, the call's effects in the end
ONE_CALL = [
    ("effect", "tool.completed@1", "ran", RunStatus.COMPLETED, 1),
    ("effect", "tool.requested@1", "not_run", RunStatus.COMPLETED, 1),
    ("effect_unknown", "tool.completed@1", "unknown", RunStatus.NEEDS_RECONCILIATION, 1),
    ("effect_unknown", "tool.requested@1", "unknown", RunStatus.NEEDS_RECONCILIATION, 0),
    ("effect_probe_raises", "tool.completed@1", "failed", RunStatus.NEEDS_RECONCILIATION, 1),
    ("effect_probe_hangs", "tool.completed@1", "timed_out", RunStatus.NEEDS_RECONCILIATION, 1),
]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("tool", "point", "answer", "status", "count"),
    ONE_CALL,
    ids=[f"{t}-{p}" for t, p, *_ in ONE_CALL],
)
def test_a_probe_decides_a_call_a_dead_worker_left_unknown(
    rig: Rig, tmp_path: Path, tool: str, point: str, answer: str, status: RunStatus, count: int
) -> None:
    # Given a worker armed to die with the call requested (or run) but its outcome unrecorded
    agent = write_agent(
        tmp_path,
        [turn("once", call(tool, label=f"{tool}-{point}")), turn("Done.")],
        tools=TOOLS,
        extra="probe_timeout_s = 1",
    )
    dying = rig.worker(f"probe-{tool}-{point}", DYING_BROKER_DB, RATCHET_FAILPOINT=point)
    try:
        run_id = create_run(rig.ctx, agent, "go").run_id
        rig.dying_app.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
        # When it dies there and the sweeper hands the run to the healthy worker
        record = settle(rig, run_id, dying, timeout_s=45)
        assert dying.wait(10) == 137, dying.log()[-2000:]
    finally:
        dying.kill()
    assert f"failpoint {point.split('@')[0]} hit" in dying.log()
    events = rig.ctx.runs.events(run_id)
    key = idempotency_key(run_id, 1, "call_1_1")
    # Then the healthy worker asked the probe, once, and the answer decided the call
    assert probes(events) == {"call_1_1": answer}
    assert record.status == status, (record.error, [e.type for e in events])
    # And the effect happened at most once, whichever worker ran it
    assert effects(rig)[key] == count
    if status == RunStatus.COMPLETED:
        assert record.output == "Done."
        answered = [e.data for e in events if e.type in ("tool.completed", "tool.probed")]
        if answer == "ran":
            # Recorded from the probe's answer: the effect was not run a second time
            assert answered == [{"call_id": "call_1_1", "name": tool, "answer": "ran",
                                 "result": {"done": f"{tool}-{point}", "found_by": "probe"}}]  # fmt: skip
        else:
            assert [d.get("answer", "completed") for d in answered] == ["not_run", "completed"]
    else:
        parked = [e.data for e in events if e.type == "run.parked"]
        assert [(p["call_id"], p["probe"]) for p in parked] == [("call_1_1", answer)]
        assert "(call call_1_1)" in (record.error or "")
        assert f"ratchet runs reconcile {run_id} call_1_1" in (record.error or "")
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert duplicated_transitions(events) == []


def wait_for(rig: Rig, run_id: str, completed: int, dying_log: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(e.type == "tool.completed" for e in rig.ctx.runs.events(run_id)) < completed:
        if time.monotonic() > deadline:
            raise AssertionError(dying_log.read_text()[-3000:])
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("third", ["effect", "effect_unknown"])
def test_a_worker_killed_with_two_of_three_parallel_calls_finished(
    rig: Rig, tmp_path: Path, third: str
) -> None:
    # Given three parallel calls, the third of which hangs (before its effect) on this worker
    label = f"parallel-{third}"
    agent = write_agent(
        tmp_path,
        [
            turn("three at once", call("effect", label=f"{label}-a"),
                 call("effect", label=f"{label}-b"), call(third, label=f"{label}-c")),
            turn("Done."),
        ],
        tools=TOOLS,
    )  # fmt: skip
    dying = rig.worker(f"parallel-{third}", DYING_BROKER_DB, RATCHET_TEST_HANG_LABEL=f"{label}-c")
    try:
        run_id = create_run(rig.ctx, agent, "go").run_id
        rig.dying_app.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
        # When the first two have finished (journaled and checkpointed), the worker is SIGKILLed
        wait_for(rig, run_id, 2, dying.log_path)
        dying.kill()
        record = settle(rig, run_id, dying, timeout_s=45)
    finally:
        dying.kill()
    events = rig.ctx.runs.events(run_id)
    keys = [idempotency_key(run_id, 1, f"call_1_{i}") for i in (1, 2, 3)]
    done = effects(rig)
    # Then the finished calls never ran again: each effect once, and no probe asked about them
    assert done[keys[0]] == 1 and done[keys[1]] == 1
    outcomes = [e.data["call_id"] for e in events if e.type == "tool.completed"]
    assert sorted(outcomes[:2]) == ["call_1_1", "call_1_2"]
    if third == "effect":
        # And the unknown one was probed, found not run, and run once: the run completes
        assert probes(events) == {"call_1_3": "not_run"}
        assert record.status == RunStatus.COMPLETED, record.error
        assert outcomes[2:] == ["call_1_3"] and done[keys[2]] == 1
    else:
        # And the one whose probe cannot tell parks the run, naming exactly that call
        assert probes(events) == {"call_1_3": "unknown"}
        assert record.status == RunStatus.NEEDS_RECONCILIATION
        parked = [e.data for e in events if e.type == "run.parked"]
        assert [(p["call_id"], p["tool"]) for p in parked] == [("call_1_3", "effect_unknown")]
        assert "(call call_1_3)" in (record.error or "") and done[keys[2]] == 0
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert duplicated_transitions(events) == []
