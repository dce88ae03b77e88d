"""Durable timers: the built-in ``wait`` tool. Pure.

A model that calls ``wait`` with ``seconds`` (or ``until``, an ISO 8601 time
with a timezone) suspends its run as ``waiting``: no worker, lease or memory is
held, only the record and the snapshot. The wake-up time is a function of the
``run.suspended`` event alone (its time plus ``seconds``, or ``until``), so
every process computes the same one and nothing else needs storing.

The run store's due index carries a waiting run at its wake-up time less the
sweep interval (:func:`due_at_ms`): the sweeper finds it one sweep early and
enqueues ``ratchet.wake`` with that ETA, so it wakes on time even when the
worker that scheduled the wake-up at suspension died with it. The sweep's cost
grows with the timers due, not with all suspended runs. ``run.woken`` answers
the call (``{"type": "wait_over", …}``) and the next turn goes on. Time waiting
counts as suspended: it does not run down the deadline.

A cancel ends a wait like any suspension. An answer (``runs continue --input``)
ends it early only when the agent says ``wake_on_input = true``; the model then
reads the input as the wait's result.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runtime.models import RunState, RunStatus, Suspension

WAIT = "wait"
MAX_WAIT_S = 366 * 24 * 3600
"""The longest wait a model may ask for (a year and a day)."""


class WaitArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float | None = Field(default=None, description="How long to wait, in seconds.")
    until: str | None = Field(
        default=None, description="Or: wait until this ISO 8601 time, with a timezone."
    )
    reason: str = Field(default="", description="What the wait is for (shown to operators).")


def wait_problem(arguments: dict[str, Any], now_ms: int) -> str | None:
    """Why these ``wait`` arguments cannot be waited on, or None; told to the model."""
    seconds, until = arguments.get("seconds"), arguments.get("until")
    usage = (
        f"`wait` takes `seconds` (a number above 0, at most {MAX_WAIT_S}) or `until` "
        "(an ISO 8601 time with a timezone, in the future), not both"
    )
    if (seconds is None) == (until is None):
        return usage
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            return usage
        return None if 0 < seconds <= MAX_WAIT_S else usage
    wake = _parse_until(until)
    if wake is None or not now_ms < wake <= now_ms + MAX_WAIT_S * 1000:
        return usage
    return None


def _parse_until(value: object) -> int | None:
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return int(moment.timestamp() * 1000)


def wake_at_ms(suspension: Suspension) -> int:
    """When a ``wait`` suspension is over (its arguments were checked before it began)."""
    seconds = suspension.arguments.get("seconds")
    if seconds is not None:
        return suspension.since_ms + int(float(seconds) * 1000)
    wake = _parse_until(suspension.arguments.get("until"))
    return wake if wake is not None else suspension.since_ms


def is_timer(state: RunState) -> bool:
    """Waiting for a time (not for a child run, which is `waiting` too)."""
    suspension = state.suspension
    return state.status == RunStatus.WAITING and suspension is not None and suspension.tool == WAIT


def due_at_ms(state: RunState, lead_ms: int) -> int | None:
    """Where a waiting run sits in the due index: ``lead_ms`` before it wakes."""
    if not is_timer(state):
        return None
    assert state.suspension is not None
    return wake_at_ms(state.suspension) - lead_ms


def prompt(arguments: dict[str, Any], since_ms: int) -> str:
    """The suspension's line for operators: until when, and what for."""
    probe = Suspension(
        reason=RunStatus.WAITING,
        call_id="-",
        tool=WAIT,
        arguments=arguments,
        seq=0,
        since_ms=since_ms,
    )
    when = datetime.fromtimestamp(wake_at_ms(probe) / 1000, UTC).isoformat(timespec="seconds")
    reason = str(arguments.get("reason") or "").strip()
    return f"wait until {when}" + (f": {reason}" if reason else "")


def woken_content(suspension: Suspension, woken_at_ms: int) -> str:
    """What the model reads as the wait's result."""
    return json.dumps(
        {
            "type": "wait_over",
            "waited_s": round((woken_at_ms - suspension.since_ms) / 1000, 3),
            "woke_at": datetime.fromtimestamp(woken_at_ms / 1000, UTC).isoformat(),
        },
        sort_keys=True,
    )
