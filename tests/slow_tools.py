"""Tools that take as long as they are told to: for the bounded-hang tests."""

from __future__ import annotations

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
