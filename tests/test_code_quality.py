"""The habits STYLE.md asks for, held by the suite: ruff clean, mypy --strict clean.

Both run on the project's own configuration (pyproject.toml), so `.ci/run`
fails on a lint or type error as it does on a failing test. mypy checks the
packages and, as strictly, the tests and the benches: a test that calls a
function with the wrong arguments is a test of nothing.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)

MYPY_CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
PACKAGES: list[str] = MYPY_CONFIG["packages"]
"""What ``python -m mypy`` checks, from the project's configuration."""


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_ruff_finds_nothing() -> None:
    result = run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def mypy_report() -> subprocess.CompletedProcess[str]:
    """One ``mypy --strict`` over the configured packages, the tests and the benches.

    Checking the tests checks every package module they import, so a run of the
    packages alone and a run of the tests would type-check most of the packages twice
    (about 20 s on 2 cores). The options are the same for both: ``strict`` is in the
    configuration, and its per-module overrides apply by module name.
    """
    # mypy takes packages (-p) or files, not both: the packages as their folders.
    return run(
        sys.executable, "-m", "mypy", "--strict", "--no-incremental", *PACKAGES, "tests", "bench"
    )  # fmt: skip


def errors(report: subprocess.CompletedProcess[str]) -> list[tuple[str, str]]:
    """The report's error lines, each with the top-level folder of its file."""
    output = report.stdout + report.stderr
    # 1 is "errors found"; anything else is mypy failing to run, which no part may pass.
    assert report.returncode in (0, 1), output
    lines = [line for line in report.stdout.splitlines() if ": error:" in line]
    assert report.returncode == 0 or lines, output
    return [(Path(line.partition(":")[0]).parts[0], line) for line in lines]


def test_mypy_strict_finds_nothing(mypy_report: subprocess.CompletedProcess[str]) -> None:
    found = [line for top, line in errors(mypy_report) if top in PACKAGES]
    assert found == [], mypy_report.stdout


def test_mypy_strict_finds_nothing_in_the_tests_and_benches(
    mypy_report: subprocess.CompletedProcess[str],
) -> None:
    # and whatever else they import from the tree (only the packages are the other test's)
    found = [line for top, line in errors(mypy_report) if top not in PACKAGES]
    assert found == [], mypy_report.stdout
