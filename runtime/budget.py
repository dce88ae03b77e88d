"""Budget top-up: an operator gives a run more turns, tokens, tool calls or time. Pure.

A run that stopped on a budget ends ``failed`` with ``run.failed`` naming the
budget (``data.budget``). ``run.budget_raised`` — who, why, the new limits and
the old — lifts the limits, and on such a run makes it live again at the state
it stopped in; on a live or suspended run it only lifts them, ahead of time.

The binding is untouched: it is the agent as the run started, and the agent
file still matches it, so a raised run is never refused as "changed". The
raised limits live in the run's state, which every later check reads.

Limits are only raised: a lower value, a limit the run does not have
(``max_total_tokens`` unset means no limit) or a value not above what the run
has already used is refused, saying why.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.errors import InvalidOption, InvalidRequest, RunRefused
from runtime.models import Event, RunState, RunStatus

RAISABLE = ("max_turns", "max_total_tokens", "max_tool_calls", "timeout_seconds")
_CHANGE = re.compile(r"^(\+)?([0-9]{1,12})$")


def parse_change(budget: str, text: str, run_id: str | None = None) -> tuple[bool, int]:
    """``"+5"`` → (relative, 5); ``"30"`` → (absolute, 30). InvalidRequest naming the budget."""
    found = _CHANGE.fullmatch(text.strip())
    if budget not in RAISABLE:
        raise InvalidOption(
            f"`{budget}` is not a budget; budgets are {', '.join(RAISABLE)}", run_id
        )
    if found is None or int(found.group(2)) == 0:
        raise InvalidOption(
            f"`{budget}`: {text!r} is not a raise: give `+N` (N more) or `N` (the new limit), "
            "N a positive whole number",
            run_id,
        )
    return found.group(1) == "+", int(found.group(2))


def _used(state: RunState, budget: str, now_ms: int) -> float:
    u = state.usage
    if budget == "max_turns":
        return u.model_attempts
    if budget == "max_total_tokens":
        return u.total_tokens
    if budget == "max_tool_calls":
        return u.tool_calls
    return (now_ms - state.created_at_ms - state.suspended_ms) / 1000


def budget_stop(last: Event) -> str | None:
    """The budget a run's last event says it stopped on, if it did."""
    if last.type == "run.failed":
        budget = last.data.get("budget")
        return budget if isinstance(budget, str) else None
    return None


def plan_raise(
    state: RunState,
    last: Event,
    changes: dict[str, str],
    by: str,
    reason: str,
    now_ms: int,
) -> dict[str, Any]:
    """The data of ``run.budget_raised`` for ``changes`` (budget → ``+N`` or ``N``).

    Raises RunRefused when the run cannot be given more (it ended another way,
    or is parked) and InvalidRequest (a ValueError) for a change that is not a raise.
    """
    run_id = state.run_id
    stopped_on = budget_stop(last)
    if not (state.status.is_live or state.status.is_suspended or stopped_on is not None):
        raise RunRefused(
            state.run_id,
            state.status.value,
            "only a run that is live, suspended, or stopped on a budget can be given more",
        )
    if not changes:
        raise InvalidOption("name at least one budget to raise, e.g. --max-turns +5", run_id)
    if not reason.strip():
        raise InvalidOption(
            "say why the budget is raised (--reason): it is kept in the run's events", run_id
        )
    current = state.budgets.model_dump()
    raised: dict[str, int] = {}
    for budget, text in changes.items():
        relative, amount = parse_change(budget, text, run_id)
        before = current[budget]
        if before is None:
            raise InvalidRequest(
                f"`{budget}` has no limit on this run; there is nothing to raise", run_id
            )
        after = before + amount if relative else amount
        used = _used(state, budget, now_ms)
        if after <= before:
            raise InvalidRequest(f"`{budget}` is {before}: {after} would not raise it", run_id)
        if after <= used:
            raise InvalidRequest(
                f"`{budget}`: the run has used {used:g}; a limit of {after} leaves it nothing",
                run_id,
            )
        raised[budget] = after
    if stopped_on is not None and stopped_on not in raised:
        raise InvalidRequest(
            f"it stopped on `{stopped_on}`: raise that one for it to go on", run_id
        )
    was = {budget: current[budget] for budget in raised}
    return {"by": by, "reason": reason.strip(), "budgets": raised, "was": was}


def fold_raise(state: RunState, data: dict[str, Any], live: RunStatus) -> RunState:
    """The state after ``run.budget_raised``; ``live`` is the status a revived run takes."""
    budgets = state.budgets.model_copy(update=data["budgets"])
    state = state.model_copy(update={"budgets": budgets})
    if state.status == RunStatus.FAILED:
        state = state.model_copy(update={"status": live, "error": None})
    return state
