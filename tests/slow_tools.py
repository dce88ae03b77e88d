"""Tools that take as long as they are told to: for the bounded-hang tests."""

from __future__ import annotations

import os
import time

from runtime import tool


@tool(idempotent=True)
def slow_lookup(sleep_s: float) -> dict[str, object]:
    """Look something up, slowly. Safe to repeat."""
    time.sleep(sleep_s)
    return {"found": True}


@tool
def slow_charge(sleep_s: float) -> dict[str, object]:
    """Charge a card, slowly. Not idempotent."""
    time.sleep(sleep_s)
    return {"charged": True}


def _note(what: str) -> None:
    """One line per invocation in RATCHET_TEST_CALLS, for tests that count tries."""
    path = os.environ.get("RATCHET_TEST_CALLS")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(what + "\n")


@tool(idempotent=True)
def counted_lookup(sleep_s: float, fast_after: int = 0) -> dict[str, object]:
    """Look something up, slowly; from the ``fast_after``-th try on (if > 0), at once."""
    path = os.environ.get("RATCHET_TEST_CALLS")
    tries = 0
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            tries = len(handle.read().splitlines())
    _note("lookup")
    if not (fast_after and tries + 1 >= fast_after):
        time.sleep(sleep_s)
    return {"found": True}


@tool
def counted_charge(sleep_s: float) -> dict[str, object]:
    """Charge a card, slowly. Not idempotent."""
    _note("charge")
    time.sleep(sleep_s)
    return {"charged": True}
