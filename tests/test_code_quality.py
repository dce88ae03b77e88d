"""The habits STYLE.md asks for, held by the suite: ruff clean, mypy --strict clean.

Both run on the project's own configuration (pyproject.toml), so `.ci/run`
fails on a lint or type error as it does on a failing test. mypy checks the
packages and, as strictly, the tests and the benches: a test that calls a
function with the wrong arguments is a test of nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_ruff_finds_nothing() -> None:
    result = run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_finds_nothing() -> None:
    result = run(sys.executable, "-m", "mypy", "--no-incremental")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_finds_nothing_in_the_tests_and_benches() -> None:
    result = run(sys.executable, "-m", "mypy", "--strict", "--no-incremental", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr
