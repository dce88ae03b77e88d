"""How runs and events look on a terminal: one place, shared by the CLI and the demo."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from runtime.json_values import MAX_INT_DIGITS, without_surrogates
from runtime.models import Event
from store.runs import JournalEntry, RunRecord

_INT_LIMIT = 10**MAX_INT_DIGITS


def displayable(value: Any) -> Any:
    """``value`` as JSON can always print it, whatever a store held: a lone surrogate as
    U+FFFD, an integer too long for text, NaN, an infinity or any other object as a string."""
    if isinstance(value, str):
        return without_surrogates(value)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if -_INT_LIMIT < value < _INT_LIMIT:
            return value
        return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    if isinstance(value, float):
        return value if value - value == 0 else repr(value)  # NaN and infinities: text
    if isinstance(value, dict):
        return {without_surrogates(str(k)): displayable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [displayable(v) for v in value]
    return without_surrogates(repr(value))


def shown_json(value: Any, **options: Any) -> str:
    """``json.dumps`` of any stored value, never raising (:func:`displayable`)."""
    return json.dumps(displayable(value), ensure_ascii=False, **options)


def printable(text: str) -> str:
    """Text a terminal can take: a lone surrogate in a stored string is shown as U+FFFD."""
    return without_surrogates(text)


def _clip(text: str, width: int = 70) -> str:
    text = " ".join(printable(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _when(at_ms: int) -> str:
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%H:%M:%S.%f")[:-3]


def _summary(event: Event) -> str:  # noqa: C901 - one line per event type
    d: dict[str, Any] = event.data
    kind = event.type
    if kind == "run.created":
        return f"agent {d['agent']}: {_clip(d['input'], 50)}"
    if kind == "model.requested":
        return f"turn {d.get('turn')}"
    if kind == "model.responded":
        calls = ", ".join(c["name"] for c in d.get("tool_calls", []))
        said = _clip(d.get("content", ""), 50)
        return f"{said!r}" + (f" → calls {calls}" if calls else "")
    if kind == "tool.requested":
        return f"{d['name']}({_clip(shown_json(d.get('arguments', {})), 50)}) [{d['call_id']}]"
    if kind == "tool.completed":
        return f"{d['name']} → {_clip(shown_json(d.get('result')), 55)}"
    if kind == "tool.failed":
        return f"{d['name']} ✗ {_clip(d.get('error', ''), 55)}"
    if kind == "tool.unsent":
        return f"{d['name']} [{d['call_id']}] not sent: {_clip(d.get('reason', ''), 50)}"
    if kind == "tool.probed":
        ran = d.get("answer") == "ran" and "error" not in d
        found = f" → {_clip(shown_json(d.get('result')), 40)}" if ran else ""
        told = d.get("detail") or d.get("error")  # error: it ran, its result was not stored
        why = f" ({_clip(str(told), 40)})" if told else ""
        return f"{d['name']} [{d['call_id']}] probe: {d['answer']}{found}{why}"
    if kind == "run.completed":
        return _clip(d.get("output", ""), 70)
    if kind in (
        "run.failed",
        "run.stalled",
        "run.parked",
        "run.cancelled",
        "run.expired",
        "model.failed",
    ):
        return _clip(str(d.get("reason") or d.get("error") or ""), 90)
    if kind == "run.continued":
        given = d.get("input")
        if given is not None:
            answer = _clip(str(given), 50)
        else:
            answer = "approved" if d.get("approved") else f"denied: {d.get('reason')}"
        return f"{answer} [{d.get('continuation_id')}] after {_seconds(d.get('suspended_ms', 0))}"
    if kind == "run.resume_refused":
        return _clip(f"resume by {d.get('by')} refused: {d.get('reason', '')}", 90)
    if kind == "run.suspended":
        return f"{d['reason']}: {_clip(d.get('prompt', ''), 60)}"
    return _clip(shown_json(d, sort_keys=True), 70)


def summary(event: Event) -> str:
    """What an event says, in a line; any stored data, whatever its shape, prints."""
    try:
        return printable(_summary(event))
    except (KeyError, TypeError, AttributeError, ValueError):
        # An event of an older or a damaged shape: its data as it is.
        return _clip(shown_json(event.data, sort_keys=True), 70)


def event_line(event: Event) -> str:
    """One event as `runs events` prints it."""
    return printable(f"{event.seq:>5}  {_when(event.at_ms)}  {event.type:<16}  {summary(event)}")


def _seconds(ms: int) -> str:
    return f"{max(ms, 0) / 1000:.1f}s"


def when_utc(at_ms: int) -> str:
    """A moment as `runs list` prints it: to the second, UTC."""
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def run_times(record: RunRecord, now_ms: int) -> tuple[int, int]:
    """(ms running, ms suspended) so far: the current suspension counts as suspended."""
    waiting = record.suspension
    ended_ms = now_ms if record.status.is_live else record.updated_at_ms
    if waiting is not None:
        ended_ms = waiting.since_ms
    running_ms = ended_ms - record.created_at_ms - record.suspended_ms
    suspended_ms = record.suspended_ms + (max(0, now_ms - waiting.since_ms) if waiting else 0)
    return max(running_ms, 0), suspended_ms


def time_lines(record: RunRecord, now_ms: int) -> list[str]:
    """Time running (what the deadline counts) and time suspended (what it does not)."""
    waiting = record.suspension
    running_ms, suspended_ms = run_times(record, now_ms)
    timeout = record.budgets.get("timeout_seconds")
    of = f" of {timeout}s" if timeout else ""
    lines = [f"time       running {_seconds(running_ms)}{of}, suspended {_seconds(suspended_ms)}"]
    if waiting is not None:
        lines.append(
            f"waiting    {waiting.reason.value} since {_when(waiting.since_ms)} "
            f"(seq {waiting.seq}, {_seconds(now_ms - waiting.since_ms)})"
        )
        if waiting.reason.value == "awaiting_approval":
            arguments = shown_json(waiting.arguments, sort_keys=True)
            lines.append(f"tool       {waiting.tool}({_clip(arguments, 80)})")
        else:
            lines.append(f"prompt     {printable(waiting.prompt)}")
    return lines


def record_lines(record: RunRecord, now_ms: int | None = None) -> list[str]:
    """The run as `runs show` prints it; ``now_ms`` defaults to the wall clock."""
    now_ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    u, b = record.usage, record.budgets
    tokens_limit = b.get("max_total_tokens") or "∞"
    lines = [
        f"run        {record.run_id}",
        f"status     {record.status.value}",
        f"agent      {record.agent}  ({record.agent_file})",
        f"turns      {u.model_turns} of {b.get('max_turns')}  (attempts {u.model_attempts})",
        f"tokens     {u.total_tokens} of {tokens_limit}  (in {u.input_tokens}, out {u.output_tokens})",
        f"tool calls {u.tool_calls} of {b.get('max_tool_calls')}",
        f"events     {record.last_seq}",
        f"created    {_when(record.created_at_ms)}   updated {_when(record.updated_at_ms)}",
    ]
    lines.extend(time_lines(record, now_ms))
    if record.output is not None:
        lines.append(f"output     {printable(record.output)}")
    if record.error:
        lines.append(f"last error {printable(record.error)}")
    return lines


def actions_line(record: RunRecord) -> str:
    """What an operator may do to the run now: the core's list, as the console offers it."""
    return f"actions    {', '.join(record.status.operator_actions) or 'none'}"


