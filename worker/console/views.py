"""What the console's pages show, as plain data: read through :class:`worker.api.Ratchet`.

Everything here is run data from outside (inputs, model text, tool arguments);
the templates escape it (Jinja2 autoescape), and nothing here marks it safe.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from runtime.fsm import rebuild
from runtime.models import Event, Message, RunStatus
from store.runs import JournalEntry, RunRecord
from tasks.control import new_continuation_id
from tasks.tracing import trace_id_of
from worker.api import Ratchet
from worker.render import shown_json, time_lines
from worker.render import summary as event_summary

PAGE_SIZE = 25
COUNT_CAP = 500
"""Counts per status stop here ("500+"): the run store lists, it does not count."""
AGENT_SCAN_CAP = 5000
"""Filtering by agent reads at most this many of the newest runs."""


def when(at_ms: int | None) -> str:
    if at_ms is None:
        return ""
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def pretty(value: Any) -> str:
    return shown_json(value, sort_keys=True, indent=2)


@dataclass
class RunsPage:
    records: list[RunRecord]
    counts: list[tuple[str, str]]
    status: str
    agent: str
    page: int
    has_next: bool

    def url(self, page: int) -> str:
        query = {k: v for k, v in (("status", self.status), ("agent", self.agent)) if v}
        return "/?" + urlencode({**query, "page": page})

    @property
    def version(self) -> str:
        """Changes whenever the list or the counts would: the live update swaps on it."""
        seen = [(r.run_id, r.status.value, r.last_seq) for r in self.records], self.counts
        return hashlib.sha256(json.dumps(seen).encode()).hexdigest()[:16]


def runs_page(api: Ratchet, status: str, agent: str, page: int) -> RunsPage:
    """One page of runs, newest first, of one status and/or agent, and the counts."""
    chosen = RunStatus(status) if status else None
    offset = (page - 1) * PAGE_SIZE
    if agent:
        found = [r for r in api.list(chosen, AGENT_SCAN_CAP) if r.agent == agent]
    else:
        found = api.list(chosen, offset + PAGE_SIZE + 1)
    counts = []
    for s in RunStatus:
        n = len(api.list(s, COUNT_CAP + 1))
        counts.append((s.value, f"{COUNT_CAP}+" if n > COUNT_CAP else str(n)))
    return RunsPage(
        records=found[offset : offset + PAGE_SIZE],
        counts=counts,
        status=status,
        agent=agent,
        page=page,
        has_next=len(found) > offset + PAGE_SIZE,
    )


@dataclass
class TimelineRow:
    seq: int
    at: str
    type: str
    summary: str


@dataclass
class RunPage:
    record: RunRecord
    usage: list[tuple[str, str]]
    times: list[str]
    transcript: tuple[Message, ...]
    timeline: list[TimelineRow]
    open_call: JournalEntry | None
    open_call_arguments: str
    suspension_arguments: str
    trace_id: str
    actions: list[str]
    continuation_id: str = field(default_factory=new_continuation_id)

    @property
    def version(self) -> str:
        """Changes whenever anything on the page would: the live update swaps on it."""
        return f"{self.record.status.value}:{self.record.last_seq}"


def run_page(api: Ratchet, run_id: str) -> RunPage:
    record = api.get(run_id)
    events: list[Event] = api.events(run_id)
    state = rebuild(events)
    entry = api.open_call(run_id) if record.status == RunStatus.NEEDS_RECONCILIATION else None
    u, b = record.usage, record.budgets
    usage = [
        ("turns", f"{u.model_turns} of {b.get('max_turns')} (attempts {u.model_attempts})"),
        (
            "tokens",
            f"{u.total_tokens} of {b.get('max_total_tokens') or '∞'} "
            f"(in {u.input_tokens}, out {u.output_tokens})",
        ),
        ("tool calls", f"{u.tool_calls} of {b.get('max_tool_calls')}"),
    ]
    suspension = record.suspension
    return RunPage(
        record=record,
        usage=usage,
        times=[line.split(None, 1)[1] for line in time_lines(record, time.time_ns() // 10**6)[:1]],
        transcript=state.transcript if state is not None else (),
        timeline=[TimelineRow(e.seq, when(e.at_ms), e.type, event_summary(e)) for e in events],
        open_call=entry,
        open_call_arguments=pretty(entry.arguments) if entry else "",
        suspension_arguments=pretty(suspension.arguments) if suspension else "",
        trace_id=f"{trace_id_of(record.run_id, record.created_at_ms):032x}",
        actions=[action.value for action in record.status.operator_actions],
    )
