"""A process reads an agent file once, and again only when a file it was read from changes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

import tasks.context
from runtime.agent import Agent, load_agent
from tests.helpers import call, memory_context, turn, write_agent

SCRIPT = [turn("look", call("lookup_order", order_id="A1")), turn("Done.")]


def counted_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths tasks.context loads agents from, in order (the real loader still runs)."""
    loads: list[str] = []

    def load(path: Any) -> Agent:
        loads.append(str(path))
        return load_agent(path)

    monkeypatch.setattr(tasks.context, "load_agent", load)
    return loads


def age(*paths: Path, seconds: float = 60) -> None:
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def test_an_agent_whose_files_were_written_before_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = write_agent(tmp_path, SCRIPT)
    age(agent, tmp_path / "test-agent.script.json")
    loads = counted_loads(monkeypatch)
    ctx = memory_context()

    first = ctx.agent(agent)
    assert ctx.agent(agent) is first
    assert len(loads) == 1, loads


def test_an_agent_whose_script_was_just_written_is_read_again_to_be_sure_then_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file written moments ago may have been written while it was read: read again.
    agent = write_agent(tmp_path, SCRIPT)
    age(agent)
    loads = counted_loads(monkeypatch)
    ctx = memory_context()

    first = ctx.agent(agent)
    assert ctx.agent(agent) is first
    assert len(loads) == 2, loads


def test_a_changed_script_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = write_agent(tmp_path, SCRIPT)
    script = tmp_path / "test-agent.script.json"
    age(agent, script)
    loads = counted_loads(monkeypatch)
    ctx = memory_context()
    first = ctx.agent(agent)

    write_agent(tmp_path, [turn("Done.")])
    age(agent, seconds=60)
    age(script, seconds=30)  # a new mtime, still long settled

    again = ctx.agent(agent)
    assert again is not first
    assert again.binding != first.binding
    assert len(loads) == 2, loads
