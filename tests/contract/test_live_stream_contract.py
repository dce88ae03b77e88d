"""The LiveStream contract (:mod:`store.conformance.live`) on every run store's live
stream: memory, SQLite (the embedded default's, a database beside the run store's) and
Redis (a Redis Stream per run). Below the suite: what only one backend can show."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from store.conformance.live import KEEP_S, MAXLEN, LiveStreamContract
from store.live import LiveStream
from store.runs.redis import RedisRunStore
from store.runs.sqlite import SqliteRunStore
from tests.contract.conftest import RUN_BACKENDS, FakeClock, open_run_store


class TestLiveStreams(LiveStreamContract):
    @pytest.fixture(params=RUN_BACKENDS)
    def live_stream(
        self, request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
    ) -> Iterator[LiveStream]:
        store = open_run_store(request.param, request, tmp_path, clock)
        stream = store.live()
        assert stream is not None, f"the {request.param} run store keeps no live stream"
        yield stream
        stream.close()
        store.close()


def test_a_redis_stream_sits_beside_its_runs_record_and_expires(redis_url: str) -> None:
    store = RedisRunStore.from_url(redis_url)
    stream = store.live()
    stream.add("run-tagged", [{"text": "hi"}], MAXLEN, KEEP_S)
    client = redis.Redis.from_url(redis_url)
    keys = [k.decode() for k in client.scan_iter(match="*run-tagged*")]
    # The run's hash tag: on a cluster it lives in the run's slot, next to its record.
    assert keys and all("{run-tagged}" in k for k in keys), keys
    assert 0 < client.pttl(keys[0]) <= KEEP_S * 1000
    client.close()
    store.close()


def test_another_process_reads_what_a_sqlite_stream_wrote(tmp_path: Path) -> None:
    store = SqliteRunStore(tmp_path / "runs.sqlite3")
    store.live().add("run-a", [{"text": "from the worker"}], MAXLEN, KEEP_S)
    program = (
        "import sys; from store.runs.sqlite import SqliteRunStore;"
        "print(SqliteRunStore(sys.argv[1]).live().read('run-a')[0].data['text'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path / "runs.sqlite3")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "from the worker"
    # Deltas never take the run store's lock: they are written to a database of their own.
    assert (tmp_path / "runs.live.sqlite3").exists()
    store.close()
