"""Building blocks for tests: agents written on the fly, memory contexts, a driver."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from runtime.actions import Advanced
from store.runs.memory import MemoryRunStore
from store.runs.sqlite import SqliteRunStore
from store.snapshots.memory import MemorySnapshotStore
from store.snapshots.sqlite import SqliteSnapshotStore
from tasks.context import Context, set_context
from tasks.settings import Settings
from tasks.turn import advance

REFUND_TOOLS = [
    "examples.refunds:lookup_order",
    "examples.refunds:refund_policy",
    "examples.refunds:issue_refund",
    "request_user_input",
    "blocked",
]


def write_agent(
    directory: Path,
    turns: list[dict[str, Any]],
    *,
    name: str = "test-agent",
    tools: list[str] | None = None,
    budgets: dict[str, Any] | None = None,
    require_approval: list[str] | None = None,
    extra: str = "",
) -> Path:
    """Write an agent TOML and its script into ``directory``; return the TOML's path."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / f"{name}.script.json"
    script.write_text(json.dumps({"turns": turns}, indent=1))
    lines = [
        f'name = "{name}"',
        'model = "scripted"',
        f'script = "{script.name}"',
        'system = "You are a test agent."',
        f"tools = {json.dumps(REFUND_TOOLS if tools is None else tools)}",
        extra,
        "[budgets]",
    ]
    for key, value in (budgets or {}).items():
        lines.append(f"{key} = {json.dumps(value)}")
    lines.append("[policy]")
    lines.append(f"require_approval = {json.dumps(require_approval or [])}")
    path = directory / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def turn(content: str, *calls: dict[str, Any], tokens: tuple[int, int] = (10, 5)) -> dict[str, Any]:
    return {
        "content": content,
        "tool_calls": list(calls),
        "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]},
    }


def paced_lookups(lookups: int, sleep_s: float = 0.4) -> list[dict[str, Any]]:
    """A script of ``lookups`` turns that each look an order up (A0, A1, …), then one that
    answers ``Done.``, every turn ``sleep_s`` long: a run under way long enough to cut off."""
    looks = [
        {**turn(f"look {n}", call("lookup_order", order_id=f"A{n}")), "sleep_s": sleep_s}
        for n in range(lookups)
    ]
    return [*looks, {**turn("Done."), "sleep_s": sleep_s}]


def effect_steps(steps: int, sleep_s: float = 0.3) -> list[dict[str, Any]]:
    """A script of ``steps`` turns that each call ``tests.probed_tools:effect`` labelled
    ``step-N`` (``sleep_s`` long each), then one that answers ``Done.``."""
    calls = [
        {**turn(f"step {n}", call("effect", label=f"step-{n}")), "sleep_s": sleep_s}
        for n in range(steps)
    ]
    return [*calls, turn("Done.")]


LOOK_REFUND_ANSWER = [
    turn("look", call("lookup_order", order_id="B2")),
    turn("refund", call("issue_refund", order_id="B2", amount_cents=2900)),
    turn("Refunded."),
]
"""A script that looks order B2 up, refunds it 2900 cents, and answers ``Refunded.``."""


def tool_turn_events(tool_turns: int) -> list[str]:
    """The event types of a run whose first ``tool_turns`` turns each ran one tool, and
    whose next answered: it completed."""
    tool_turn = ["model.requested", "model.responded", "tool.requested", "tool.completed"]
    return [
        "run.created",
        *tool_turn * tool_turns,
        "model.requested",
        "model.responded",
        "run.completed",
    ]


def refunds(ledger: Path) -> list[str]:
    """The ledger's refunds as ``refund ORDER CENTS``: without the idempotency key that the
    example's ``send_refund`` books beside each (``issue_refund`` books none)."""
    return [" ".join(line.split()[:3]) for line in ledger.read_text().splitlines()]


def fresh_key(
    monkeypatch: pytest.MonkeyPatch, variable: str, prefix: str, unset: tuple[str, ...] = ()
) -> str:
    """A provider key no other test uses, set in ``variable`` of this process's environment
    (which the session worker shares), with the variables ``unset`` removed."""
    for name in unset:
        monkeypatch.delenv(name, raising=False)
    secret = f"{prefix}{uuid.uuid4().hex}"
    monkeypatch.setenv(variable, secret)
    return secret


def memory_context(**settings: Any) -> Context:
    return Context(Settings(**settings), MemorySnapshotStore(), MemoryRunStore())


def drive(ctx: Context, run_id: str, max_turns: int = 50) -> Advanced:
    """Take turns in this process, as chained tasks would, until the run stops needing one."""
    done = advance(ctx, run_id, None)
    for _ in range(max_turns):
        if done.outcome != "next":
            return done
        if done.countdown_s:
            time.sleep(done.countdown_s)  # the broker's countdown of a turn that waited on a limit
        done = advance(ctx, run_id, done.seq)
    raise AssertionError(f"run {run_id} still wants turns after {max_turns}")


def calls_while(work: Any, name: str, in_file: str = "") -> int:
    """How often a function named ``name`` (defined in a file whose path ends with
    ``in_file``) is called while ``work()`` runs, counted with ``sys.setprofile``."""
    count = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        code = frame.f_code
        if event == "call" and code.co_name == name and code.co_filename.endswith(in_file):
            count += 1

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return count


@contextmanager
def installed_context(context: Context) -> Iterator[Context]:
    """``context`` installed for the process (:func:`tasks.context.set_context`) while the
    block runs, and uninstalled after it."""
    set_context(context)
    try:
        yield context
    finally:
        set_context(None)


@contextmanager
def combined_sqlite_context(path: Path) -> Iterator[Context]:
    """A context whose stores share one SQLite file (a transition is one commit), installed
    for the process while the block runs."""
    context = Context(Settings(), SqliteSnapshotStore(path), SqliteRunStore(path))
    assert context.runs.commits_with(context.snapshots)
    with installed_context(context):
        yield context
