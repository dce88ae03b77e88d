"""What the broker's own structures hold can be hostile too (issue 30, item 3).

kombu's unacked hash on the broker's Redis, and a message's compression header,
are read inside the worker's consumer loop; on real workers, neither may end or
bloat the worker: what cannot be restored or decompressed is set aside once in
the refused-message store (`ratchet rejected`), and the worker lives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from runtime.models import RunStatus
from tasks.rejected import REDIS_KEY, RedisRejected
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import turn, write_agent
from tests.workers import WorkerProcesses, redis_context, run_status, wait_for
from worker.app import make_app

pytestmark = pytest.mark.slow

GARBAGE = {
    "t-garbage": b"garbage",  # JSONDecodeError in kombu's restore_by_tag
    "t-short": b"[[1],2]",  # ValueError: not enough values to unpack
    "t-not-a-message": b'[1, "ratchet.turns", "ratchet.turns"]',  # kombu logged and lost it
}


def enqueue_turn(broker_url: str, run_id: str) -> None:
    app = make_app(Settings(broker_url=broker_url))
    app.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
    app.close()


@pytest.mark.timeout(120)
def test_garbage_in_kombus_unacked_hash_is_set_aside_once_and_every_worker_lives(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url)
    # Given entries in kombu's unacked hash that are not [envelope, exchange, routing_key],
    # each in the index as long overdue
    for tag, value in GARBAGE.items():
        client.hset("unacked", tag, value)
        client.zadd("unacked_index", {tag: 1.0})
    # When two workers start on that broker
    workers = [worker_processes.start("--concurrency", "1") for _ in range(2)]
    # Then the entries leave the hash and its index, each set aside exactly once
    wait_for("the entries are gone", lambda: client.hlen("unacked") == 0, timeout_s=60)
    assert client.zcard("unacked_index") == 0
    wait_for("they are set aside", lambda: client.llen(REDIS_KEY) >= len(GARBAGE))
    entries = RedisRejected(client).list()
    assert sorted(e.raw_bytes() for e in entries) == sorted(GARBAGE.values())
    assert all(e.queue == "unacked" and "cannot be restored" in e.reason for e in entries)
    # and both workers live and run a run to the end
    ctx = redis_context(redis_url)
    agent = write_agent(tmp_path, [turn("done")])
    run_id = create_run(ctx, agent, "hello").run_id
    enqueue_turn(redis_url, run_id)
    wait_for("the run completes", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED)
    for worker in workers:
        assert worker.process is not None and worker.process.poll() is None, worker.log()
        assert "Unrecoverable error" not in worker.log()
    assert client.llen(REDIS_KEY) == len(GARBAGE)
    assert json.loads(client.lindex(REDIS_KEY, 0) or b"{}")["queue"] == "unacked"  # type: ignore[arg-type]
    ctx.close()
    client.close()
