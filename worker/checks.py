"""Checks a worker makes before it consumes anything: ``worker_init`` refuses a bad fleet config.

**The broker check.** A Redis broker redelivers a message whose task has run
longer than ``visibility_timeout`` — while the first copy still runs (CELERY-NOTES:
three copies of a 35 s task with a 10 s timeout). Ratchet's fencing makes the
copies harmless, but they hold workers and hammer the lease, so a worker whose
longest possible turn does not fit in the visibility timeout refuses to start.

The longest turn is the smaller of two bounds:

- Celery's hard time limit (``RATCHET_TURN_TIME_LIMIT_S`` or ``--time-limit``),
  but only in the prefork pool: the solo and threads pools do not enforce it;
- per agent named in ``RATCHET_AGENTS``: its model call plus, in the worst case,
  every tool call its budget allows in that one turn, each tried up to
  ``TOOL_TIMEOUT_ATTEMPTS`` times — ``model_timeout_s + max_tool_calls ×
  tool_timeout_s × attempts`` (the run's deadline cuts it earlier still, but a
  call already started runs to its own timeout, so the deadline is not counted).

With neither bound (solo or threads pool, no agents listed) the longest turn is
unknown: the worker starts and logs a warning saying what to set.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_init

from worker.settings import Settings, get_settings

log = logging.getLogger("ratchet.checks")

TOOL_TIMEOUT_ATTEMPTS = 3
"""Keep equal to tasks.turn.TOOL_TIMEOUT_ATTEMPTS (not imported: tasks imports the app)."""
TIME_LIMITED_POOLS = ("prefork",)
"""Pools that enforce Celery's hard time limit by killing the pool process."""


@dataclass(frozen=True)
class LongestTurn:
    seconds: float | None
    """None when nothing bounds a turn."""
    because: str
    """What bounds it, for the operator."""


def agent_longest_turn_s(agent_file: str) -> float:
    from runtime.agent import load_agent

    spec = load_agent(agent_file).spec
    return (
        spec.model_timeout_s
        + spec.budgets.max_tool_calls * spec.tool_timeout_s * TOOL_TIMEOUT_ATTEMPTS
    )


def longest_turn(settings: Settings, pool: str, time_limit_s: float | None) -> LongestTurn:
    bounds: list[tuple[float, str]] = []
    if time_limit_s and pool in TIME_LIMITED_POOLS:
        bounds.append((float(time_limit_s), f"the turn time limit ({time_limit_s:g} s)"))
    agents = [(agent_longest_turn_s(str(f)), str(f)) for f in settings.agent_files]
    if agents:
        seconds, path = max(agents)
        bounds.append(
            (
                seconds,
                f"agent {path} (model_timeout_s + max_tool_calls x tool_timeout_s x "
                f"{TOOL_TIMEOUT_ATTEMPTS} = {seconds:g} s)",
            )
        )
    if not bounds:
        return LongestTurn(None, f"the {pool} pool does not enforce the turn time limit")
    return LongestTurn(*min(bounds))


def pool_name(pool_cls: Any) -> str:
    """``prefork``, ``threads``, ``solo``, … from a name or a pool class."""
    if isinstance(pool_cls, str):
        return pool_cls
    module = getattr(pool_cls, "__module__", "")
    return {"thread": "threads", "asynpool": "prefork"}.get(
        module.rsplit(".", 1)[-1], module.rsplit(".", 1)[-1]
    )


def broker_problem(
    settings: Settings, broker_url: str, pool: str, time_limit_s: float | None
) -> str | None:
    """One line saying why this worker must not start, or None."""
    if not broker_url.startswith(("redis", "rediss", "sentinel")):
        return None
    turn = longest_turn(settings, pool, time_limit_s)
    visibility_s = settings.visibility_timeout_s
    if turn.seconds is None:
        log.warning(
            "cannot tell the longest turn: %s and RATCHET_AGENTS names no agent; a turn "
            "longer than the Redis visibility timeout (%s s) is delivered twice",
            turn.because,
            visibility_s,
        )
        return None
    if turn.seconds < visibility_s:
        return None
    return (
        f"ratchet: refusing to start: RATCHET_VISIBILITY_TIMEOUT_S ({visibility_s} s) is not "
        f"longer than the longest turn, {turn.seconds:g} s ({turn.because}, {pool} pool); "
        "Redis would deliver such a turn again while it still runs. Raise "
        f"RATCHET_VISIBILITY_TIMEOUT_S above {turn.seconds:g}, or lower the agent's timeouts"
    )


@worker_init.connect
def _check_at_worker_start(sender: Any = None, **_: Any) -> None:
    from runtime.errors import RatchetError

    conf = sender.app.conf
    try:
        problem = broker_problem(
            get_settings(),
            conf.broker_url or "",
            pool_name(sender.pool_cls),
            getattr(sender, "time_limit", None),
        )
    except (RatchetError, OSError) as exc:
        problem = f"ratchet: refusing to start: an agent in RATCHET_AGENTS cannot be loaded: {exc}"
    if problem is not None:
        # SystemExit passes through Celery's signal dispatch (it catches Exception only).
        print(problem, file=sys.stderr, flush=True)
        raise SystemExit(2)
