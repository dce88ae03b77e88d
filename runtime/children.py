"""Child runs: the built-in ``run_child`` tool starts another agent and waits for it. Pure.

An agent names the agents it may start, in its file::

    tools = ["run_child"]
    [children]
    refunds = "refund-desk.toml"       # relative to this agent file

The model calls ``run_child(agent="refunds", input="…")``. The turn starts the
child run and suspends the parent as ``waiting`` until the child ends; the
child's output (or its failure) is the call's result. The rules:

- **Never two children for one call.** The child's id is a function of the
  parent's id and the call's id (:func:`child_run_id`), and starting it is a
  create-if-absent: a turn that crashed anywhere in the child-starting step and
  is taken again finds the child it made and goes on waiting for it.
- **The parent is told exactly once, even if a worker dies.** A child that
  ends while its ``parent_told`` is false stays in the run store's due index
  (its end and that entry are one write): the finishing turn tells the parent
  at once (``ratchet.deliver``), and the sweeper does so for any child a crash
  left untold. The parent records ``run.woken`` (``by: child``) only while it
  still waits for that child; then the child records ``run.parent_told``.
- **Budgets.** The child has its own, from its agent file. The child's tokens
  count toward the parent's ``max_total_tokens`` when the parent is told (its
  usage grows by the child's input and output tokens); the child's turns and
  tool calls do not count as the parent's.
- **Cancel.** Cancelling a parent cancels the child it waits for.
- A parent starts its children one at a time: calls a response asks for run
  in order, so two ``run_child`` calls run the second child after the first.
- **Bounded trees.** A root and its descendants are one run tree, with a
  depth limit and a size limit fixed when the root is created (its agent's
  ``max_child_depth`` and ``max_tree_runs``, else the fleet's defaults) and
  carried in each run's ``run.created`` as its :class:`~runtime.models.Tree`.
  A ``run_child`` call past either is refused as a tool error the model reads
  (:func:`tree_problem`); the run goes on. The size is counted without a
  store: because a parent waits for one child at a time, it hands that child
  its whole unspent **share** of the tree, and the child, when it ends, tells
  back how much of it its own subtree used (:func:`runs_used`) — so the runs of
  a tree can never add up past the root's limit. A child that ended while a
  child of its own may still exist counts as its whole share.
- **Reserved ids.** Ids of the child shape (:func:`is_child_run_id`) are for
  children only: a start or fork from outside that names one is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runtime.errors import RunRefused
from runtime.models import RunState, RunStatus, Suspension, Tree, Usage

RUN_CHILD = "run_child"
MAX_INPUT_BYTES = 8192
CHILD_ID_PREFIX = "child-"
_CHILD_ID = re.compile(r"child-[0-9a-f]{40}")
DEFAULT_MAX_CHILD_DEPTH = 5
"""How deep a run tree may grow when neither its root's agent nor the fleet says (root: 0)."""
DEFAULT_MAX_TREE_RUNS = 100
"""How many runs a run tree may hold when neither its root's agent nor the fleet says."""
MAX_CHILD_DEPTH = 1000
MAX_TREE_RUNS = 100_000


class ChildArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")
    agent: str = Field(description="The name of one of this agent's child agents.")
    input: str = Field(description="What the child agent should do.")


def child_run_id(parent_id: str, call_id: str) -> str:
    """The child's id: the same on every attempt at the call, valid as a run id."""
    digest = hashlib.sha256(f"{parent_id}\0{call_id}".encode()).hexdigest()[:40]
    return f"{CHILD_ID_PREFIX}{digest}"


def is_child_run_id(run_id: str) -> bool:
    """Whether ``run_id`` has the shape :func:`child_run_id` gives: reserved for children."""
    return _CHILD_ID.fullmatch(run_id) is not None


def squatted_child(child_id: str) -> str:
    """The ``run_child`` call's error when its child's id is held by a run it did not make."""
    return (
        f"`run_child` refused: the child's id {child_id} is taken by a run this call did not "
        "start; nothing was started — call `run_child` again for a new child"
    )


