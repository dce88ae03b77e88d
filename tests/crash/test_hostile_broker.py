"""What the broker's own structures hold can be hostile too (issue 30, item 3).

kombu's unacked hash on the broker's Redis, and a message's compression header,
are read inside the worker's consumer loop; on real workers, neither may end or
bloat the worker: what cannot be restored or decompressed is set aside once in
the refused-message store (`ratchet rejected`), and the worker lives.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path

import pytest
import redis

from runtime.models import RunStatus
from store.rejected import REDIS_KEY
from store.rejected.redis import RedisRejected
from tasks.broker.compression import MAX_DECOMPRESSED_BYTES
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import turn, write_agent
from tests.workers import WorkerProcess, WorkerProcesses, redis_context, run_status, wait_for
from worker.app import make_app

pytestmark = pytest.mark.slow

GARBAGE: dict[bytes, bytes] = {
    b"t-garbage": b"garbage",  # JSONDecodeError in kombu's restore_by_tag
    b"t-short": b"[[1],2]",  # ValueError: not enough values to unpack
    b"t-not-a-message": b'[1, "ratchet.turns", "ratchet.turns"]',  # kombu logged and lost it
    b"t-\xff": b"\xff\xfe not UTF-8",  # neither the tag nor the entry is UTF-8
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
    ctx.close()
    client.close()


def zlib_of_zeros(mib: int) -> bytes:
    """The zlib stream of ``mib`` MiB of zeros, made without compressing them all (~0.1 s):
    1 MiB blocks, each ending on a full flush (so each is the same bytes), and the
    Adler-32 of the whole (a = 1, b = the length, for zeros)."""
    compressor = zlib.compressobj(9)
    chunk = bytes(1 << 20)
    head = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    end = compressor.flush(zlib.Z_FINISH)[:-4]
    length = mib << 20
    return head + block * (mib - 1) + end + struct.pack(">I", (length % 65521) << 16 | 1)


def test_the_bomb_is_the_zlib_of_zeros() -> None:
    assert zlib.decompress(zlib_of_zeros(9)) == bytes(9 << 20)


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def ready(worker: WorkerProcess) -> None:
    wait_for("the worker is ready", lambda: " ready." in worker.log())


BOMB_MIB = 2048
"""The issue's bomb: 2 GiB of zeros, 2.1 MB of zlib, 2.8 MB as a queue entry."""
PEAK_GROWTH_BYTES = 64 << 20
"""The most the worker's main process may grow while it refuses the bomb (measured: ~15 MiB)."""


@pytest.mark.timeout(120)
def test_a_decompression_bomb_is_set_aside_and_the_workers_peak_memory_stays_bounded(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url)
    # Given a real turn message, compressed, whose body is swapped for 2 GiB of zeros in zlib
    app = make_app(Settings(broker_url=redis_url))
    app.send_task("ratchet.turn", kwargs={"run_id": "bomb"}, queue="staging", compression="zlib")
    app.close()
    keys: list[bytes] = client.keys("staging\x06*")  # type: ignore[assignment]
    (key,) = keys  # its list, named with the message's priority step
    entry = json.loads(client.rpop(key))  # type: ignore[arg-type]
    assert entry["headers"]["compression"] == "application/x-gzip"
    entry["body"] = base64.b64encode(zlib_of_zeros(BOMB_MIB)).decode()
    entry["properties"]["delivery_info"]["routing_key"] = "ratchet.turns"
    raw = json.dumps(entry).encode()
    assert len(raw) < MAX_DECOMPRESSED_BYTES  # under the entry cap: only its inflation is not
    # and a worker, ready
    worker = worker_processes.start("--concurrency", "1")
    ready(worker)
    assert worker.process is not None
    before = peak_rss_bytes(worker.process.pid)
    # When the bomb arrives on ratchet.turns
    client.lpush(key.replace(b"staging", b"ratchet.turns"), raw)
    # Then it is set aside, and the worker's main process grew by less than the bound
    wait_for("the bomb is set aside", lambda: client.llen(REDIS_KEY) == 1)
    growth = peak_rss_bytes(worker.process.pid) - before
    assert growth < PEAK_GROWTH_BYTES, f"peak RSS grew {growth >> 20} MiB"
    # saying why
    (rejected,) = RedisRejected(client).list()
    assert "inflates past 4194304 bytes" in rejected.reason, rejected.reason
    assert rejected.queue == "ratchet.turns" and rejected.size > 2_000_000
    # and the worker goes on: a run completes
    ctx = redis_context(redis_url)
    run_id = create_run(ctx, write_agent(tmp_path, [turn("done")]), "hello").run_id
    enqueue_turn(redis_url, run_id)
    wait_for("the run completes", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED)
    assert worker.process.poll() is None
    print(f"peak RSS of the worker's main process: {before >> 20} MiB, +{growth >> 20} MiB")
    ctx.close()
    client.close()
