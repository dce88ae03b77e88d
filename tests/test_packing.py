"""Stored payloads: compressed against a preset dictionary, and every format ever written reads."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import closing

import pytest
import redis

from runtime.models import RunStatus
from store.packing import (
    DICTIONARY_V1,
    MIN_BYTES,
    THREADED_MIN_BYTES,
    is_packed,
    pack,
    plain_below,
    unpack,
)
from tests.workers import (
    EXAMPLE_AGENT,
    WorkerProcesses,
    redis_context,
    run_on_workers,
    wait_for,
)

EVENT = b'{"seq":12,"type":"model.requested","at_ms":1795965970661,"data":{"turn":4}}'


def test_a_small_event_packs_to_a_fraction_and_back() -> None:
    packed = pack(EVENT)
    assert len(packed) < len(EVENT) // 2
    assert unpack(packed, 1 << 20) == EVENT


def test_values_written_before_compression_or_before_the_dictionary_still_read() -> None:
    plain_zlib = zlib.compress(EVENT * 4, 6)  # what packing wrote before the dictionary
    assert unpack(plain_zlib, 1 << 20) == EVENT * 4
    assert unpack(EVENT, 1 << 20) == EVENT  # stored as is


def test_a_stream_naming_a_dictionary_this_build_lacks_is_refused() -> None:
    compressor = zlib.compressobj(9, zdict=DICTIONARY_V1 + b"another")
    stream = compressor.compress(EVENT) + compressor.flush()
    with pytest.raises(ValueError, match="dictionary this build does not have"):
        unpack(stream, 1 << 20)


def test_a_value_that_would_inflate_past_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="inflates past"):
        unpack(pack(b"{" + b" " * 10_000 + b"}"), 1000)


# --- what a worker stores, by its pool -------------------------------------------------


@pytest.fixture
def default_threshold() -> Iterator[None]:
    yield
    plain_below(MIN_BYTES)


def test_a_process_told_to_store_short_values_as_they_are_packs_only_longer_ones(
    default_threshold: None,
) -> None:
    long = b'{"content": "' + b"the order is on its way " * 60 + b'"}'
    plain_below(THREADED_MIN_BYTES)
    assert pack(EVENT) == EVENT
    assert is_packed(pack(long)) and unpack(pack(long), 1 << 20) == long
    plain_below(0)  # never below what zlib's header allows
    assert pack(b"{}") == b"{}" and is_packed(pack(EVENT))


def stored_values(url: str) -> list[bytes]:
    """Every value in the Redis database at ``url``: strings, list items, hash and set members."""
    client = redis.Redis.from_url(url)
    values: list[bytes] = []
    for key in client.scan_iter(count=500):
        kind = client.type(key)
        if kind == b"string":
            values.append(client.get(key) or b"")
        elif kind == b"list":
            values += client.lrange(key, 0, -1)
        elif kind == b"hash":
            values += client.hvals(key)
        elif kind == b"zset":
            values += client.zrange(key, 0, -1)
        elif kind == b"set":
            values += client.smembers(key)
    client.close()
    return values


@pytest.mark.slow
@pytest.mark.parametrize(("pool", "short_ones_packed"), [("threads", False), ("prefork", True)])
def test_a_threads_worker_stores_its_short_values_as_they_are_and_a_prefork_one_packs_them(
    pool: str,
    short_ones_packed: bool,
    redis_url: str,
    worker_processes: WorkerProcesses,
) -> None:
    # Given a worker of the pool, two turns at once, on Redis stores
    worker = worker_processes.start("--pool", pool, "--concurrency", "2")
    wait_for("the worker is ready", lambda: "ready." in worker.log(), timeout_s=60)
    # When a run of a tool call goes through it
    record = run_on_workers(redis_url, EXAMPLE_AGENT, "Refund order B2", timeout_s=30)
    assert record.status == RunStatus.COMPLETED
    # Then what the worker wrote under 1 KiB is stored packed (prefork) or as it is
    # (threads); the run's first event, written by this process, is packed either way
    values = stored_values(redis_url)
    events = [unpack(value, 1 << 24) for value in values if b'"type":' in unpack(value, 1 << 24)]
    assert any(b'"type":"tool.completed"' in event for event in events), events
    short_packed = [
        unpack(value, 1 << 24)[:60]
        for value in values
        if is_packed(value)
        and len(unpack(value, 1 << 24)) < THREADED_MIN_BYTES
        and not unpack(value, 1 << 24).startswith(b'{"seq":1,')
    ]
    assert bool(short_packed) == short_ones_packed, short_packed
    # And either way every event reads back as the run's history
    with closing(redis_context(redis_url)) as ctx:
        kinds = [event.type for event in ctx.runs.events(record.run_id)]
    assert kinds[0] == "run.created" and kinds[-1] == "run.completed"