def root_tree(max_depth: int, max_runs: int) -> dict[str, Any]:
    """The ``tree`` of a root's ``run.created``: the limits its whole tree keeps."""
    return {"depth": 0, "max_depth": max_depth, "max_runs": max_runs, "share": max_runs}


def tree_of(state: RunState) -> Tree:
    """The run's place in its tree; a run recorded before trees were bounded gets the defaults."""
    if state.tree is not None:
        return state.tree
    return Tree(
        depth=int(state.parent is not None),
        max_depth=DEFAULT_MAX_CHILD_DEPTH,
        max_runs=DEFAULT_MAX_TREE_RUNS,
        share=DEFAULT_MAX_TREE_RUNS,
    )


def tree_problem(state: RunState) -> str | None:
    """Why the run may not start another child (its tree's limits), or None; told to the model."""
    tree = tree_of(state)
    if tree.depth >= tree.max_depth:
        return (
            f"`run_child` refused: this run is at depth {tree.depth} of its run tree, the "
            f"deepest the tree allows (max_child_depth = {tree.max_depth}); do the work here"
        )
    if tree.runs >= tree.share:
        return (
            f"`run_child` refused: its run tree has no room for another run "
            f"(max_tree_runs = {tree.max_runs}); do the work here"
        )
    return None


def child_tree(parent: RunState) -> dict[str, Any]:
    """The ``tree`` of a child's ``run.created``: one deeper, the parent's unspent share."""
    tree = tree_of(parent)
    return {
        "depth": tree.depth + 1,
        "max_depth": tree.max_depth,
        "max_runs": tree.max_runs,
        "share": tree.share - tree.runs,
    }


def runs_used(child: RunState) -> int:
    """The runs the ended ``child``'s subtree used, for its parent's count: its whole share
    if a child of its own may still exist (a ``run_child`` call without an outcome)."""
    tree = tree_of(child)
    if any(call.name == RUN_CHILD for call in child.pending):
        return tree.share
    return tree.runs


def with_child_runs(tree: Tree | None, data: dict[str, Any]) -> Tree | None:
    """The parent's tree after a child told back how many runs it used: at least 1, at most
    the share it was handed. None stays None: a run recorded before trees were bounded
    folds as it always did (its golden log holds it)."""
    if tree is None:
        return None
    used = data.get("tree_runs", 1)
    used = used if isinstance(used, int) and not isinstance(used, bool) else 1
    spare = max(0, tree.share - tree.runs)
    return tree.model_copy(update={"runs": tree.runs + min(max(1, used), spare)})


def child_problem(arguments: dict[str, Any], children: dict[str, str]) -> str | None:
    """Why these ``run_child`` arguments cannot start a child, or None; told to the model."""
    names = ", ".join(sorted(children)) or "none"
    agent, text = arguments.get("agent"), arguments.get("input")
    if not isinstance(agent, str) or agent not in children:
        return f"`run_child` needs `agent`, one of this agent's children: {names}"
    if not isinstance(text, str) or not text.strip():
        return "`run_child` needs `input`: what the child agent should do, as text"
    if len(text.encode()) > MAX_INPUT_BYTES:
        return f"`run_child`'s `input` is over {MAX_INPUT_BYTES} bytes"
    return None


def awaiting_delivery(state: RunState) -> bool:
    """A child that ended and whose parent has not been told yet."""
    return state.parent is not None and state.status.is_terminal and not state.parent_told


def possible_children(state: RunState) -> list[str]:
    """The ids of the children ``state`` may have made that have not ended for it: those of
    its ``run_child`` calls without an outcome (a parent makes them one at a time)."""
    return [child_run_id(state.run_id, c.id) for c in state.pending if c.name == RUN_CHILD]


