"""A worker dies at every point of a parent's child-starting call: never a second child.

Like tests/crash/test_failpoints.py: the dying ``celery -A worker worker`` (solo
pool, a broker database of its own) runs the parent's turn with
``RATCHET_FAILPOINT`` armed and ``os._exit``s there; this test sweeps as beat
would, handing resumes, wake-ups and parent notices to a healthy worker on
another broker database. The parent starts two children in one response.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.children import child_run_id
from runtime.fsm import rebuild
from runtime.models import RunStatus
from tasks.recovery import sweep_orphans
from tasks.start import create_run
from tests.crash.test_failpoints import DYING_BROKER_DB, HEALTHY_BROKER_DB, Rig, rig
from tests.helpers import call, turn, write_agent

__all__ = ["rig"]  # the module-scoped fixture, shared with the turn failpoints

POINTS = [
    "model.response.checkpointed@1",
    "child.created@1",
    "child.enqueued@1",
    "snapshot.before_save@1",
    "snapshot.after_save@1",
]


def family(directory: Path) -> Path:
    write_agent(directory, [turn("A1 is a kettle.")], name="kettle")
    write_agent(directory, [turn("B2 is a toaster.")], name="toaster")
    return write_agent(
        directory,
        [
            turn("Asking both.", call("run_child", agent="kettle", input="Look up A1"),
                 call("run_child", agent="toaster", input="Look up B2")),
            turn("Both known."),
        ],
        name="parent",
        tools=["run_child"],
        extra='[children]\nkettle = "kettle.toml"\ntoaster = "toaster.toml"',
    )  # fmt: skip


def settle(rig: Rig, run_id: str, timeout_s: float = 45) -> None:
    """Sweep as beat would, onto the healthy worker, until the parent has finished."""
    healthy = rig.healthy_app
    deadline = time.monotonic() + timeout_s
    while (record := rig.ctx.runs.get(run_id)) is None or not record.status.is_terminal:
        sweep_orphans(
            rig.ctx,
            lambda run, seq: healthy.send_task(
                "ratchet.resume", (run, "sweeper", seq), queue="ratchet.turns"
            ),
            wake=lambda run, rec: healthy.send_task("ratchet.wake", (run, rec.last_seq),
                                                    queue="ratchet.control"),
            tell=lambda run: healthy.send_task("ratchet.deliver", (run,), queue="ratchet.control"),
        )  # fmt: skip
        assert time.monotonic() < deadline, rig.healthy.log()[-3000:]
        time.sleep(0.1)


@pytest.fixture
def parent_agent(tmp_path: Path) -> Iterator[Path]:
    yield family(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("point", POINTS)
def test_a_worker_dying_while_starting_children_never_starts_one_twice(
    rig: Rig, parent_agent: Path, point: str
) -> None:
    # Given a worker armed to die at the point, and a parent run it takes
    dying = rig.worker(f"dying-child-{point}", DYING_BROKER_DB, RATCHET_FAILPOINT=point)
    try:
        run_id = create_run(rig.ctx, parent_agent, "What are A1 and B2?").run_id
        rig.dying_app.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
        assert dying.wait(30) == 137, dying.log()[-2000:]
        # When the sweeper hands everything to the healthy worker
        settle(rig, run_id)
    finally:
        dying.kill()
    # Then the parent completed with both children's outputs
    events = rig.ctx.runs.events(run_id)
    state = rebuild(events)
    assert state is not None and state.status == RunStatus.COMPLETED, state
    results = [json.loads(m.content) for m in state.transcript if m.role == "tool"]
    assert [r.get("output") for r in results] == ["A1 is a kettle.", "B2 is a toaster."], results
    # and each call has exactly one child: the one its id fixes, created once
    expected = {child_run_id(run_id, "call_1_1"), child_run_id(run_id, "call_1_2")}
    assert {r["run_id"] for r in results} == expected
    for child in expected:
        created = [e for e in rig.ctx.runs.events(child) if e.type == "run.created"]
        assert len(created) == 1 and created[0].data["parent"]["run_id"] == run_id
    woken = [e.data["child"] for e in events if e.type == "run.woken"]
    assert sorted(woken) == sorted(expected)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert HEALTHY_BROKER_DB != DYING_BROKER_DB
