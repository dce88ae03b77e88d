"""Tools that raise what is not an Exception (tests/integration/test_tool_exits.py).

Each books one line in the file ``RATCHET_TEST_TOOL_LOG`` names before it raises, so a
test counts how often it ran.
"""

from __future__ import annotations

import os
import sys


def _booked(name: str) -> None:
    with open(os.environ["RATCHET_TEST_TOOL_LOG"], "a") as log:
        log.write(f"{name}\n")


def exits(order_id: str) -> str:
    """Look up an order (and call sys.exit on the way)."""
    _booked(f"exits {order_id}")
    sys.exit(3)


def interrupts(order_id: str) -> str:
    """Look up an order (and raise KeyboardInterrupt on the way)."""
    _booked(f"interrupts {order_id}")
    raise KeyboardInterrupt
