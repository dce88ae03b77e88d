"""A tool that keeps the CPU busy in pure Python: for the liveness tests."""

from __future__ import annotations

import time

from runtime import tool


@tool
def spin_charge(sleep_s: float) -> dict[str, object]:
    """Charge a card, spinning the CPU the whole time. Not idempotent."""
    deadline = time.monotonic() + sleep_s
    spins = 0
    while time.monotonic() < deadline:
        spins += 1
    return {"charged": True, "spins": spins}