def lineage_lines(lineage: dict[str, Any]) -> list[str]:
    """The runs a run is linked to, for `runs show`: its parent, children, fork origin."""
    lines = []
    if lineage.get("parent"):
        lines.append(f"parent     {lineage['parent']}")
    for child in lineage.get("children") or ():
        lines.append(f"child      {child}")
    fork = lineage.get("forked_from")
    if fork:
        lines.append(f"forked     from {fork['run_id']} at seq {fork['seq']}")
    return lines


def tool_policy_lines(policies: list[dict[str, Any]]) -> list[str]:
    """Each MCP tool's policy for `runs show`: what a crash or a call does, and who said so."""
    lines = []
    for p in policies:
        again = "runs again after a crash" if p["idempotent"] else "parks if cut short"
        approval = "awaits approval" if p["approval"] else "no approval"
        lines.append(
            f"mcp tool   {p['tool']} ({p['server']}): {again} ({p['idempotent_from']}); "
            f"{approval} ({p['approval_from']})"
        )
    return lines


def open_call_lines(entry: JournalEntry) -> list[str]:
    """The tool call a run has open: what an operator checks before reconciling it."""
    arguments = shown_json(entry.arguments, sort_keys=True)
    return [
        f"open call  {entry.call_id}  {entry.tool}({_clip(arguments, 200)})",
        f"           requested {_day(entry.requested_at_ms)} (seq {entry.requested_seq}); "
        "outcome unknown",
    ]


def _day(at_ms: int) -> str:
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
