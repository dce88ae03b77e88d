"""Every code block the README and docs/ claim runs, run: as written, against a real worker.

A block claims to run when the line before its fence (blank lines aside) is a marker::

    <!-- doctest: python, worker -->
    <!-- doctest: sh -->

``python`` blocks run with ``python -c``, ``sh`` blocks with ``bash -e`` (``ratchet`` on
PATH is this checkout's CLI), from the repository root, configured only by environment
variables. ``worker``: a ``celery -A worker worker`` subprocess runs on a private Redis
that is the broker and both stores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.workers import ROOT, WorkerProcesses

MARKER = re.compile(r"^<!-- doctest: ([a-z]+)((?:, [a-z-]+)*) -->$")
FENCE = re.compile(r"^```([a-z]*)\s*$")
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    where: str
    language: str
    needs: frozenset[str]
    code: str


def marked_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks = []
    for number, line in enumerate(lines):
        marker = MARKER.match(line.strip())
        if marker is None:
            continue
        language = marker[1]
        needs = frozenset(part.strip() for part in marker[2].split(",") if part.strip())
        start = number + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        fence = FENCE.match(lines[start]) if start < len(lines) else None
        where = f"{path.relative_to(ROOT)}:{number + 1}"
        assert fence is not None, f"{where}: a doctest marker must be followed by a code block"
        assert fence[1] == language, f"{where}: marker says {language}, the block {fence[1]}"
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
        blocks.append(Block(where, language, needs, "\n".join(lines[start + 1 : end]) + "\n"))
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in marked_blocks(path)]


def test_the_docs_mark_their_runnable_blocks() -> None:
    # The README's Python API and exit statuses, and the Celery client in docs/celery.md.
    wheres = {block.where.split(":")[0] for block in BLOCKS}
    assert {"README.md", "docs/celery.md"} <= wheres
    assert {block.language for block in BLOCKS} == {"python", "sh"}


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    """A ``ratchet`` on PATH that is this checkout's CLI (not whatever is installed)."""
    directory = tmp_path / "bin"
    directory.mkdir()
    command = directory / "ratchet"
    command.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m worker "$@"\n')
    command.chmod(0o755)
    return directory


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_a_marked_block_runs_as_written(
    block: Block, worker_processes: WorkerProcesses, shim: Path
) -> None:
    env = dict(worker_processes.base_env)
    env["PATH"] = f"{shim}{os.pathsep}{env.get('PATH', '')}"
    worker = worker_processes.start("--pool", "threads") if "worker" in block.needs else None
    command = (
        [sys.executable, "-c", block.code]
        if block.language == "python"
        else ["bash", "-e", "-c", block.code]
    )
    ran = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert ran.returncode == 0, (
        f"{block.where} failed ({ran.returncode}):\n{ran.stdout}\n{ran.stderr}"
        + (f"\nworker log:\n{worker.log()[-3000:]}" if worker else "")
    )


SETTING_ROW = re.compile(
    r"^\| `(RATCHET_[A-Z0-9_]+)` \| `?([0-9]+(?:\.[0-9]+)?)`?(?: \([^|]*\))? \|", re.M
)


def test_every_settings_table_gives_the_default_the_code_has() -> None:
    from tasks.settings import Settings
    from worker.console.auth import ConsoleSettings

    fields = {f"RATCHET_{name.upper()}": f.default for name, f in Settings.model_fields.items()}
    fields |= {
        f"RATCHET_CONSOLE_{name.upper()}": f.default
        for name, f in ConsoleSettings.model_fields.items()
    }
    rows = [
        (path.relative_to(ROOT), variable, given)
        for path in DOCUMENTS
        for variable, given in SETTING_ROW.findall(path.read_text())
    ]
    assert len(rows) >= 10  # the README's table and docs/recovery.md's at least
    wrong = [
        f"{where}: {variable} default {given}, the code's is {fields.get(variable, 'no such setting')}"
        for where, variable, given in rows
        if variable not in fields or float(given) != float(fields[variable])
    ]
    assert wrong == []


def test_the_conformance_doc_names_every_capability_the_suite_reports() -> None:
    from store.conformance.capabilities import (
        RUN_STORE_CAPABILITIES,
        SNAPSHOT_STORE_CAPABILITIES,
    )

    text = (ROOT / "docs" / "conformance.md").read_text()
    table = dict(re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", text, re.M))
    reported = {c.name: c for c in (*RUN_STORE_CAPABILITIES, *SNAPSHOT_STORE_CAPABILITIES)}
    assert set(table) == set(reported)
    for name, capability in reported.items():
        assert all(method in table[name] for method in capability.methods), (name, table[name])


def test_the_readme_exit_table_is_the_code_table() -> None:
    from worker.exits import MEANINGS, Exit

    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", readme.split("**Exit statuses**", 1)[1], re.M)
    table = {int(status): meaning for status, meaning in rows[: len(MEANINGS)]}
    assert table == {int(status): meaning for status, meaning in MEANINGS.items()}
    assert set(MEANINGS) == set(Exit)
