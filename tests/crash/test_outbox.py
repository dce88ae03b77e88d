"""The turn's last checkpoint pushes the next turn (a transactional outbox) on one Redis.

With the broker on the same redis-server as the run and snapshot stores, the
checkpoint that ends a turn (and releases its lease) LPUSHes the next turn's message
in the same script (store/runs/lua/append.lua): the entry is the one kombu's Redis
channel would push, in the broker's database, and the store's connection keeps its
own. A worker that dies right after that checkpoint (``turn.ended``) leaves the next
turn on the queue, so a healthy worker finishes the run without a sweeper; before the
outbox, the chain was lost there until the sweeper resumed the run.
"""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from runtime.actions import Advanced, TurnOutcome
from runtime.models import RunStatus
from store.runs.redis import RedisRunStore
from tasks.broker.next_turn import lean_turns
from tasks.delivery import redis_lists
from tasks.messages import VERSION, VERSION_HEADER
from tasks.queues import TURNS_QUEUE
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, calls_while, turn, write_agent
from tests.redis_server import RedisServer
from tests.test_publish import sent_in_a_task, without_ids
from tests.workers import WorkerProcess, redis_context, wait_for, worker_env
from worker.app import make_app

STORES_DB, BROKER_DB = 3, 4
HEADERS = {VERSION_HEADER: VERSION}
KWARGS = {"run_id": "outbox-1", "expected_seq": 5}


def app_on(url: str, tmp_path: Path) -> Celery:
    app = make_app(Settings(broker_url=url, data_dir=tmp_path / "data"))
    app.finalize()
    return app


def turns_on(client: redis.Redis) -> list[tuple[str, dict[str, Any]]]:
    """(list, entry) of every message on the turns queue, newest first in each list."""
    return [
        (name, json.loads(raw))
        for name in redis_lists(TURNS_QUEUE)
        for raw in client.lrange(name, 0, -1)
    ]


