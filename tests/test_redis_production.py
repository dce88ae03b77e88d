"""The Redis stores as a production deployment uses them: a key prefix, passwords, a dead server."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from runtime.errors import StoreError, StoreUnavailable
from runtime.models import Event
from store import open_run_store, open_snapshot_store
from store.runs import RunRecord
from store.runs.redis import RedisRunStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.settings import Settings
from tests.contract.test_snapshot_store_contract import make_state
from tests.redis_server import HOST, _binary, _free_port, running_redis_server

PASSWORD = "s3cr3t-pa55"


def first_event(run_id: str) -> tuple[RunRecord, Event]:
    state = make_state(run_id)
    record = RunRecord.from_state(state.model_copy(update={"seq": 1}), 1, None)
    return record, Event(seq=1, type="run.created", at_ms=1, data={"run_id": run_id})


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A redis-server of our own with a default-user password and an ACL user."""
    directory = tmp_path_factory.mktemp("secured-redis")
    port = _free_port()
    command = [
        _binary(), "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
        "--dir", str(directory), "--requirepass", PASSWORD,
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        admin = redis.Redis(host=HOST, port=port, password=PASSWORD)
        while True:
            try:
                admin.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        admin.execute_command(
            "ACL", "SETUSER", "ratchet", "on", ">worker-pa55", "~ratchet:*",
            "+@all",
        )  # fmt: skip
        admin.close()
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize(
    "userinfo", [f":{PASSWORD}", "ratchet:worker-pa55"], ids=["requirepass", "acl-user"]
)
def test_both_stores_work_through_a_url_with_credentials(secured_redis: int, userinfo: str) -> None:
    url = f"redis://{userinfo}@{HOST}:{secured_redis}/2"
    snapshots = open_snapshot_store(url)
    runs = open_run_store(url)
    try:
        snapshots.save(make_state(seq=1), expected_seq=None)
        record, event = first_event("run-1")
        runs.create(record, event)

        assert snapshots.load("run-1") == make_state(seq=1)
        assert runs.events("run-1", after_seq=0) == [event]
    finally:
        snapshots.delete("run-1")
        snapshots.close()
        runs.close()


def test_a_wrong_password_is_refused_without_showing_it(secured_redis: int) -> None:
    store = open_snapshot_store(f"redis://ratchet:not-the-pa55@{HOST}:{secured_redis}/2")

    with pytest.raises(StoreError) as refused:
        store.load("run-1")

    assert "not-the-pa55" not in str(refused.value)
    assert "ratchet:***@" in str(refused.value)


def test_a_rediss_url_opens_a_tls_connection_pool() -> None:
    store = open_snapshot_store(f"rediss://:{PASSWORD}@{HOST}:6380/0?ssl_cert_reqs=required")
    assert isinstance(store, RedisSnapshotStore)

    pool = store._client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert PASSWORD not in store._where


def test_the_key_prefix_setting_keeps_two_deployments_apart(redis_url: str) -> None:
    # Given two deployments sharing one database, told apart by RATCHET_REDIS_PREFIX
    fleets = {}
    for prefix in ("fleet-a", "fleet-b"):
        settings = Settings(redis_prefix=prefix)
        fleets[prefix] = (
            open_snapshot_store(redis_url, redis_prefix=settings.redis_prefix),
            open_run_store(redis_url, redis_prefix=settings.redis_prefix),
        )
    snapshots_a, runs_a = fleets["fleet-a"]
    snapshots_b, runs_b = fleets["fleet-b"]

    # When fleet A checkpoints and records a run
    snapshots_a.save(make_state(seq=1), expected_seq=None)
    record, event = first_event("run-1")
    runs_a.create(record, event)

    # Then fleet B sees none of it, and every key A wrote starts with its prefix
    assert snapshots_b.list() == [] and snapshots_b.load("run-1") is None
    assert runs_b.get("run-1") is None
    assert snapshots_a.list() == ["run-1"] and runs_a.get("run-1") is not None
    client = redis.Redis.from_url(redis_url)
    keys = {k.decode() if isinstance(k, bytes) else k for k in client.keys("*")}
    client.close()
    assert keys and all(k.startswith("fleet-a:") for k in keys), keys
    for snapshots, runs in fleets.values():
        snapshots.close()
        runs.close()


@pytest.mark.parametrize("prefix", ["", "has space", "{slot}", "x" * 65])
def test_a_prefix_that_could_break_the_key_layout_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="Redis key prefix"):
        open_snapshot_store("redis://127.0.0.1:1/0", redis_prefix=prefix)
    with pytest.raises(ValueError):
        Settings(redis_prefix=prefix)


def test_the_run_store_retries_a_dead_server_within_bounds_then_says_so(tmp_path: Path) -> None:
    with running_redis_server(tmp_path) as server:
        runs = RedisRunStore.from_url(f"{server.url}/0")
        record, event = first_event("run-1")
        runs.create(record, event)

        # Given the server dies
        server.kill()

        # When a worker reads the run, it gets a typed error within the retry bound
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as refused:
            runs.get("run-1")

        assert time.monotonic() - started < 10
        assert f"127.0.0.1:{server.port}" in str(refused.value)
        runs.close()
