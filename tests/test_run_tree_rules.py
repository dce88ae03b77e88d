"""The run tree's limits in the pure core (runtime/children.py): no store, no worker.

States are folded from events with :func:`runtime.fsm.apply`; :func:`runtime.fsm.decide`
says whether a ``run_child`` call starts a child or is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.agent import Agent
from runtime.children import (
    child_run_id,
    child_tree,
    is_child_run_id,
    root_tree,
    runs_used,
    woken_by_child,
)
from runtime.fsm import RefuseCall, StartChild, apply, created_event, decide
from runtime.models import Event, RunState, RunStatus
from runtime_io.agent_files import load_agent
from store.snapshots.format import decode, encode
from tests.helpers import write_agent

T0_MS = 1_700_000_000_000


def looper(tmp_path: Path) -> Agent:
    return load_agent(
        write_agent(
            tmp_path, [], name="looper", tools=["run_child"],
            extra='[children]\nme = "looper.toml"',
        )
    )  # fmt: skip


def step(state: RunState | None, type_: str, **data: Any) -> RunState:
    seq = 1 if state is None else state.seq + 1
    return apply(state, Event(seq=seq, type=type_, at_ms=T0_MS + seq, data=data))


def asking_for_a_child(a: Agent, tree: dict[str, Any], run_id: str = "run-1") -> RunState:
    state = step(None, "run.created", **created_event(run_id, a, "go", T0_MS, tree=tree))
    state = step(state, "model.requested", turn=1)
    call = {"id": "call_1_0", "name": "run_child", "arguments": {"agent": "me", "input": "go"}}
    return step(state, "model.responded", content="", tool_calls=[call])


def test_a_child_one_level_too_deep_is_refused_naming_the_bound(tmp_path: Path) -> None:
    a = looper(tmp_path)
    at_bound = {**root_tree(2, 100), "depth": 2}
    refused = decide(asking_for_a_child(a, at_bound), a, T0_MS)
    assert isinstance(refused, RefuseCall)
    assert "depth 2" in refused.error and "max_child_depth = 2" in refused.error
    above = {**root_tree(3, 100), "depth": 2}
    assert isinstance(decide(asking_for_a_child(a, above), a, T0_MS), StartChild)


def test_a_child_is_handed_the_parents_unspent_share_and_refused_when_none_is_left(
    tmp_path: Path,
) -> None:
    a = looper(tmp_path)
    parent = asking_for_a_child(a, root_tree(5, 3))
    assert child_tree(parent) == {"depth": 1, "max_depth": 5, "max_runs": 3, "share": 2}
    # When the child tells back that its subtree used its whole share (2 runs)
    parent = step(parent, "run.suspended", reason="waiting", call_id="call_1_0",
                  tool="run_child", arguments={"agent": "me", "input": "go"}, prompt="")  # fmt: skip
    parent = step(parent, "run.woken", by="child", child="c", status="completed", output="ok",
                  usage={"input_tokens": 1, "output_tokens": 1}, tree_runs=2)  # fmt: skip
    assert parent.tree is not None and parent.tree.runs == 3
    # Then the parent's next run_child call is refused: the tree is full
    parent = step(parent, "model.requested", turn=2)
    call = {"id": "call_2_0", "name": "run_child", "arguments": {"agent": "me", "input": "go"}}
    parent = step(parent, "model.responded", content="", tool_calls=[call])
    refused = decide(parent, a, T0_MS)
    assert isinstance(refused, RefuseCall) and "max_tree_runs = 3" in refused.error


def test_a_child_that_reports_more_than_its_share_is_counted_at_its_share(
    tmp_path: Path,
) -> None:
    a = looper(tmp_path)
    parent = asking_for_a_child(a, root_tree(5, 10))
    parent = step(parent, "run.suspended", reason="waiting", call_id="call_1_0",
                  tool="run_child", arguments={"agent": "me", "input": "go"}, prompt="")  # fmt: skip
    parent = step(parent, "run.woken", by="child", child="c", status="completed",
                  tree_runs=10_000)  # fmt: skip
    assert parent.tree is not None and parent.tree.runs == 10


def test_a_child_that_ended_with_a_child_call_open_counts_as_its_whole_share(
    tmp_path: Path,
) -> None:
    a = looper(tmp_path)
    child = asking_for_a_child(a, {**root_tree(5, 10), "depth": 1, "share": 7}, "child-x")
    cancelled = step(child, "run.cancelled", reason="stop")
    assert cancelled.status == RunStatus.CANCELLED
    assert runs_used(cancelled) == 7 == woken_by_child(cancelled)["tree_runs"]


def test_the_tree_survives_a_snapshot_and_a_run_outside_trees_encodes_without_it(
    tmp_path: Path,
) -> None:
    a = looper(tmp_path)
    state = asking_for_a_child(a, root_tree(4, 9))
    assert decode(encode(state), "test") == state
    plain = step(None, "run.created", **created_event("run-2", a, "go", T0_MS))
    assert plain.tree is None and b'"tree"' not in encode(plain)


def test_only_the_exact_child_shape_is_reserved() -> None:
    assert is_child_run_id(child_run_id("run-1", "call_1_0"))
    assert not is_child_run_id("child-1")
    assert not is_child_run_id("child-" + "A" * 40)
    assert not is_child_run_id("my-child-" + "a" * 40)
