"""What Flower, the logs and a client see: real ``celery -A worker worker`` subprocesses,
a real event receiver on the real broker, the worker's own log file."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection

from runtime.models import RunStatus
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcess, WorkerProcesses, redis_context
from worker.app import celery_config, make_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LOOKUP = [turn("look", call("lookup_order", order_id="B2")), turn("Done.")]


class Events:
    """A Celery event receiver on the broker, in a thread; keeps every event it sees."""

    def __init__(self, broker_url: str) -> None:
        self.app = make_app(Settings(broker_url=broker_url))
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.ready = threading.Event()

    def _on_event(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.seen.append(event)

    def _run(self) -> None:
        with self.app.connection_for_read() as connection:
            self.receiver = self.app.events.Receiver(connection, handlers={"*": self._on_event})
            self.ready.set()
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> Events:
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def __exit__(self, *_: Any) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(timeout=10)
        self.app.close()

    def wait_for(
        self, found: Callable[[dict[str, Any]], bool], timeout_s: float = 60
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                for event in self.seen:
                    if found(event):
                        return event
            time.sleep(0.05)
        with self.lock:
            kinds = sorted({e.get("type", "?") for e in self.seen})
        raise AssertionError(f"no such event in {timeout_s}s; seen types: {kinds}")


def send(broker_url: str, name: str, args: tuple[Any, ...] = ()) -> str:
    """Send as a client with task events on (its ``task-sent``), as the workers here have."""
    client = make_app(Settings(broker_url=broker_url, task_events=True))
    try:
        return str(client.send_task(name, args).id)
    finally:
        client.close()


def wait_run(ctx: Context, run_id: str, timeout_s: float = 60) -> RunStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = ctx.runs.get(run_id)
        if record is not None and record.status.is_terminal:
            return record.status
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} did not finish in {timeout_s}s")


@pytest.fixture
def ctx(redis_url: str) -> Iterator[Context]:
    context = redis_context(redis_url, lease_s=0.5)
    try:
        yield context
    finally:
        context.close()


def online(events: Events) -> None:
    events.wait_for(lambda e: e.get("type") in ("worker-online", "worker-heartbeat"))


def succeeded(task_id: str) -> Callable[[dict[str, Any]], bool]:
    """An event matcher: the task ``task_id`` succeeded."""
    return lambda e: e.get("type") == "task-succeeded" and e.get("uuid") == task_id


def ended(task_id: str) -> Callable[[dict[str, Any]], bool]:
    """An event matcher: the task ``task_id`` succeeded, or was rejected back to the queue."""
    return lambda e: (
        e.get("type") in ("task-succeeded", "task-rejected") and e.get("uuid") == task_id
    )


def started(task_id: str) -> Callable[[dict[str, Any]], bool]:
    """An event matcher: the task ``task_id`` started."""
    return lambda e: e.get("type") == "task-started" and e.get("uuid") == task_id


def log_lines(worker: WorkerProcess, needle: str) -> list[str]:
    return [line for line in worker.log().splitlines() if needle in line]


def test_a_worker_sends_task_events_when_on_with_readable_arguments_and_logs_run_ids(
    worker_processes: WorkerProcesses, redis_url: str, ctx: Context, tmp_path: Path
) -> None:
    with Events(redis_url) as events:
        worker = worker_processes.start(
            "--pool", "solo", RATCHET_LEASE_S="0.5", RATCHET_TASK_EVENTS="1"
        )
        online(events)
        run_id = create_run(ctx, write_agent(tmp_path, LOOKUP, name="desk"), "refund").run_id
        first = send(redis_url, "ratchet.turn", (run_id, 1))
        assert wait_run(ctx, run_id) == RunStatus.COMPLETED, worker.log()
        # Flower's view: every turn received and succeeded, named, with run, agent and seq.
        received = events.wait_for(
            lambda e: (
                e.get("type") == "task-received"
                and e.get("name") == "ratchet.turn"
                and f"run_id='{run_id}'" in str(e.get("args"))
                and "seq=" in str(e.get("args"))
                and "agent='desk'" in str(e.get("args"))
            )
        )
        events.wait_for(
            lambda e: e.get("type") == "task-succeeded" and e.get("uuid") == received["uuid"]
        )
        # The turn the client sent has its task-sent event too (a turn that a turn
        # chains does not: see the next test).
        events.wait_for(lambda e: e.get("type") == "task-sent" and e.get("uuid") == first)
        # Celery's own task lines name the run.
        assert any(f"(run {run_id})" in line for line in log_lines(worker, "ratchet.turn["))

        # Sweeps that find nothing leave no INFO line; one that finds an orphan does.
        empty = [send(redis_url, "ratchet.sweep") for _ in range(3)]
        for task_id in empty:
            events.wait_for(succeeded(task_id))
        assert log_lines(worker, "ratchet.sweep[") == [], log_lines(worker, "ratchet.sweep[")
        orphan = create_run(ctx, write_agent(tmp_path / "o", LOOKUP, name="desk"), "x").run_id
        deadline = time.monotonic() + 30
        while orphan not in ctx.runs.overdue() and time.monotonic() < deadline:
            time.sleep(0.05)
        found = send(redis_url, "ratchet.sweep")
        events.wait_for(lambda e: e.get("type") == "task-succeeded" and e.get("uuid") == found)
        assert wait_run(ctx, orphan) == RunStatus.COMPLETED
        sweep_lines = log_lines(worker, "ratchet.sweep[")
        # (Its "received" line stays at DEBUG: nothing is known then.)
        assert len(sweep_lines) == 1 and found in sweep_lines[0], sweep_lines
        assert "INFO" in sweep_lines[0] and sweep_lines[0].endswith(": 1")
        assert log_lines(worker, "sweep: 1 overdue run(s)")


def test_task_events_held_for_one_publish_all_arrive_even_from_a_stopping_worker(
    worker_processes: WorkerProcesses, redis_url: str, ctx: Context, tmp_path: Path
) -> None:
    # The worker gathers task events into one message per EVENTS_FLUSH_S (tasks.broker.consumer):
    # every turn's received and succeeded still reach a receiver, and a worker stopped
    # (SIGTERM) straight after the run ends publishes what it still holds.
    script = [turn(f"look {i}", call("lookup_order", order_id="B2")) for i in range(5)]
    with Events(redis_url) as events:
        worker = worker_processes.start(
            "--concurrency", "2", RATCHET_LEASE_S="0.5", RATCHET_TASK_EVENTS="1"
        )
        online(events)
        run_id = create_run(ctx, write_agent(tmp_path, [*script, turn("Done.")]), "x").run_id
        send(redis_url, "ratchet.turn", (run_id, 1))
        assert wait_run(ctx, run_id) == RunStatus.COMPLETED, worker.log()
        worker.signal(signal.SIGTERM)
        assert worker.wait(60) == 0, worker.log()
        events.wait_for(lambda e: e.get("type") == "worker-offline")

        with events.lock:
            received = {
                str(e["uuid"])
                for e in events.seen
                if e.get("type") == "task-received"
                and e.get("name") == "ratchet.turn"
                and f"run_id='{run_id}'" in str(e.get("args"))
            }
        # One task for each of the 6 model turns (the last one completes the run).
        assert len(received) == 6, sorted(received)
        for task_id in received:
            # Each task's last event reached the receiver: it succeeded or, if its pool
            # process was lost after its work (seen once under a full suite's load), it was
            # rejected back onto the queue; either is held and flushed like the rest.
            events.wait_for(ended(task_id), timeout_s=10)
            events.wait_for(started(task_id), timeout_s=10)
        # A turn a turn chains has no task-sent (tasks.broker.transport.RatchetAMQP): the pool
        # process would have published it before its task's task-succeeded, all seen now.
        # The first turn, sent by a client, has one.
        first = events.wait_for(
            lambda e: e.get("type") == "task-sent" and e.get("uuid") in received
        )
        with events.lock:
            sent = {str(e["uuid"]) for e in events.seen if e.get("type") == "task-sent"}
        assert sent & received == {first["uuid"]}, (sent & received, first)


def test_task_events_are_off_on_redis_unless_asked_for_and_on_elsewhere() -> None:
    redis, amqp = "redis://127.0.0.1:6379/0", "amqp://guest:guest@127.0.0.1:5672//"
    sent = {
        (url, events): celery_config(Settings(broker_url=url, task_events=events))
        for url in (redis, amqp, "")
        for events in ("auto", True, False)
    }
    on = {key for key, config in sent.items() if config["worker_send_task_events"]}
    assert all(c["worker_send_task_events"] == c["task_send_sent_event"] for c in sent.values())
    assert on == {(redis, True), (amqp, "auto"), (amqp, True), ("", "auto"), ("", True)}


def test_on_redis_a_worker_sends_task_events_once_a_monitor_enables_them_as_flower_does(
    worker_processes: WorkerProcesses, redis_url: str, ctx: Context, tmp_path: Path
) -> None:
    def received(run_id: str) -> Callable[[dict[str, Any]], bool]:
        return lambda e: (
            e.get("type") == "task-received" and f"run_id='{run_id}'" in str(e.get("args"))
        )

    with Events(redis_url) as events:
        # Given a worker on Redis with the default setting (auto: off there)
        worker = worker_processes.start("--pool", "solo", RATCHET_LEASE_S="0.5")
        online(events)
        agent = write_agent(tmp_path, LOOKUP, name="desk")
        before = create_run(ctx, agent, "refund").run_id
        send(redis_url, "ratchet.turn", (before, 1))
        assert wait_run(ctx, before) == RunStatus.COMPLETED, worker.log()
        # When a monitor sends `enable_events` (Flower does at start, and every few seconds)
        events.app.control.enable_events()
        after = create_run(ctx, agent, "refund").run_id
        send(redis_url, "ratchet.turn", (after, 1))
        assert wait_run(ctx, after) == RunStatus.COMPLETED, worker.log()
        # Then the later run's tasks are seen, and none of the earlier one's: the worker
        # publishes its events in order, so they would have come first
        events.wait_for(received(after))
        with events.lock:
            assert not any(received(before)(e) for e in events.seen)


def test_json_logs_carry_the_run_id_and_a_stopped_run_is_notified(
    worker_processes: WorkerProcesses, redis_url: str, ctx: Context, tmp_path: Path
) -> None:
    worker = worker_processes.start(
        "--pool",
        "threads",
        RATCHET_LOG_FORMAT="json",
        RATCHET_NOTIFY_TASK="myapp.run_stopped",
        RATCHET_NOTIFY_QUEUE="myapp.ratchet-runs",
    )
    run_id = create_run(ctx, write_agent(tmp_path, LOOKUP), "refund").run_id
    send(redis_url, "ratchet.turn", (run_id, 1))
    assert wait_run(ctx, run_id) == RunStatus.COMPLETED, worker.log()

    # The notification: a Celery task message on the client's queue.
    with Connection(redis_url) as connection:
        queue = connection.SimpleQueue("myapp.ratchet-runs")
        message = queue.get(timeout=60)
        assert message.headers["task"] == "myapp.run_stopped"
        args, kwargs, _ = message.decode()
        message.ack()
        queue.close()
    assert kwargs["run_id"] == run_id and kwargs["status"] == "completed"
    assert kwargs["output"] == "Done."

    documents = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        documents = [json.loads(line) for line in worker.log().splitlines() if line.startswith("{")]
        if any(d["logger"] == "ratchet.observe" for d in documents):
            break
        time.sleep(0.05)
    mine = [d for d in documents if d.get("run_id") == run_id]
    assert any(d["logger"] == "celery.app.trace" and "succeeded" in d["message"] for d in mine)
    assert any(d["logger"].startswith("ratchet.") for d in mine), documents
    assert all({"time", "level", "logger", "message", "run_id"} <= set(d) for d in documents)


def test_beat_sends_sweeps_without_an_info_line_each(
    redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    import subprocess
    import sys

    import redis as redis_client

    from tests.workers import worker_env

    env = worker_env(redis_url, ledger, tmp_path / "data", RATCHET_SWEEP_INTERVAL_S="0.2")
    log_path = tmp_path / "beat.log"
    with log_path.open("wb") as log:
        beat = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "worker",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                str(tmp_path / "schedule"),
            ],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        queue = redis_client.Redis.from_url(redis_url)
        deadline = time.monotonic() + 60
        while queue.llen("ratchet.control") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queue.llen("ratchet.control") >= 3, log_path.read_text()
    finally:
        beat.kill()
        beat.wait(timeout=30)
    text = log_path.read_text()
    assert "beat: Starting..." in text
    assert "Sending due task ratchet.sweep" not in text, text
