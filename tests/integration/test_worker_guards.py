"""Guards a worker sets up at start, on real redis-servers and ``celery -A worker worker``s.

- A Redis store without an append-only file refuses the worker (a restart of such a
  store rolls runs back and re-runs their tools), unless the operator accepts it.
- The metrics server listens on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tasks.settings import Settings
from tests.redis_server import HOST, RedisServer, _binary, _free_port, running_redis_server
from tests.workers import WorkerProcess, WorkerProcesses
from worker.checks import redis_persistence, store_persistence_problem

pytestmark = pytest.mark.timeout(90)


def wait_for_log(worker: WorkerProcess, text: str, timeout_s: float = 45) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in worker.log():
        assert worker.process is not None and worker.process.poll() is None, worker.log()
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.05)


@pytest.fixture
def volatile_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server that keeps nothing: no AOF (and no RDB saves)."""
    directory = tmp_path / "volatile"
    directory.mkdir()
    with running_redis_server(directory, appendonly=False) as server:
        yield server


@pytest.fixture
def rdb_only_server(tmp_path: Path) -> Iterator[int]:
    """RDB snapshots every 60 s after a write, and no AOF: what issue 9 restarted from."""
    yield from own_server(tmp_path / "rdb", "--save", "60 1", "--appendonly", "no")


def own_server(directory: Path, *options: str) -> Iterator[int]:
    directory.mkdir()
    port = _free_port()
    command = [_binary(), "--port", str(port), "--bind", HOST, "--dir", str(directory), *options]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(host=HOST, port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)
        client.close()
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


# --- 9: the store must keep an append-only file ----------------------------------------


@pytest.mark.slow
def test_a_worker_refuses_to_start_on_a_store_without_aof(
    worker_processes: WorkerProcesses, volatile_server: RedisServer
) -> None:
    # Given a run store on a Redis that keeps nothing durable
    store = f"{volatile_server.url}/0"
    # When a worker starts on it
    refused = worker_processes.start("--pool", "solo", RATCHET_RUN_STORE=store)
    # Then it exits non-zero at once, with one line naming the store and the way out
    assert refused.wait(timeout_s=45) != 0
    lines = [line for line in refused.log().splitlines() if "refusing to start" in line]
    assert len(lines) == 1, refused.log()
    assert f"run store's Redis at {store} keeps no append-only file" in lines[0]
    assert "--appendonly yes" in lines[0] and "RATCHET_ALLOW_VOLATILE_STORE=1" in lines[0]
    assert "ready." not in refused.log()


@pytest.mark.slow
def test_the_operator_may_accept_a_volatile_store_and_is_warned(
    worker_processes: WorkerProcesses, volatile_server: RedisServer
) -> None:
    worker = worker_processes.start(
        "--pool",
        "solo",
        RATCHET_SNAPSHOT_STORE=f"{volatile_server.url}/0",
        RATCHET_ALLOW_VOLATILE_STORE="1",
    )
    wait_for_log(worker, "ready.")
    assert "snapshot store's Redis" in worker.log()
    assert "started anyway because RATCHET_ALLOW_VOLATILE_STORE is set" in worker.log()


@pytest.mark.slow
def test_a_worker_starts_on_stores_with_aof(
    worker_processes: WorkerProcesses, tmp_path: Path
) -> None:
    # The fixtures' servers (the session's, holding both stores here, and this one) keep AOF.
    with running_redis_server(tmp_path) as snapshots:
        worker = worker_processes.start(
            "--pool", "solo", RATCHET_SNAPSHOT_STORE=f"{snapshots.url}/0"
        )
        wait_for_log(worker, "ready.")
        assert "append-only" not in worker.log()


def test_rdb_snapshots_alone_do_not_count_as_durable(rdb_only_server: int) -> None:
    url = f"redis://{HOST}:{rdb_only_server}/0"
    problem = store_persistence_problem(Settings(snapshot_store=url, run_store=url))
    assert problem is not None
    assert "snapshot store and run store's Redis" in problem and "RDB" in problem


def test_a_server_that_refuses_config_is_asked_info_instead(tmp_path: Path) -> None:
    # Managed Redis renames CONFIG or denies it by ACL; INFO still answers.
    for port in own_server(
        tmp_path / "renamed", "--appendonly", "yes", "--rename-command", "CONFIG", ""
    ):
        client = redis.Redis(host=HOST, port=port)
        with pytest.raises(redis.exceptions.ResponseError):
            client.config_get("appendonly")
        assert redis_persistence(client).durable is True
        assert "aof_enabled:1" in redis_persistence(client).evidence
        client.close()
        url = f"redis://{HOST}:{port}/0"
        assert store_persistence_problem(Settings(run_store=url)) is None


def test_an_acl_user_denied_config_is_judged_by_info(tmp_path: Path) -> None:
    for port in own_server(tmp_path / "acl", "--appendonly", "no"):
        admin = redis.Redis(host=HOST, port=port)
        admin.execute_command(
            "ACL", "SETUSER", "worker", "on", ">pw", "~*", "+@all", "-config"
        )  # fmt: skip
        admin.close()
        url = f"redis://worker:pw@{HOST}:{port}/0"
        problem = store_persistence_problem(Settings(run_store=url))
        assert problem is not None and "INFO persistence: aof_enabled:0" in problem
        assert ":pw@" not in problem  # the password is never shown


def test_a_server_that_answers_neither_is_a_warning_not_a_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for port in own_server(
        tmp_path / "mute",
        "--appendonly", "no",
        "--rename-command", "CONFIG", "",
        "--rename-command", "INFO", "",
    ):  # fmt: skip
        url = f"redis://{HOST}:{port}/0"
        assert store_persistence_problem(Settings(run_store=url)) is None
        assert "cannot tell whether the run store's Redis" in caplog.text


def test_file_and_sqlite_stores_are_not_asked(tmp_path: Path) -> None:
    assert store_persistence_problem(Settings(data_dir=tmp_path)) is None


# --- 14: the metrics server binds loopback ---------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on ``port``, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


LOOPBACK_V4 = "0100007F"  # 127.0.0.1, little-endian hex as /proc prints it


@pytest.mark.slow
def test_the_metrics_server_listens_on_loopback_only_by_default(
    worker_processes: WorkerProcesses,
) -> None:
    # Given a worker with metrics on
    port = _free_port()
    worker = worker_processes.start("--pool", "solo", RATCHET_METRICS_PORT=str(port))
    wait_for_log(worker, "ready.")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
    # Then its only listening socket is on 127.0.0.1, not on every interface
    assert listening_addresses(port) == {LOOPBACK_V4}


@pytest.mark.slow
def test_the_metrics_address_is_a_setting(worker_processes: WorkerProcesses) -> None:
    port = _free_port()
    worker = worker_processes.start(
        "--pool", "solo", RATCHET_METRICS_PORT=str(port), RATCHET_METRICS_ADDRESS="127.0.0.2"
    )
    wait_for_log(worker, "ready.")
    assert listening_addresses(port) == {"0200007F"}
    with socket.create_connection(("127.0.0.2", port), timeout=5):
        pass
