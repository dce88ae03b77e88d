"""A process reads an agent file once, and again only when a file it was read from changes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

import tasks.context
from runtime.agent import Agent
from runtime_io.agent_files import load_agent
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


def test_an_agent_named_through_a_link_is_kept_and_read_again_when_the_link_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cache is looked up by the path as given, unresolved: what it stats must follow
    # the link, so that a link pointed at another agent file is noticed.
    first_file = write_agent(tmp_path / "v1", SCRIPT)
    second_file = write_agent(tmp_path / "v2", [turn("Done.")])
    age(first_file, tmp_path / "v1" / "test-agent.script.json")
    age(second_file, tmp_path / "v2" / "test-agent.script.json")
    current = tmp_path / "current"
    current.symlink_to(tmp_path / "v1", target_is_directory=True)
    loads = counted_loads(monkeypatch)
    ctx = memory_context()
    first = ctx.agent(current / "test-agent.toml")
    assert ctx.agent(current / "test-agent.toml") is first
    assert ctx.agent(first_file) is first  # the same file by its own path: the same agent
    assert len(loads) == 1, loads

    # When the link is pointed at the other version
    current.unlink()
    current.symlink_to(tmp_path / "v2", target_is_directory=True)

    # Then the agent is read again from there
    again = ctx.agent(current / "test-agent.toml")
    assert again.binding != first.binding
    assert again.path == second_file.resolve()
    assert ctx.agent(current / "test-agent.toml") is again
    assert ctx.agent(first_file) is first
