"""Shared fixtures. Real services only: each session starts its own redis-server.

Hypothesis runs under one of two profiles, chosen by ``RATCHET_HYPOTHESIS``: ``fast``
(the default, the suite's: derandomized, no example database, so a run in CI finds
what the last found) and ``bench`` (a nightly run, or before a change to a rule the
property tests hold: random, twenty times the examples of each test that asks for
:func:`examples`).
"""

import os
from pathlib import Path

import pytest
from hypothesis import settings

pytest_plugins = (
    "tests.redis_server",
    "tests.cluster_servers",
    "tests.s3_server",
    "tests.openai_server",
    "tests.workers",
    "tests.netns",
)

PROFILES = {"fast": 1, "bench": 20}
"""Profile name → how many times each property test's own example count it runs."""

settings.register_profile("fast", deadline=None, derandomize=True, database=None)
settings.register_profile("bench", deadline=None, max_examples=2000, database=None)
PROFILE = os.environ.get("RATCHET_HYPOTHESIS", "fast")
if PROFILE not in PROFILES:
    raise SystemExit(f"RATCHET_HYPOTHESIS={PROFILE!r}: the profiles are {', '.join(PROFILES)}")
settings.load_profile(PROFILE)


def examples(fast: int) -> int:
    """A property test's example count: ``fast`` in the suite, more under ``bench``."""
    return fast * PROFILES[PROFILE]


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The example refund tool's side-effect log, one line per refund issued
    (``RATCHET_EXAMPLE_LEDGER``, which worker subprocesses are given too)."""
    path = tmp_path / "refunds.ledger"
    monkeypatch.setenv("RATCHET_EXAMPLE_LEDGER", str(path))
    return path
