"""Things an agent file may name as tools that are not tools (tests/test_agent_hostile.py),
and tools whose results are hostile (tests/integration/test_hostile_outputs.py).

Each hostile tool books one line in the ledger (``RATCHET_EXAMPLE_LEDGER``) per call,
before it returns: the tests count how often it ran.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from os import getcwd as cwd  # noqa: F401  (a C function re-exported)
from os.path import join  # noqa: F401  (a standard-library Python function re-exported)
from pathlib import Path
from typing import Any


class Refund:
    """A class: calling it builds an object, it is not a tool."""

    def __init__(self, order_id: str) -> None:
        self.order_id = order_id


def typed(order_id: str) -> str:
    """A real tool."""
    return order_id


half = functools.partial(typed, "A1")


def callback(fn: Callable[[], int]) -> int:
    """Its parameter cannot be described as JSON schema."""
    return fn()


def unknown_hint(value: NoSuchType) -> None:  # type: ignore[name-defined]  # noqa: F821
    """Its hint names nothing that exists."""


# --- tools that run, then hand back what ratchet cannot store as it is ---------------


def _booked(name: str) -> None:
    ledger = Path(os.environ.get("RATCHET_EXAMPLE_LEDGER", ".ratchet/refunds.ledger"))
    with ledger.open("a", encoding="utf-8") as handle:
        handle.write(f"{name}\n")
        handle.flush()
        os.fsync(handle.fileno())


def partial_emoji(order_id: str) -> dict[str, Any]:
    """Text cut in the middle of a UTF-16 pair: lone surrogates."""
    _booked("partial_emoji")
    return {"order_id": "\ud800", "note": "partial emoji \ud83d", "asked": [order_id, "\udc00"]}


FORTY_MIB = 40 * 1024 * 1024


def forty_mib() -> str:
    """A result far over what a snapshot holds."""
    _booked("forty_mib")
    return "x" * FORTY_MIB


def googol_power() -> int:
    """An integer of 5,001 digits: Python holds it, JSON text of it cannot be read back."""
    _booked("googol_power")
    return 10**5000


def booked(order_id: str) -> str:
    """A plain tool that books its call: the one the model asks for with bad arguments."""
    _booked(f"booked {order_id}")
    return f"looked up {order_id}"


def sized(kib: int) -> str:
    """A result of ``kib`` KiB: a run's transcript fills up with them."""
    _booked(f"sized {kib}")
    return "x" * (kib * 1024)
