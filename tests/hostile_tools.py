"""Things an agent file may name as tools that are not tools (tests/test_agent_hostile.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from os import getcwd as cwd  # noqa: F401  (a C function re-exported)
from os.path import join  # noqa: F401  (a standard-library Python function re-exported)


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
