"""`pip install .` alone (no extras) runs a fleet on Redis and on RabbitMQ.

The package is installed from a copy of this tree into a fresh venv (``python -m
venv --without-pip``; this environment's pip, ``--python`` the venv's, from the
configured index, with its cache), and everything then runs
from that venv in an empty directory: the installed ``celery`` and ``ratchet``
commands, the installed example agent. A dependency that only the test extras
bring in (kombu's Redis transport needs ``packaging``, for one) fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import refunds
from tests.redis_server import running_redis_server
from tests.workers import ROOT, logged_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SOURCES = (
    "pyproject.toml",
    "README.md",
    "worker",
    "tasks",
    "runtime",
    "runtime_io",
    "store",
    "examples",
)


@dataclass(frozen=True)
class Venv:
    path: Path

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def site_file(self, code: str) -> str:
        done = subprocess.run(
            [self.bin("python"), "-c", code], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    base = tmp_path_factory.mktemp("fresh-install")
    # A copy, so pip's build leaves nothing in the tree (build/, *.egg-info).
    source = base / "source"
    source.mkdir()
    for name in SOURCES:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, source / name)
    venv = Venv(base / "venv")
    # No pip of its own (ensurepip took 5-25 s on 2 loaded cores, and brought setuptools,
    # which a bare install must not lean on): this pip installs into it (`--python`).
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv.path)], check=True, timeout=120
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    pip = [sys.executable, "-m", "pip", "--python", venv.bin("python")]
    done = subprocess.run(
        [*pip, "install", "--quiet", str(source)],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return venv


def venv_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """Nothing of this checkout or of the test environment: only the venv and settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RATCHET_", "PYTHON", "VIRTUAL_ENV"))
    }
    env.update(
        RATCHET_DATA_DIR=str(tmp_path / "data"),
        RATCHET_EXAMPLE_LEDGER=str(tmp_path / "refunds.ledger"),
        **settings,
    )
    return env


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """An empty working directory: nothing importable from the checkout."""
    directory = tmp_path / "cwd"
    directory.mkdir()
    return directory


StartWorker = Callable[[dict[str, str]], "subprocess.Popen[bytes]"]


@pytest.fixture
def venv_worker(fresh_venv: Venv, elsewhere: Path, tmp_path: Path) -> Iterator[StartWorker]:
    """Start `celery -A worker worker` of the venv; stopped (SIGKILL) after the test."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
        log_path = tmp_path / f"worker-{len(started)}.log"
        command = [
            fresh_venv.bin("celery"), "-A", "worker", "worker", "--pool", "solo",
            "--without-mingle", "--without-gossip", "-n", f"fresh{len(started)}@%h",
            "--loglevel", "INFO",
        ]  # fmt: skip
        process = logged_process(command, env, log_path, cwd=elsewhere)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait(timeout=10)


def run_to_completion(venv: Venv, cwd: Path, env: dict[str, str], tmp_path: Path) -> None:
    agent = venv.site_file(
        "import examples, pathlib; print(pathlib.Path(examples.__file__).parent / 'refund-desk.toml')"
    )
    started = time.monotonic()
    done = subprocess.run(
        [venv.bin("ratchet"), "runs", "start", agent, "--input", "Refund order B2",
         "--wait", "--timeout", "180", "--json"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    logs = "".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("worker-*.log")))
    assert done.returncode == 0, f"{done.stderr}\n--- worker log ---\n{logs}"
    record = json.loads(done.stdout)
    assert record["status"] == "completed", record
    assert refunds(tmp_path / "refunds.ledger") == ["refund B2 2900"]
    assert time.monotonic() - started < 180


def test_the_bare_install_has_none_of_the_extras(fresh_venv: Venv) -> None:
    # What makes the two tests below mean something: the test extras are not there.
    for module in ("boto3", "pytest", "prometheus_client"):
        done = subprocess.run(
            [fresh_venv.bin("python"), "-c", f"import {module}"], capture_output=True, timeout=60
        )
        assert done.returncode != 0, f"{module} is installed in the bare venv"


def test_the_conformance_suites_and_the_lua_scripts_are_installed(
    fresh_venv: Venv, elsewhere: Path, tmp_path: Path
) -> None:
    # The suites are in the package list (store.conformance ships with ratchet), and without
    # pytest (the bare install) importing them says which extra brings it.
    env = venv_env(tmp_path)
    where = subprocess.run(
        [fresh_venv.bin("python"), "-c",
         "import importlib.util as u; print(u.find_spec('store.conformance').origin)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().endswith("site-packages/store/conformance/__init__.py")
    # The backends read their Lua scripts at import: each folder of them was installed too.
    backends = subprocess.run(
        [fresh_venv.bin("python"), "-c", "import store.limits.redis, store.runs.redis"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert backends.returncode == 0, backends.stderr
    done = subprocess.run(
        [fresh_venv.bin("python"), "-c", "import store.conformance"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "pip install 'ratchet[conformance]'" in done.stderr


def test_a_bare_install_runs_a_run_on_a_redis_broker(
    fresh_venv: Venv, venv_worker: StartWorker, elsewhere: Path, tmp_path: Path
) -> None:
    with running_redis_server(tmp_path) as server:
        env = venv_env(
            tmp_path,
            RATCHET_BROKER_URL=f"{server.url}/0",
            RATCHET_SNAPSHOT_STORE=f"{server.url}/1",
            RATCHET_RUN_STORE=f"{server.url}/1",
        )
        venv_worker(env)
        run_to_completion(fresh_venv, elsewhere, env, tmp_path)


def test_a_bare_install_runs_a_run_on_rabbitmq(
    fresh_venv: Venv,
    venv_worker: StartWorker,
    rabbitmq_vhost: str,
    elsewhere: Path,
    tmp_path: Path,
) -> None:
    # The embedded stores (file snapshots, SQLite runs) under the data dir: no Redis at all.
    env = venv_env(tmp_path, RATCHET_BROKER_URL=rabbitmq_vhost)
    venv_worker(env)
    run_to_completion(fresh_venv, elsewhere, env, tmp_path)


def test_a_bare_install_runs_the_demo_on_the_embedded_default(
    fresh_venv: Venv, elsewhere: Path, tmp_path: Path
) -> None:
    # What `pip install .` and `ratchet demo` give a newcomer: filesystem:// broker (woken by
    # inotify, a core dependency on Linux), flat file snapshots, SQLite runs; nothing else.
    env = venv_env(tmp_path)
    assert subprocess.run([fresh_venv.bin("python"), "-c", "import inotify_simple"],
                          timeout=60).returncode == 0  # fmt: skip
    demo = subprocess.run(
        [fresh_venv.bin("ratchet"), "demo"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert any(": completed in " in line for line in demo.stdout.splitlines()), demo.stdout


def test_an_s3_store_without_boto3_is_one_line_naming_the_extra(
    fresh_venv: Venv, elsewhere: Path, tmp_path: Path
) -> None:
    env = venv_env(tmp_path, RATCHET_SNAPSHOT_STORE="s3://bucket/snapshots")
    for command in (
        [fresh_venv.bin("ratchet"), "runs", "list"],
        [fresh_venv.bin("celery"), "-A", "worker", "worker", "--pool", "solo"],
    ):
        done = subprocess.run(
            command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
        )
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and "RATCHET_SNAPSHOT_STORE" in lines[0], done.stderr
        assert "pip install 'ratchet[s3]'" in lines[0]
