"""How the run-store suites build runs: records, events, and runs created with both."""

from __future__ import annotations

from typing import Any

from runtime.models import Event, RunStatus
from store.conformance.support import T0_MS
from store.runs import RunRecord, RunStore

LEASE_S = 30
LEASE_MS = LEASE_S * 1000


def record(
    run_id: str,
    last_seq: int = 1,
    status: RunStatus = RunStatus.QUEUED,
    created_at_ms: int = T0_MS,
    due_at_ms: int | None = None,
    **fields: Any,
) -> RunRecord:
    return RunRecord(
        run_id=run_id,
        agent="echo",
        agent_file="agents/echo.toml",
        status=status,
        created_at_ms=created_at_ms,
        updated_at_ms=created_at_ms,
        last_seq=last_seq,
        input="say hello",
        due_at_ms=due_at_ms,
        **fields,
    )


def created(run_id: str, at_ms: int = T0_MS) -> Event:
    return Event(seq=1, type="run.created", at_ms=at_ms, data={"run_id": run_id, "input": "hi"})


def event(seq: int, type_: str = "model.requested", **data: Any) -> Event:
    return Event(seq=seq, type=type_, at_ms=T0_MS + seq, data=data)


def new_run(
    store: RunStore,
    run_id: str,
    created_at_ms: int = T0_MS,
    due_at_ms: int | None = T0_MS + 60_000,
    status: RunStatus = RunStatus.QUEUED,
) -> RunRecord:
    first = record(run_id, status=status, created_at_ms=created_at_ms, due_at_ms=due_at_ms)
    store.create(first, created(run_id, created_at_ms))
    return first


def unchanged(store: RunStore, run_id: str) -> tuple[RunRecord | None, list[Event]]:
    return store.get(run_id), store.events(run_id)
