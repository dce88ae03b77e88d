"""Hostile and broken broker input on real workers: nothing on a queue may stop a worker.

Each test runs ``celery -A worker worker`` subprocesses configured by environment
variables, on a real Redis broker (or RabbitMQ), pushes what a careless or
hostile producer would, and then shows the same worker still takes the next
legitimate run to its end. What the worker refused is in the dead-letter store,
raw, with its reason and time, and ``ratchet rejected`` shows it.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from kombu import Connection, Queue

from runtime.models import RunStatus
from store.rejected import MAX_ENTRIES, MAX_MESSAGE_BYTES, Rejected
from store.rejected.folder import FolderRejected
from store.rejected.redis import RedisRejected
from tests.helpers import write_agent
from tests.integration.test_continuations_on_real_workers import (
    ASK,
    client_app,
    finished,
    publish_with_kombu,
    start_run_on,
    suspended,
    wait_for,
)
from tests.redis_server import running_redis_server
from tests.workers import (
    WorkerProcess,
    WorkerProcesses,
    ratchet_cli,
    redis_context,
    worker_env,
)
from tests.workers import wait_until as shared_wait_until

wait_until = partial(shared_wait_until, timeout_s=90)

pytestmark = pytest.mark.timeout(240)

CONTINUATIONS = "ratchet.continuations"
QUEUES = (CONTINUATIONS, "ratchet.turns", "ratchet.control")
T = TypeVar("T")


def bad_base64_envelope(queue: str) -> bytes:
    """kombu's Redis envelope, well formed but for a body that is not base64."""
    return json.dumps(
        {
            "body": "not base64!",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {},
            "properties": {
                "body_encoding": "base64",
                "delivery_tag": uuid.uuid4().hex,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
            },
        }
    ).encode()


def garbage(queue: str) -> list[bytes]:
    return [b"not-a-kombu-envelope", b"[1,2,3]", bad_base64_envelope(queue)]


def ready(worker: WorkerProcess) -> None:
    wait_until("the worker is ready", lambda: worker.process.poll() is not None  # type: ignore[union-attr]
               or " ready." in worker.log())  # fmt: skip
    assert worker.process is not None and worker.process.poll() is None, worker.log()


def entries_at_least(store: Any, count: int) -> Callable[[], list[Rejected] | None]:
    def found() -> list[Rejected] | None:
        entries: list[Rejected] = store.list(MAX_ENTRIES)
        return entries if len(entries) >= count else None

    return found


def alive(worker: WorkerProcess) -> None:
    assert worker.process is not None
    assert worker.process.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"


def a_run_completes(
    broker_url: str, store_url: str, directory: Path, answer: Callable[[str], None]
) -> None:
    """Start a run that asks a question, answer it with ``answer(run_id)``, see it complete."""
    ctx = redis_context(store_url)
    try:
        run_id = start_run_on(broker_url, ctx, write_agent(directory, ASK))
        wait_for(ctx, run_id, suspended, timeout_s=90)
        answer(run_id)
        record = wait_for(ctx, run_id, finished, timeout_s=90)
        assert record.status == RunStatus.COMPLETED, record.error
    finally:
        ctx.close()


def plain_json_answer(broker_url: str) -> Callable[[str], None]:
    def answer(run_id: str) -> None:
        publish_with_kombu(broker_url, {"run_id": run_id, "input": "B2", "continuation_id": "c-1"})

    return answer


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return ratchet_cli(env, *args, timeout_s=60)


# --- 1. garbage on every queue ------------------------------------------------------


