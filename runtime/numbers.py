"""Numbers from outside are finite: one rule for every edge a number comes in by.

A NaN compares false with everything, so a range check lets it through (click's
``FloatRange``, pydantic's ``gt=0``, ``x <= 60``); an infinity passes every lower
bound. Inside, either one turns a limit off, a deadline into never, or fails a
Lua script on every call. So the CLI's options (``worker.cli_base.finite``), the
settings from the environment, the agent file's tables, the Python API and the
limit store's run-time values all refuse them here, before anything changes.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AllowInfNan

from runtime.errors import InvalidRequest

Finite = Annotated[float, AllowInfNan(False)]
"""A pydantic float field that refuses NaN and ±infinity (``input should be a finite number``)."""

NOT_FINITE = "is not a finite number (NaN and infinities are refused)"


def is_finite(value: object) -> bool:
    """``value`` is an int or float (not a bool) and neither NaN nor an infinity."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)


def finite(what: str, value: float) -> float:
    """``value`` if it is a finite number; else InvalidRequest naming ``what``."""
    if not is_finite(value):
        raise InvalidRequest(f"{what} {value!r} {NOT_FINITE}")
    return value
