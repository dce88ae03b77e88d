"""A pytest plugin: what the conformance suites skipped, and why, summed up after the run.

Enable it with ``pytest -p store.conformance.plugin`` (or ``pytest_plugins =
["store.conformance.plugin"]`` in a conftest.py). Without it ``pytest -rs`` lists the
same reasons, one line per skipped test.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

SUITES = Path(__file__).resolve().parent
"""Where the suites live: a skip raised here is one of theirs."""


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        where = report.longrepr
        if not (isinstance(where, tuple) and len(where) == 3):
            continue
        path, _, reason = where
        if (config.invocation_params.dir / path).resolve().parent != SUITES:
            continue
        reasons[str(reason).removeprefix("Skipped: ")] += 1
    if not reasons:
        return
    terminalreporter.section("ratchet store conformance: not offered, so not tested")
    for reason, tests in sorted(reasons.items()):
        terminalreporter.line(f"{tests:>4} skipped  {reason}")
