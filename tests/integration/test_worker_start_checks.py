"""A worker refuses to start, in one line, when it could not do its work.

Real ``celery -A worker worker`` subprocesses: stores that cannot be used (a URL no
backend opens, a server where nothing listens), a broker that cannot be reached
(bounded retries, not Celery's 100), and a working directory whose ``tasks.py`` /
``store.py`` would shadow ratchet's own packages (Celery puts it first on sys.path).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.redis_server import HOST, RedisServer, _free_port
from tests.workers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PASSWORD = "not-in-any-log-9"


def dead_redis_url(db: int = 0) -> str:
    """A Redis URL with a password, on a loopback port where nothing listens."""
    return f"redis://:{PASSWORD}@{HOST}:{_free_port()}/{db}"


def worker_command(celery: list[str] | None = None) -> list[str]:
    return [
        *(celery or [sys.executable, "-m", "celery"]),
        "-A", "worker", "worker", "--pool", "solo", "--without-mingle", "--without-gossip",
        "--loglevel", "INFO",
    ]  # fmt: skip


def env_for(tmp_path: Path, redis_url: str | None = None, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(tmp_path / "data"))
    if redis_url is not None:
        env.update(
            RATCHET_BROKER_URL=redis_url,
            RATCHET_SNAPSHOT_STORE=redis_url,
            RATCHET_RUN_STORE=redis_url,
        )
    env.update(settings)
    return env


def refused(
    env: dict[str, str], cwd: Path = ROOT, command: list[str] | None = None
) -> tuple[str, float]:
    """Run the worker until it exits; its one refusal line and how long it took."""
    started = time.monotonic()
    done = subprocess.run(
        command or worker_command(),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=150,
    )
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert PASSWORD not in output
    assert "Traceback" not in output, output
    assert " ready." not in output, output
    lines = [line for line in done.stderr.splitlines() if line.startswith("ratchet: ")]
    assert len(lines) == 1, output
    return lines[0], elapsed


def test_a_snapshot_store_url_no_backend_opens_is_refused(tmp_path: Path) -> None:
    line, _ = refused(env_for(tmp_path, RATCHET_SNAPSHOT_STORE="ftp://x"))
    assert "RATCHET_SNAPSHOT_STORE=ftp://x" in line and "s3://" in line


@pytest.mark.parametrize("variable", ["RATCHET_RUN_STORE", "RATCHET_SNAPSHOT_STORE"])
def test_a_store_where_nothing_listens_is_refused_naming_it_without_its_password(
    redis_url: str, tmp_path: Path, variable: str
) -> None:
    # Given a good broker and other store, and this store on a port where nothing listens
    env = env_for(tmp_path, redis_url, **{variable: dead_redis_url()})
    line, _ = refused(env)
    # Then one line names the store, masked, and says it is unavailable
    assert f"{variable}=redis://:***@{HOST}:" in line, line
    assert "refusing to start" in line and "unavailable" in line


def test_an_unreachable_broker_is_retried_a_bounded_number_of_times(
    redis_url: str, tmp_path: Path
) -> None:
    env = env_for(
        tmp_path, redis_url, RATCHET_BROKER_URL=dead_redis_url(), RATCHET_BROKER_START_RETRIES="2"
    )
    line, elapsed = refused(env)
    assert "RATCHET_BROKER_URL=redis://:***@" in line and "after 2 retries" in line, line
    # Celery's own default (100 retries, up to 30 s apart) would take most of an hour.
    assert elapsed < 120


def test_an_unreachable_rabbitmq_broker_is_refused(redis_url: str, tmp_path: Path) -> None:
    url = f"amqp://guest:{PASSWORD}@{HOST}:{_free_port()}//"
    env = env_for(tmp_path, redis_url, RATCHET_BROKER_URL=url, RATCHET_BROKER_START_RETRIES="0")
    line, _ = refused(env)
    assert "RATCHET_BROKER_URL=amqp://guest:***@" in line, line


def test_a_worker_with_usable_stores_and_broker_starts(
    redis_server: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    # The same checks pass on what works: the worker says ready.
    log_path = tmp_path / "worker.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            worker_command(),
            cwd=ROOT,
            env=env_for(tmp_path, redis_url),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while " ready." not in log_path.read_text(errors="replace"):
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    finally:
        os.killpg(process.pid, 9)
        process.wait(timeout=10)


@pytest.fixture
def shadowing_dir(tmp_path: Path) -> Path:
    """A team's project directory: Celery's first-steps `tasks.py`, and a `store.py`."""
    directory = tmp_path / "project"
    directory.mkdir()
    (directory / "tasks.py").write_text(
        "from celery import Celery\napp = Celery('tasks')\n\n@app.task\ndef add(x, y):\n"
        "    return x + y\n"
    )
    (directory / "store.py").write_text("SHELF = {}\n")
    return directory


@pytest.mark.parametrize("celery", ["python -m celery", "celery script"])
def test_a_worker_refuses_to_start_beside_modules_that_shadow_ratchets_packages(
    redis_url: str, tmp_path: Path, shadowing_dir: Path, celery: str
) -> None:
    script = shutil.which("celery")
    assert script is not None, "the celery command is not on PATH"
    command = worker_command([script] if celery == "celery script" else None)
    line, _ = refused(env_for(tmp_path, redis_url), cwd=shadowing_dir, command=command)
    assert f"{shadowing_dir / 'tasks.py'} shadows ratchet's `tasks` package" in line, line
    assert f"{shadowing_dir / 'store.py'} shadows ratchet's `store` package" in line, line
    assert "rename" in line


def test_a_worker_beside_a_tasks_py_alone_names_it(
    redis_url: str, tmp_path: Path, shadowing_dir: Path
) -> None:
    (shadowing_dir / "store.py").unlink()
    line, _ = refused(env_for(tmp_path, redis_url), cwd=shadowing_dir)
    assert "tasks.py shadows ratchet's `tasks` package" in line and "store.py" not in line