@pytest.mark.timeout(60)
def test_the_outbox_entry_is_the_one_kombu_would_push(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    redis_server.flush_db(BROKER_DB)
    app = app_on(f"{redis_server.url}/{BROKER_DB}", tmp_path)
    runs = RedisRunStore.from_url(f"{redis_server.url}/{STORES_DB}")
    broker = redis.Redis.from_url(f"{redis_server.url}/{BROKER_DB}")
    try:
        # Given one turn published by kombu and one prepared for the outbox, in one task
        lean = lean_turns(app)
        outbox = sent_in_a_task(
            app,
            lambda: (
                lean.publish(dict(KWARGS), TURNS_QUEUE, 7, dict(HEADERS)),
                lean.outbox(runs, dict(KWARGS), TURNS_QUEUE, 7, dict(HEADERS)),
            )[1],
        )
        # Then the outbox names the broker's database and the list kombu pushed onto
        assert outbox is not None
        [(listed, pushed)] = turns_on(broker)
        assert (outbox.outbox.db, outbox.outbox.key) == (BROKER_DB, listed)
        # And its entry is kombu's, key for key, in kombu's order, but for its own ids
        entry = json.loads(outbox.outbox.payload)
        assert list(entry) == list(pushed)
        assert list(entry["properties"]) == list(pushed["properties"])
        assert list(entry["headers"]) == list(pushed["headers"])
        assert without_ids(entry) == without_ids(pushed)
        body = json.loads(base64.b64decode(entry["body"]))
        assert body[1] == KWARGS
        assert entry["headers"]["argsrepr"] == "run_id='outbox-1', seq=5"
    finally:
        runs.close()
        broker.close()
        redis_server.flush_db(BROKER_DB)


@pytest.mark.timeout(60)
def test_no_outbox_for_another_server_or_outside_a_task(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    app = app_on(f"{redis_server.url}/{BROKER_DB}", tmp_path)
    elsewhere = RedisRunStore.from_url(f"redis://127.0.0.1:{redis_server.port + 1}/0")
    same = RedisRunStore.from_url(f"{redis_server.url}/{STORES_DB}")
    filesystem = app_on("", tmp_path)
    try:
        lean = lean_turns(app)
        kwargs = dict(KWARGS)
        assert lean.outbox(same, kwargs, TURNS_QUEUE, 7, {}) is None  # no running task
        assert (
            sent_in_a_task(app, lambda: lean.outbox(elsewhere, kwargs, TURNS_QUEUE, 7, {})) is None
        )
        assert (
            sent_in_a_task(
                filesystem,
                lambda: lean_turns(filesystem).outbox(same, kwargs, TURNS_QUEUE, None, {}),
            )
            is None
        )
        assert (
            sent_in_a_task(app, lambda: lean.outbox(same, kwargs, TURNS_QUEUE, 7, {})) is not None
        )
    finally:
        elsewhere.close()
        same.close()
        redis_server.flush_db(BROKER_DB)


def two_turn_agent(directory: Path) -> Path:
    return write_agent(
        directory, [turn("look", call("lookup_order", order_id="B2")), turn("Found it.")]
    )


@pytest.mark.timeout(60)
def test_the_turn_s_last_checkpoint_pushes_the_next_turn_into_the_broker_s_database(
    redis_server: RedisServer, tmp_path: Path, ledger: Path
) -> None:
    for db in (STORES_DB, BROKER_DB):
        redis_server.flush_db(db)
    app = app_on(f"{redis_server.url}/{BROKER_DB}", tmp_path)
    ctx = redis_context(f"{redis_server.url}/{STORES_DB}")
    broker = redis.Redis.from_url(f"{redis_server.url}/{BROKER_DB}")
    stores = redis.Redis.from_url(f"{redis_server.url}/{STORES_DB}")
    try:
        run_id = f"outbox-{uuid.uuid4().hex[:10]}"
        create_run(ctx, two_turn_agent(tmp_path), "find B2", run_id)
        # When turn 1 is taken inside a running task (as a worker takes it)
        taken: list[Advanced] = []
        reckoned = calls_while(
            lambda: taken.append(sent_in_a_task(app, lambda: advance(ctx, run_id, 1))),
            "turn_priority",
            "tasks/limits.py",
        )
        [done] = taken
        # Then its last checkpoint queued turn 2, in the broker's database only, at the
        # priority reckoned for it then (and only then),
        assert done.outcome == TurnOutcome.NEXT and done.queued
        assert reckoned == 1 and done.priority is None
        [(listed, entry)] = turns_on(broker)
        assert not turns_on(stores)
        body = json.loads(base64.b64decode(entry["body"]))
        assert body[1] == {"run_id": run_id, "expected_seq": done.seq}
        assert listed == redis_lists(TURNS_QUEUE)[entry["properties"]["priority"]]
        # And the store's connection still writes its own database: the run moved there
        record = ctx.runs.get(run_id)
        assert record is not None and record.last_seq == done.seq
        key = f"ratchet:run:{{{run_id}}}"
        assert stores.exists(f"{key}:record") == 1 and stores.exists(f"{key}:lease") == 0
        assert broker.exists(f"{key}:record") == 0  # the lease's release is in its place
    finally:
        ctx.close()
        broker.close()
        stores.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_dying_right_after_the_last_checkpoint_leaves_the_next_turn_queued(
    redis_server: RedisServer, tmp_path: Path, ledger: Path
) -> None:
    for db in (STORES_DB, BROKER_DB):
        redis_server.flush_db(db)
    stores = f"{redis_server.url}/{STORES_DB}"
    env = worker_env(stores, ledger, tmp_path / "data")
    env["RATCHET_BROKER_URL"] = f"{redis_server.url}/{BROKER_DB}"
    ctx = redis_context(stores)
    broker = redis.Redis.from_url(f"{redis_server.url}/{BROKER_DB}")
    dying = healthy = None
    try:
        run_id = f"outbox-{uuid.uuid4().hex[:10]}"
        create_run(ctx, two_turn_agent(tmp_path), "find B2", run_id)
        # Given a worker (the whole process: solo pool) armed to die once turn 1 has ended
        dying = WorkerProcess(
            {**env, "RATCHET_FAILPOINT": "turn.ended@1"}, tmp_path / "dying.log",
            ("--pool", "solo"),
        ).start()  # fmt: skip
        app_on(env["RATCHET_BROKER_URL"], tmp_path).send_task(
            "ratchet.turn", kwargs={"run_id": run_id, "expected_seq": 1},
            headers=dict(HEADERS), queue=TURNS_QUEUE,
        )  # fmt: skip
        # When it dies there
        assert dying.wait(60) == 137, dying.log()[-2000:]
        assert "failpoint turn.ended hit at turn 1" in dying.log()
        record = ctx.runs.get(run_id)
        assert record is not None and record.status.is_live and not record.status.is_terminal
        # Then the next turn is on the broker already, for the seq the run is at
        queued = [entry for _, entry in turns_on(broker)]
        assert len(queued) == 1, queued
        body = json.loads(base64.b64decode(queued[0]["body"]))
        assert body[1] == {"run_id": run_id, "expected_seq": record.last_seq}
        # And a healthy worker, with no sweeper anywhere, finishes the run
        healthy = WorkerProcess(env, tmp_path / "healthy.log", ("--pool", "solo")).start()

        def completed() -> bool:
            found = ctx.runs.get(run_id)
            return found is not None and found.status == RunStatus.COMPLETED

        wait_for("the healthy worker completes the run", completed, timeout_s=60)
        assert not [e for e in ctx.runs.events(run_id) if e.type == "run.resumed"]
    finally:
        for worker in (dying, healthy):
            if worker is not None:
                worker.kill()
        ctx.close()
        broker.close()
