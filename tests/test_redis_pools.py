"""The Redis stores' connection pools under many calls at once (a threads or gevent worker).

A real server is made to stall (``CLIENT PAUSE``, as during a slow fsync or a
failover) while 150 threads call the store together, so every call holds a
connection at the same moment: more than redis-py's default pool of 100.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from runtime.errors import StoreBusy, StoreUnavailable
from store import open_run_store, open_snapshot_store
from store.runs.redis import RedisRunStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.pool import HEADROOM, slots_for

CALLS = 150
PAUSE_MS = 3000


def at_once(calls: int, call: Callable[[], Any]) -> list[BaseException]:
    """Run ``call`` on ``calls`` threads released together; the errors they raised."""
    start = threading.Barrier(calls)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        start.wait()
        try:
            call()
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a store call hung"
    return errors


def pause(redis_url: str, ms: int) -> None:
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("CLIENT", "PAUSE", ms, "ALL")
    admin.close()


def ratchet_connections(redis_url: str) -> int:
    admin = redis.Redis.from_url(redis_url)
    clients = admin.client_list()
    admin.close()
    return sum(1 for c in clients if c.get("name") == "ratchet")


@pytest.mark.timeout(90)
def test_calls_beyond_the_default_pool_wait_for_a_connection_instead_of_failing(
    redis_url: str,
) -> None:
    # Given a run store opened as the CLI or an application would (no size given)
    store = open_run_store(redis_url)
    store.lease("run-1")
    # When 150 calls arrive together while the server stalls for 3 s
    pause(redis_url, PAUSE_MS)
    errors = at_once(CALLS, lambda: store.lease("run-1"))
    # Then none fails: the 50 beyond the pool's 100 connections waited for one
    assert errors == []
    store.close()


@pytest.mark.timeout(90)
def test_a_store_sized_for_a_worker_holds_a_connection_for_each_of_its_slots(
    redis_url: str,
) -> None:
    # Given the stores a threads worker with 150 slots opens (tasks.pool sizes them)
    slots = slots_for("threads", CALLS)
    assert slots == CALLS
    runs = open_run_store(redis_url, max_connections=slots + HEADROOM)
    snapshots = open_snapshot_store(redis_url, max_connections=slots + HEADROOM)
    assert isinstance(runs, RedisRunStore) and isinstance(snapshots, RedisSnapshotStore)
    before = ratchet_connections(redis_url)
    # When every slot calls the run store at once while the server stalls
    pause(redis_url, PAUSE_MS)
    started = time.monotonic()
    errors = at_once(CALLS, lambda: runs.lease("run-1"))
    # Then each had a connection of its own: all answered as the pause ended, none failed
    assert errors == []
    assert ratchet_connections(redis_url) - before >= CALLS
    assert time.monotonic() - started < PAUSE_MS / 1000 + 10
    runs.close()
    snapshots.close()


@pytest.mark.timeout(90)
def test_a_pool_that_stays_full_raises_store_busy_naming_its_size(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a store whose URL allows 2 connections, and a short wait for a free one
    monkeypatch.setattr("store.snapshots.redis.POOL_WAIT_S", 0.3)
    store = open_run_store(f"{redis_url}?max_connections=2")
    # When 3 calls arrive together while the server stalls for 3 s
    pause(redis_url, PAUSE_MS)
    errors = at_once(3, lambda: store.lease("run-1"))
    # Then the one that found no connection fails with StoreBusy, which says what to change
    assert len(errors) == 1, errors
    busy = errors[0]
    assert isinstance(busy, StoreBusy) and isinstance(busy, StoreUnavailable)
    assert "all 2 pooled connections stayed busy for 0.3 s" in str(busy)
    assert "?max_connections=N" in str(busy)
    assert "127.0.0.1" in str(busy)
    store.close()


def test_prefork_and_solo_processes_run_one_turn_and_green_pools_their_concurrency() -> None:
    assert slots_for("prefork", 8) == 1
    assert slots_for("solo", 1) == 1
    assert slots_for("threads", 500) == 500
    assert slots_for("gevent", 2000) == 2000
    assert slots_for("threads", "auto") is None


def test_the_checkout_check_answers_as_redis_pys_own_does(redis_url: str) -> None:
    from store.redis_connection import CheckedConnection
    from store.snapshots.redis import connect

    # Given a store client's pooled connection: clean, it is not readable (the fast answer)
    client = connect(redis_url, max_connections=1)
    client.set("k", "value")
    conn = client.connection_pool.get_connection()
    assert isinstance(conn, CheckedConnection) and not conn.can_read()
    # With a reply left unread on it, it is, as a redis.Connection says
    conn.send_command("PING")
    assert conn.can_read(timeout=5) and conn.can_read()
    assert conn.read_response() == b"PONG" and not conn.can_read()
    client.connection_pool.release(conn)
    client.close()


def test_a_connection_the_server_closed_in_the_pool_is_made_again_transparently(
    redis_url: str,
) -> None:
    from store.snapshots.redis import connect

    client = connect(redis_url, max_connections=1)
    client.set("k", "value")
    admin = redis.Redis.from_url(redis_url)
    admin.client_kill_filter(_type="normal", skipme=True)
    admin.close()
    assert client.get("k") == b"value"  # no ConnectionError reaches the caller
    client.close()


def test_the_checkout_check_polls_the_socket_outside_geventss_hub() -> None:
    import subprocess
    import sys

    code = (
        "from gevent import monkey; monkey.patch_all()\n"
        "import select\n"
        "from store.redis_connection import os_poll\n"
        "print(type(select.poll()).__module__, type(os_poll()).__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["gevent.select", "select"], out.stderr
