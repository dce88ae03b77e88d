"""The message contract (tasks/messages.py) on a real worker and a real Redis broker.

Every ``enqueue_*`` function's message is taken by the in-process session worker
and does its work; a message the previous release sent (positional, no version
header) still does; a message of a newer version, or a malformed one, is set aside
with its reason and one WARNING line, and the worker goes on.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from runtime.models import RunStatus
from runtime.recovery import SWEEPER
from runtime.timers import wake_at_ms
from store.rejected import Rejected
from store.rejected.redis import RedisRejected
from store.runs import RunRecord
from tasks.messages import (
    VERSION_HEADER,
    enqueue_cancel,
    enqueue_continue,
    enqueue_deliver,
    enqueue_reconcile,
    enqueue_resume,
    enqueue_start,
    enqueue_sweep,
    enqueue_turn,
    enqueue_wake,
)
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.integration.test_broker_faults import alive, ready
from tests.integration.test_children import parent_agent
from tests.integration.test_continuations_on_real_workers import (
    ASK,
    client_app,
    finished,
    suspended,
    wait_for,
)
from tests.test_recovery import park_with_refund_in_flight, refund_agent
from tests.workers import WorkerProcesses, redis_context
from tests.workers import wait_for as wait_until
from worker.api import Ratchet

DONE = [turn("Done.")]


def new_id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:12]}"


def completed(ratchet: Ratchet, run_id: str) -> RunRecord:
    record = wait_for(ratchet.ctx, run_id, finished)
    assert record.status == RunStatus.COMPLETED, record.error
    return record


def event_types(ratchet: Ratchet, run_id: str) -> list[str]:
    return [event.type for event in ratchet.events(run_id)]


# --- every enqueue function, round trip ------------------------------------------------


def test_enqueue_start_starts_the_run_on_a_worker(ratchet: Ratchet, tmp_path: Path) -> None:
    run_id = new_id("start")
    enqueue_start(agent_file=str(write_agent(tmp_path, DONE)), text="hello", run_id=run_id)
    completed(ratchet, run_id)


def test_enqueue_turn_takes_the_run_s_turn(ratchet: Ratchet, tmp_path: Path) -> None:
    state = create_run(ratchet.ctx, write_agent(tmp_path, DONE), "hello", new_id("turn"))
    enqueue_turn(run_id=state.run_id, expected_seq=state.seq)
    completed(ratchet, state.run_id)


@pytest.mark.parametrize("urgent", [False, True])
def test_enqueue_resume_resumes_the_run(ratchet: Ratchet, tmp_path: Path, urgent: bool) -> None:
    state = create_run(ratchet.ctx, write_agent(tmp_path, DONE), "hello", new_id("resume"))
    enqueue_resume(run_id=state.run_id, by=SWEEPER, seen_seq=state.seq, urgent=urgent)
    completed(ratchet, state.run_id)
    resumed = [e for e in ratchet.events(state.run_id) if e.type == "run.resumed"]
    assert [e.data["by"] for e in resumed] == [SWEEPER]


def test_enqueue_continue_answers_the_suspended_run(ratchet: Ratchet, tmp_path: Path) -> None:
    run_id = ratchet.start(write_agent(tmp_path, ASK), "refund my order")
    asked = wait_for(ratchet.ctx, run_id, suspended)
    assert asked.suspension is not None
    enqueue_continue(run_id=run_id, input="Order B2", suspension_seq=asked.suspension.seq)
    completed(ratchet, run_id)
    assert "run.continued" in event_types(ratchet, run_id)


def test_enqueue_cancel_cancels_the_run(ratchet: Ratchet, tmp_path: Path) -> None:
    run_id = ratchet.start(write_agent(tmp_path, ASK), "refund my order")
    wait_for(ratchet.ctx, run_id, suspended)
    enqueue_cancel(run_id=run_id, reason="customer hung up")
    record = wait_for(ratchet.ctx, run_id, finished)
    assert record.status == RunStatus.CANCELLED


def test_enqueue_reconcile_lets_the_parked_run_go_on(ratchet: Ratchet, tmp_path: Path) -> None:
    run_id, call_id = park_with_refund_in_flight(ratchet.ctx, refund_agent(tmp_path))
    enqueue_reconcile(
        run_id=run_id, call_id=call_id, decision="result", result={"refunded_cents": 5}
    )
    completed(ratchet, run_id)
    assert "tool.reconciled" in event_types(ratchet, run_id)


def test_enqueue_sweep_resumes_an_orphaned_run(ratchet: Ratchet, tmp_path: Path) -> None:
    # Given a run whose first turn was never queued, and whose due time has passed
    state = create_run(ratchet.ctx, write_agent(tmp_path, DONE), "hello", new_id("sweep"))
    assert ratchet.ctx.runs.postpone(state.run_id, state.seq, ratchet.ctx.runs.clock() - 1)
    # When a sweep is sent, then the worker's sweeper finds it and it completes
    enqueue_sweep()
    completed(ratchet, state.run_id)


def test_enqueue_wake_wakes_a_waiting_run(
    ratchet: Ratchet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run that waits 1 s, whose turn schedules no wake-up of its own
    monkeypatch.setattr("tasks.turn.schedule_wake", lambda ctx, state: None)
    waits = [turn("Waiting.", call("wait", seconds=1, reason="courier")), turn("Done.")]
    agent = write_agent(tmp_path, waits, tools=["wait"])
    state = create_run(ratchet.ctx, agent, "hello", new_id("wake"))
    enqueue_turn(run_id=state.run_id, expected_seq=state.seq)
    record = wait_for(ratchet.ctx, state.run_id, lambda r: r.status == RunStatus.WAITING)
    assert record.suspension is not None
    due = wake_at_ms(record.suspension)
    wait_until("the wait is over", lambda: ratchet.ctx.runs.clock() >= due)
    # When its wake-up is sent, then it is woken and completes
    enqueue_wake(run_id=state.run_id, seq=record.last_seq)
    completed(ratchet, state.run_id)
    assert "run.woken" in event_types(ratchet, state.run_id)


def test_enqueue_deliver_tells_the_waiting_parent(
    ratchet: Ratchet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a parent waiting for a child whose end is not told by the child's own turn
    told: list[str] = []
    monkeypatch.setattr("tasks.held_run.tell_parent_soon", told.append)
    agent = parent_agent(
        tmp_path, [turn("Asking.", call("run_child", agent="toaster", input="B2")), turn("ok")]
    )
    state = create_run(ratchet.ctx, agent, "go", new_id("parent"))
    enqueue_turn(run_id=state.run_id, expected_seq=state.seq)
    wait_until("the child ended", lambda: len(told) == 1)
    assert ratchet.get(state.run_id).status.is_suspended
    # When the delivery is sent, then the parent is told and completes
    enqueue_deliver(child_id=told[0])
    completed(ratchet, state.run_id)


# --- the previous release's messages, and a newer release's -------------------------------


def test_messages_the_previous_release_sent_still_complete_a_run(
    ratchet: Ratchet, session_app: Celery, tmp_path: Path
) -> None:
    # Given messages as the previous release put them on the queue: positional
    # arguments, no version header (its `run_turn.apply_async((run_id, seq))`)
    agent = str(write_agent(tmp_path, DONE))
    started = new_id("old-start")
    session_app.send_task("ratchet.start", (agent, "hello", started), queue="ratchet.turns")
    turned = create_run(ratchet.ctx, Path(agent), "hello", new_id("old-turn"))
    session_app.send_task("ratchet.turn", (turned.run_id, turned.seq), queue="ratchet.turns")
    resumed = create_run(ratchet.ctx, Path(agent), "hello", new_id("old-resume"))
    session_app.send_task("ratchet.resume", (resumed.run_id, "operator"), queue="ratchet.turns")
    # Then this release's worker takes each to its end
    for run_id in (started, turned.run_id, resumed.run_id):
        completed(ratchet, run_id)


def rejected_with(session_app: Celery, task_id: str) -> Rejected | None:
    store = RedisRejected(redis.Redis.from_url(str(session_app.conf.broker_url)))
    found = [entry for entry in store.list() if f"[{task_id}]" in entry.reason]
    return found[0] if found else None


def set_aside_once(
    session_app: Celery, caplog: pytest.LogCaptureFixture, kwargs: dict[str, Any], version: int
) -> Rejected:
    """Send a ``ratchet.turn`` of ``version``; its rejected-message entry, once it has one WARNING."""

    def warnings() -> list[logging.LogRecord]:
        return [
            r for r in caplog.records if r.levelno >= logging.WARNING and sent.id in r.getMessage()
        ]

    with caplog.at_level(logging.WARNING):
        sent = session_app.send_task(
            "ratchet.turn", kwargs=kwargs, queue="ratchet.turns", headers={VERSION_HEADER: version}
        )
        wait_until("it is set aside", lambda: rejected_with(session_app, sent.id) is not None)
        # The worker logs its line once the entry is stored: after, not with, the entry.
        wait_until("its warning is logged", lambda: bool(warnings()))
    entry = rejected_with(session_app, sent.id)
    assert entry is not None
    lines = warnings()
    assert len(lines) == 1 and "message refused" in lines[0].getMessage(), lines
    assert "Traceback" not in caplog.text
    return entry


def test_a_message_of_a_newer_version_is_set_aside_naming_its_version(
    ratchet: Ratchet, session_app: Celery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = create_run(ratchet.ctx, write_agent(tmp_path, DONE), "hello", new_id("newer"))
    # Given a turn message of format version 2, from a newer release
    kwargs = {"run_id": state.run_id, "expected_seq": 1, "deadline_ms": 5}
    # Then the worker sets it aside unread, saying why, in one WARNING line
    entry = set_aside_once(session_app, caplog, kwargs, version=2)
    assert "message format version 2 is newer than this worker reads (0 to 1)" in entry.reason
    assert "upgrade this worker" in entry.reason
    assert ratchet.get(state.run_id).last_seq == state.seq
    # and the run goes on from the message this release sends
    enqueue_turn(run_id=state.run_id, expected_seq=state.seq)
    completed(ratchet, state.run_id)


def test_a_malformed_keyword_message_is_set_aside_with_one_warning_line(
    ratchet: Ratchet, session_app: Celery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = create_run(ratchet.ctx, write_agent(tmp_path, DONE), "hello", new_id("malformed"))
    # Given a version-1 keyword message with the seq as a string
    entry = set_aside_once(
        session_app, caplog, {"run_id": state.run_id, "expected_seq": "1"}, version=1
    )
    assert "argument `expected_seq` must be int | None, not str" in entry.reason
    assert "send ratchet.turn(run_id: str, expected_seq: int | None) by keyword" in entry.reason
    assert ratchet.get(state.run_id).last_seq == state.seq


@pytest.mark.slow
def test_a_prefork_pool_process_reads_each_message_s_version(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    # Given a `celery -A worker worker` whose tasks run in a pool process, not the consumer
    worker = worker_processes.start("--pool", "prefork", "--concurrency", "1")
    ready(worker)
    client = client_app(redis_url)
    ctx = redis_context(redis_url)
    try:
        # When a newer release's turn and this release's are sent
        newer = create_run(ctx, write_agent(tmp_path / "a", DONE), "hello", new_id("newer"))
        kwargs = {"run_id": newer.run_id, "expected_seq": newer.seq}
        sent = client.send_task(
            "ratchet.turn", kwargs=kwargs, queue="ratchet.turns", headers={VERSION_HEADER: 2}
        )
        state = create_run(ctx, write_agent(tmp_path / "b", DONE), "hello", new_id("current"))
        enqueue_turn(run_id=state.run_id, expected_seq=state.seq, app=client)
        # Then this release's completes its run, and the newer one is set aside by its version
        record = wait_for(ctx, state.run_id, finished, timeout_s=90)
        assert record.status == RunStatus.COMPLETED, record.error
        store = RedisRejected(redis.Redis.from_url(redis_url))
        wait_until("it is set aside", lambda: any(sent.id in e.reason for e in store.list()))
        (entry,) = [e for e in store.list() if sent.id in e.reason]
        assert "message format version 2 is newer than this worker reads" in entry.reason
        assert ctx.runs.get(newer.run_id).last_seq == newer.seq  # type: ignore[union-attr]
        alive(worker)
    finally:
        client.close()
        ctx.close()
