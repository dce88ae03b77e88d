"""Child runs on Celery's in-process worker with Redis stores: outputs, usage, cancel."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from runtime.children import child_run_id
from runtime.fsm import rebuild
from runtime.models import RunState, RunStatus
from tasks.messages import enqueue_turn
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import wait_for as shared_wait_for
from worker.api import Ratchet
from worker.render import lineage_lines

wait_for = partial(shared_wait_for, timeout_s=30)

pytestmark = pytest.mark.timeout(60)


def state_of(ratchet: Ratchet, run_id: str) -> RunState:
    state = rebuild(ratchet.events(run_id))
    assert state is not None
    return state


def parent_agent(directory: Path, parent_turns: list[dict[str, object]]) -> Path:
    write_agent(
        directory,
        [turn("Looking A1.", call("lookup_order", order_id="A1"), tokens=(100, 20)),
         turn("A1 is a kettle.", tokens=(50, 10))],
        name="kettle",
    )  # fmt: skip
    write_agent(directory, [turn("B2 is a toaster.", tokens=(7, 3))], name="toaster")
    write_agent(
        directory, [turn("Which?", call("request_user_input", prompt="Which?"))], name="asker"
    )
    return write_agent(
        directory,
        parent_turns,
        name="parent",
        tools=["run_child", "request_user_input"],
        extra='[children]\nkettle = "kettle.toml"\ntoaster = "toaster.toml"\nasker = "asker.toml"',
    )


def test_a_parent_with_two_children_completes_with_their_outputs(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    agent = parent_agent(
        tmp_path,
        [
            turn("Asking both.", call("run_child", agent="kettle", input="Look up A1"),
                 call("run_child", agent="toaster", input="Look up B2"), tokens=(10, 5)),
            turn("A1 is a kettle and B2 a toaster.", tokens=(10, 5)),
        ],
    )  # fmt: skip
    # Given a parent whose model starts two children in one response
    run_id = ratchet.start(agent, "What are A1 and B2?")
    record = ratchet.wait(run_id, timeout_s=40)
    # Then it completes, having read each child's output as its call's result, in order
    assert record.status == RunStatus.COMPLETED, record.error
    results = [
        json.loads(m.content) for m in state_of(ratchet, run_id).transcript if m.role == "tool"
    ]
    assert [(r["agent"], r["status"], r["output"]) for r in results] == [
        ("kettle", "completed", "A1 is a kettle."),
        ("toaster", "completed", "B2 is a toaster."),
    ]
    # and each child is the one its call fixed, linked back to the parent, and told
    state = state_of(ratchet, run_id)
    calls = [m.tool_call_id for m in state.transcript if m.role == "tool"]
    for call_id, result in zip(calls, results, strict=True):
        assert result["run_id"] == child_run_id(run_id, str(call_id))
        child = state_of(ratchet, result["run_id"])
        assert child.parent == run_id and child.parent_told
    # and `runs show` links both ways
    assert ratchet.lineage(run_id)["children"] == [r["run_id"] for r in results]
    assert all(ratchet.lineage(r["run_id"])["parent"] == run_id for r in results)
    shown = "\n".join(lineage_lines(ratchet.lineage(results[0]["run_id"])))
    assert shown == f"parent     {run_id}"
    # and the children's tokens count in the parent's usage (two turns of 15 each, plus 180 + 10)
    assert record.usage.total_tokens == 15 + 15 + 180 + 10


def test_cancelling_a_parent_cancels_the_child_it_waits_for(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    agent = parent_agent(
        tmp_path, [turn("Asking.", call("run_child", agent="asker", input="Ask which"))]
    )
    state = create_run(ratchet.ctx, agent, "go")
    enqueue_turn(run_id=state.run_id, expected_seq=state.seq)
    child = child_run_id(state.run_id, "call_1_1")
    wait_for(
        "the child asks its question",
        lambda: (
            (r := ratchet.ctx.runs.get(child)) is not None
            and r.status == RunStatus.NEEDS_USER_INPUT
        ),
    )
    wait_for("the parent waits", lambda: ratchet.get(state.run_id).status == RunStatus.WAITING)
    ratchet.cancel(state.run_id, "not needed")
    assert ratchet.get(child).status == RunStatus.CANCELLED
    assert ratchet.get(child).error == f"its parent run {state.run_id} was cancelled"
    wait_for("the child is marked told", lambda: state_of(ratchet, child).parent_told)
    assert ratchet.get(state.run_id).status == RunStatus.CANCELLED


def test_an_unknown_child_is_an_error_the_model_reads(ratchet: Ratchet, tmp_path: Path) -> None:
    agent = parent_agent(
        tmp_path,
        [turn("Asking.", call("run_child", agent="nobody", input="x")), turn("No such child.")],
    )
    run_id = ratchet.start(agent, "go")
    record = ratchet.wait(run_id, timeout_s=30)
    assert record.status == RunStatus.COMPLETED
    failed = [e for e in ratchet.events(run_id) if e.type == "tool.failed"]
    assert "one of this agent's children: asker, kettle, toaster" in failed[0].data["error"]