def cancel_reaches(
    run_id: str, status: RunStatus, suspension: Suspension | None
) -> list[str] | None:
    """The children a cancel of ``run_id`` goes on to, from its record alone; ``None``: they
    are its :func:`possible_children`, read from its state.

    Children run one at a time, so a suspended run's only live child is the one its
    suspension waits for; a completed run answered, so every call it made has its outcome.
    Any other run (live, parked, failed or cancelled: a cancel cut short by a dead process
    is finished by the next) may have made a child its state names.
    """
    if status.is_suspended:
        if suspension is None or suspension.tool != RUN_CHILD:
            return []
        return [child_run_id(run_id, suspension.call_id)]
    if status == RunStatus.COMPLETED:
        return []
    return None


class CancelCascade:
    """The runs a cancel reaches below its run, breadth first, each once: the shell cancels
    the run :meth:`next` names and reports the children it found under it (:meth:`reached`).

    A queue, not a recursion, so a tree's depth costs no stack. The walk goes on through
    runs that had ended already, and counts only the runs this cancel ended: a cancel that
    ended nothing, its run's or any below, is refused (:meth:`refusal`).
    """

    def __init__(self, run_id: str, children: list[str], ended: bool) -> None:
        self.run_id = run_id
        self._queue = deque((child, run_id) for child in children)
        self._seen = {run_id}
        self.ended = int(ended)
        """How many runs this cancel ended, its own included."""

    def next(self) -> tuple[str, str] | None:
        """The next run to cancel and its parent; None when the walk is done."""
        while self._queue:
            child, parent = self._queue.popleft()
            if child in self._seen:
                continue  # ids are hashes of their parent's: only a forged one could loop
            self._seen.add(child)
            return child, parent
        return None

    def reached(self, run_id: str, children: list[str], ended: bool) -> None:
        """``run_id`` was cancelled (``ended``: by this cancel) and may have ``children``."""
        self.ended += int(ended)
        self._queue.extend((child, run_id) for child in children)

    def refusal(self, status: RunStatus) -> RunRefused | None:
        """The cancel's refusal when its run (in ``status``) and every run below had ended
        already; None when it ended one."""
        if self.ended:
            return None
        return RunRefused(
            self.run_id, status.value, "it has already finished; there is nothing to cancel"
        )


def parent_cancelled_reason(parent_id: str) -> str:
    """The reason a child's ``run.cancelled`` gives when its parent's cancel reached it."""
    return f"its parent run {parent_id} was cancelled"


def waits_for(parent: RunState, child_id: str) -> bool:
    """Whether ``parent`` is suspended on the ``run_child`` call that started ``child_id``."""
    suspension = parent.suspension
    return (
        suspension is not None
        and suspension.tool == RUN_CHILD
        and child_run_id(parent.run_id, suspension.call_id) == child_id
    )


def woken_by_child(child: RunState) -> dict[str, Any]:
    """The ``run.woken`` data that tells the parent how ``child`` ended."""
    data: dict[str, Any] = {"by": "child", "child": child.run_id, "status": child.status.value}
    if child.output is not None:
        data["output"] = child.output
    if child.error is not None:
        data["error"] = child.error
    u = child.usage
    data["usage"] = {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens}
    data["tree_runs"] = runs_used(child)
    return data


def child_result(suspension: Suspension, data: dict[str, Any]) -> tuple[bool, str]:
    """(ok, content) of the ``run_child`` call, from ``run.woken``'s data."""
    ok = data.get("status") == "completed"
    content = {
        "type": "child_run",
        "run_id": data.get("child"),
        "agent": suspension.arguments.get("agent"),
        "status": data.get("status"),
        "output" if ok else "error": data.get("output") if ok else data.get("error"),
    }
    return ok, json.dumps(content, sort_keys=True)


def with_child_usage(usage: Usage, data: dict[str, Any]) -> Usage:
    """The parent's usage after its child's tokens are counted (the budget rule above)."""
    spent = data.get("usage") or {}
    add_in, add_out = int(spent.get("input_tokens", 0)), int(spent.get("output_tokens", 0))
    return usage.model_copy(
        update={
            "input_tokens": usage.input_tokens + add_in,
            "output_tokens": usage.output_tokens + add_out,
            "total_tokens": usage.total_tokens + add_in + add_out,
        }
    )