def test_a_worker_survives_garbage_on_every_queue_and_then_completes_a_run(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    worker = worker_processes.start("--pool", "threads")
    ready(worker)
    client = redis.Redis.from_url(redis_url)
    # Given entries that are not kombu envelopes, pushed straight onto each queue
    pushed = {(queue, entry) for queue in QUEUES for entry in garbage(queue)}
    for queue, entry in sorted(pushed):
        client.lpush(queue, entry)
    # Then the worker sets every one aside, raw, and keeps running
    store = RedisRejected(client)
    entries = wait_until("all nine set aside", entries_at_least(store, len(pushed)))
    alive(worker)
    assert {(e.queue, e.raw_bytes()) for e in entries} == pushed
    assert all(e.reason.startswith("not a kombu message: ") for e in entries)
    reasons = " | ".join(e.reason for e in entries)
    assert "not JSON" in reasons and "JSON list, not a kombu envelope" in reasons
    assert "the body cannot be decoded as 'base64'" in reasons
    # And the same worker takes the next legitimate run to its end
    a_run_completes(redis_url, redis_url, tmp_path, plain_json_answer(redis_url))
    alive(worker)
    assert "Unrecoverable error" not in worker.log()


# --- 2. the dead-letter store ----------------------------------------------------------


def raw_celery_message(broker_url: str, queue: str, body: bytes, content_type: str) -> None:
    """A Celery protocol-2 turn message whose body is in ``content_type`` (never decoded here)."""
    with Connection(broker_url) as connection:
        connection.Producer().publish(
            body,
            exchange=queue,
            routing_key=queue,
            declare=[Queue(queue)],
            content_type=content_type,
            content_encoding="binary",
            headers={"task": "ratchet.turn", "id": uuid.uuid4().hex, "lang": "py"},
        )


def test_every_kind_of_refused_message_is_kept_raw_with_reason_and_time_and_shown_by_the_cli(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    worker = worker_processes.start("--pool", "threads")
    ready(worker)
    client = redis.Redis.from_url(redis_url)
    started_ms = int(time.time() * 1000)
    # Given one message of each kind ratchet refuses
    raw_celery_message(
        redis_url, "ratchet.turns", b"\x80\x04not really pickle", "application/x-python-serialize"
    )
    sender = client_app(redis_url)
    sender.send_task("ratchet.no-such-task", ("x",))
    sender.send_task("ratchet.turn", ("run-1", "5"))
    sender.close()
    oversize = b"x" * (MAX_MESSAGE_BYTES + 1)
    client.lpush("ratchet.turns", oversize)
    publish_with_kombu(redis_url, {"input": "no run id"})
    # Then each is set aside with its reason
    store = RedisRejected(client)
    entries = wait_until("five set aside", entries_at_least(store, 5))
    alive(worker)
    reasons = {e.reason: e for e in entries}
    assert len(reasons) == 5, list(reasons)

    def one(fragment: str) -> Rejected:
        found = [e for reason, e in reasons.items() if fragment in reason]
        assert len(found) == 1, (fragment, list(reasons))
        return found[0]

    one("invalid task message (ContentDisallowed")
    one("unknown task 'ratchet.no-such-task'")
    one("argument `expected_seq` must be int | None, not str")
    big = one(f"over the {MAX_MESSAGE_BYTES}-byte limit")
    assert (
        big.size == len(oversize)
        and big.truncated
        and big.raw_bytes() == oversize[: len(big.raw_bytes())]
    )
    one("`run_id` is missing")
    assert all(started_ms - 1000 <= e.at_ms <= int(time.time() * 1000) for e in entries)

    # And the CLI lists them, shows one raw, and purges them
    env = {**worker.env}
    listed = cli(env, "rejected", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {e["id"] for e in json.loads(listed.stdout)} == {e.id for e in entries}
    table = cli(env, "rejected", "list")
    assert "unknown task 'ratchet.no-such-task'" in table.stdout
    pickle_entry = one("ContentDisallowed")
    shown = cli(env, "rejected", "show", pickle_entry.id, "--json")
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    envelope = json.loads(base64.b64decode(document["raw"]))
    assert envelope["content-type"] == "application/x-python-serialize"
    assert base64.b64decode(envelope["body"]) == b"\x80\x04not really pickle"
    missing = cli(env, "rejected", "show", "1234567890123-0123456789ab")
    assert missing.returncode == 1 and "no rejected message" in missing.stderr
    purged = cli(env, "rejected", "purge", "--yes")
    assert purged.returncode == 0 and "purged 5 rejected message(s)" in purged.stdout
    assert store.list() == []
    # And a legitimate run still goes through the same worker
    a_run_completes(redis_url, redis_url, tmp_path, plain_json_answer(redis_url))
    alive(worker)


def test_the_redis_dead_letter_list_keeps_the_newest_entries_only(redis_url: str) -> None:
    store = RedisRejected(redis.Redis.from_url(redis_url))
    for n in range(MAX_ENTRIES + 10):
        store.add(Rejected.new(str(n).encode(), "test", "q"))
    kept = store.list(MAX_ENTRIES + 10)
    assert len(kept) == MAX_ENTRIES
    assert kept[0].raw_bytes() == str(MAX_ENTRIES + 9).encode()
    assert kept[-1].raw_bytes() == b"10"


def test_the_dead_letter_folder_keeps_the_newest_entries_only(tmp_path: Path) -> None:
    store = FolderRejected(tmp_path / "rejected")
    for n in range(MAX_ENTRIES + 3):
        store.add(Rejected.new(str(n).encode(), "test", "q"))
    kept = store.list(MAX_ENTRIES + 3)
    assert len(kept) == MAX_ENTRIES
    assert {e.raw_bytes() for e in kept} == {str(n).encode() for n in range(3, MAX_ENTRIES + 3)}
    assert not [p for p in (tmp_path / "rejected").iterdir() if not p.name.endswith(".json")]


def test_entries_set_aside_within_one_millisecond_keep_their_order() -> None:
    # Several entries land in each millisecond here; a random id suffix ordered those at
    # random, and the folder's pruning (newest by name) then dropped newer ones.
    ids = [Rejected.new(b"{}", "test", "q").id for _ in range(2000)]
    assert len({i[:13] for i in ids}) < len(ids)  # the premise: some share a millisecond
    assert sorted(ids) == ids


def test_refused_messages_on_rabbitmq_go_to_a_bounded_queue_and_the_cli_reads_it(
    worker_processes: WorkerProcesses, rabbitmq_vhost: str, redis_url: str, tmp_path: Path
) -> None:
    worker = worker_processes.start("--pool", "threads", RATCHET_BROKER_URL=rabbitmq_vhost)
    ready(worker)
    publish_with_kombu(rabbitmq_vhost, ["not", "an", "object"])
    sender = client_app(rabbitmq_vhost)
    sender.send_task("ratchet.cancel", kwargs={"run_id": "r1", "colour": "red"})
    sender.close()
    env = {**worker.env, "RATCHET_BROKER_URL": rabbitmq_vhost}

    def listed() -> list[dict[str, Any]] | None:
        result = cli(env, "rejected", "list", "--json")
        assert result.returncode == 0, result.stderr
        entries: list[dict[str, Any]] = json.loads(result.stdout)
        return entries if len(entries) >= 2 else None

    entries = wait_until("two set aside on RabbitMQ", listed)
    reasons = sorted(e["reason"] for e in entries)
    assert any("the body is a JSON array" in r for r in reasons), reasons
    assert any("task ratchet.cancel" in r and "unexpected argument `colour`" in r for r in reasons)
    # Reading the queue gives every entry back; the queue is bounded by the broker
    assert len(listed() or []) == 2
    with Connection(rabbitmq_vhost) as connection:
        declared = connection.default_channel.queue_declare("ratchet.rejected", passive=True)
        assert declared.message_count == 2
    a_run_completes(rabbitmq_vhost, redis_url, tmp_path, plain_json_answer(rabbitmq_vhost))
    alive(worker)


# --- 4. reconnects --------------------------------------------------------------------


def test_a_redis_broker_restart_reconnects_without_an_error_and_the_worker_carries_on(
    ledger: Path, tmp_path: Path
) -> None:
    with running_redis_server(tmp_path) as server:
        url = f"{server.url}/0"
        processes = WorkerProcesses(worker_env(url, ledger, tmp_path / "data"), tmp_path)
        try:
            worker = processes.start("--pool", "threads")
            ready(worker)
            connected = worker.log().count("Connected to")
            # When the broker goes away and comes back on the same port
            server.restart()
            wait_until(
                "the worker reconnects",
                lambda: worker.log().count("Connected to") > connected,
                timeout_s=120,
            )
            # Then it says so without an error, and takes the next run to its end
            a_run_completes(url, url, tmp_path, plain_json_answer(url))
            alive(worker)
            log = worker.log()
            assert "Error on restarting" not in log, log
            assert "connection_errors" not in log
        finally:
            processes.stop_all()


# --- 5. malformed task arguments ------------------------------------------------------


def test_malformed_task_arguments_log_one_line_each_and_are_set_aside(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    worker = worker_processes.start("--pool", "threads")
    ready(worker)
    sender = client_app(redis_url)
    # Given task messages a careless client sends: missing, mistyped, extra
    sender.send_task("ratchet.turn", ("run-1",))
    sender.send_task("ratchet.turn", (42, 1))
    sender.send_task("ratchet.continue", kwargs={"run_id": "run-1", "input": "x", "colour": "red"})
    sender.send_task("ratchet.turn", ("../../etc/passwd", 1))
    sender.close()
    store = RedisRejected(redis.Redis.from_url(redis_url))
    entries = wait_until("four set aside", entries_at_least(store, 4))
    alive(worker)
    expected = [
        "task ratchet.turn[", "argument `expected_seq` is missing",
        "argument `run_id` must be str, not int",
        "unexpected argument `colour`",
        "run id",
    ]  # fmt: skip
    reasons = " | ".join(e.reason for e in entries)
    for fragment in expected:
        assert fragment in reasons, reasons
    assert "send ratchet.turn(run_id: str, expected_seq: int | None)" in reasons
    a_run_completes(redis_url, redis_url, tmp_path, plain_json_answer(redis_url))
    log = worker.log()
    refusals = [line for line in log.splitlines() if "message refused: task ratchet." in line]
    assert len(refusals) == 4, refusals
    assert "Traceback" not in log, log
    assert "TypeError" not in log


def celery_message(broker_url: str, body: Any, **headers: Any) -> None:
    """A JSON message on the turns queue with Celery's headers, body of any shape."""
    with Connection(broker_url) as connection:
        connection.Producer().publish(
            body,
            exchange="ratchet.turns",
            routing_key="ratchet.turns",
            declare=[Queue("ratchet.turns")],
            serializer="json",
            headers={"task": "ratchet.turn", "lang": "py", **headers},
        )


def test_a_task_message_whose_body_or_headers_celery_cannot_read_is_set_aside(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    worker = worker_processes.start("--pool", "threads")
    ready(worker)
    # Given task messages in a valid envelope that are not Celery protocol 2 inside
    celery_message(redis_url, "x", id=uuid.uuid4().hex)
    celery_message(redis_url, {"a": 1}, id=uuid.uuid4().hex)
    celery_message(redis_url, [["r1", 1], {}, {}])
    celery_message(redis_url, [["r1", 1], {}, {}], id=uuid.uuid4().hex, eta="garbage")
    # Then each is set aside, once (not restored to kill the next worker), and the
    # worker goes on to complete a run
    store = RedisRejected(redis.Redis.from_url(redis_url))
    entries = wait_until("four set aside", entries_at_least(store, 4))
    alive(worker)
    reasons = " | ".join(e.reason for e in entries)
    assert "the body must be a JSON array [args, kwargs, embed]" in reasons
    assert "the `id` header must be a non-empty string" in reasons
    assert "the `eta` header 'garbage' is not an ISO 8601 time" in reasons
    a_run_completes(redis_url, redis_url, tmp_path, plain_json_answer(redis_url))
    alive(worker)
    assert len(store.list()) == 4
    assert "Unrecoverable error" not in worker.log()
