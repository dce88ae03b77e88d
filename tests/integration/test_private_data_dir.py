"""The embedded data dir is its user's alone, whatever the umask (docs/security.md).

Under umask 022 every folder in it was 0755 and every file 0644: another local user
(``nobody``) could read each input, tool result and output from ``runs.sqlite3``.
Here a real ``celery -A worker worker`` and the ``ratchet`` CLI, both under umask
022, run a run on the embedded default (``filesystem://`` broker, SQLite run store,
file snapshot store) and set a garbage message aside; then every folder under the
data dir must be 0700 and every file 0600 — the databases' -wal and -shm included,
checked while the worker still holds them open. A data dir its group or everyone
can write is refused in one line, by the worker and the CLI.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import call, turn, write_agent
from tests.workers import ROOT, WorkerProcess, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def embedded_env(data_dir: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_DATA_DIR=str(data_dir),
        RATCHET_SNAPSHOT_STORE=f"file://{data_dir / 'snapshots'}",
        RATCHET_EXAMPLE_LEDGER=str(tmp_path / "ledger"),
        PYTHONPATH=str(ROOT),
    )
    return env


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, for this process and the processes it starts."""
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def modes(data_dir: Path) -> dict[str, str]:
    found = {".": oct(stat.S_IMODE(data_dir.stat().st_mode))}
    for path in data_dir.rglob("*"):
        found[str(path.relative_to(data_dir))] = oct(stat.S_IMODE(path.lstat().st_mode))
    return found


def ratchet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "worker", *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)


def test_everything_in_a_fresh_data_dir_is_private_under_umask_022(
    tmp_path: Path, umask_022: None
) -> None:
    data_dir = tmp_path / "data"
    env = embedded_env(data_dir, tmp_path)
    agent = write_agent(
        tmp_path / "agent",
        [
            turn("look", call("lookup_order", order_id="B2")),
            turn("ask", call("request_user_input", prompt="Which refund?")),
        ],
    )
    worker = WorkerProcess(env, tmp_path / "worker.log", ("--pool", "solo")).start()
    try:
        # Given a run that went through the broker and the worker and waits with a snapshot
        started = ratchet(env, "runs", "start", str(agent), "--input", "refund B2", "--wait")
        assert started.returncode == 4, started.stdout + started.stderr + worker.log()
        # and a message file the worker could not read, set aside
        garbage = data_dir / "broker" / "queue" / "0_garbage.ratchet.turns.msg"
        garbage.write_bytes(b"not json")
        rejected = data_dir / "broker" / "rejected"
        wait_for("the garbage is set aside", lambda: rejected.is_dir() and any(rejected.iterdir()))
        # Then, while the worker still holds its databases open, nothing is anyone else's
        found = modes(data_dir)
        assert "runs.sqlite3-wal" in found and "snapshots" in found, found
        assert any(name.startswith("broker/rejected/") for name in found), found
        wrong = {
            name: mode
            for name, mode in found.items()
            if mode != ("0o700" if (data_dir / name).is_dir() else "0o600")
        }
        assert wrong == {}, found
        if os.geteuid() == 0:
            # and another user cannot read the run store
            peek = subprocess.run(
                ["cat", str(data_dir / "runs.sqlite3")], user="nobody", capture_output=True
            )
            assert peek.returncode != 0 and b"Permission denied" in peek.stderr
    finally:
        worker.kill()


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777])
def test_a_data_dir_other_users_can_write_is_refused_in_one_line(tmp_path: Path, mode: int) -> None:
    data_dir = tmp_path / "shared"
    data_dir.mkdir()
    data_dir.chmod(mode)
    env = embedded_env(data_dir, tmp_path)
    worker = WorkerProcess(env, tmp_path / "worker.log", ("--pool", "solo")).start()
    assert worker.wait(timeout_s=60) == 2, worker.log()
    lines = [line for line in worker.log().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "can be written by other users" in lines[0] and f"chmod 700 {data_dir}" in lines[0]
    listed = ratchet(env, "runs", "list")
    assert listed.returncode == 2, listed.stderr
    assert listed.stderr.count("\n") == 1 and "can be written by other users" in listed.stderr
    assert sorted(p.name for p in data_dir.iterdir()) == []  # nothing was made in it
