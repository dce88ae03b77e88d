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
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runtime.models import RunState, Suspension, Usage

RUN_CHILD = "run_child"
MAX_INPUT_BYTES = 8192


class ChildArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")
    agent: str = Field(description="The name of one of this agent's child agents.")
    input: str = Field(description="What the child agent should do.")


def child_run_id(parent_id: str, call_id: str) -> str:
    """The child's id: the same on every attempt at the call, valid as a run id."""
    digest = hashlib.sha256(f"{parent_id}\0{call_id}".encode()).hexdigest()[:40]
    return f"child-{digest}"


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
