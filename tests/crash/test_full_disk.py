"""The embedded default (``filesystem://`` broker, file snapshots, SQLite) on a broken disk.

Real worker and beat subprocesses with ``RATCHET_DATA_DIR`` on a real 1 MiB
tmpfs: the disk fills while a turn runs and beat keeps sending sweeps, then the
space comes back and the run must finish with nobody touching anything. And a
queue folder holding files that are not messages (empty, torn, a JSON list)
must not stop a worker from starting or from taking the next run.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import pytest

from runtime.models import RunStatus
from store import open_run_store, open_snapshot_store
from store.rejected import Rejected, rejected_folder
from store.rejected.folder import FolderRejected
from store.runs import RunRecord
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import ROOT, WorkerProcess, WorkerProcesses
from tests.workers import wait_until as shared_wait_until
from worker.app import make_app

wait_until = partial(shared_wait_until, timeout_s=120)

pytestmark = pytest.mark.timeout(300)
T = TypeVar("T")


def embedded_env(data_dir: Path, ledger: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_DATA_DIR=str(data_dir),
        RATCHET_EXAMPLE_LEDGER=str(ledger),
        RATCHET_LEASE_S="2",
        RATCHET_SWEEP_INTERVAL_S="0.5",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


class Embedded:
    """The test's view of one data dir: its stores, and a Celery client of its broker."""

    def __init__(self, data_dir: Path) -> None:
        self.settings = Settings(data_dir=data_dir, lease_s=2)
        self.ctx = Context(
            settings=self.settings,
            snapshots=open_snapshot_store(self.settings.resolved_snapshot_store),
            runs=open_run_store(self.settings.resolved_run_store),
        )
        self.client = make_app(self.settings)

    def start(self, agent: Path) -> str:
        state = create_run(self.ctx, agent, "refund my order")
        self.client.send_task("ratchet.turn", (state.run_id, state.seq))
        return state.run_id

    def record(self, run_id: str) -> RunRecord:
        record = self.ctx.runs.get(run_id)
        assert record is not None
        return record

    def close(self) -> None:
        self.client.close()
        self.ctx.close()


def alive(worker: WorkerProcess) -> None:
    assert worker.process is not None
    assert worker.process.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"


def ready(worker: WorkerProcess) -> None:
    wait_until(
        "the worker is ready",
        lambda: (
            worker.process is not None
            and (worker.process.poll() is not None or " ready." in worker.log())
        ),
    )
    alive(worker)


def test_a_worker_sets_aside_files_in_its_queue_folder_that_are_not_messages(
    tmp_path: Path, ledger: Path
) -> None:
    data = tmp_path / "data"
    embedded = Embedded(data)  # creates the broker folders, as a worker or the CLI would
    queue = embedded.settings.broker_folders["queue"]
    # Given what a full disk and a careless hand leave in the queue folder
    bad = {
        "1_empty.ratchet.turns.msg": b"",
        "2_torn.ratchet.turns.msg": b'{"body": "eyJ',
        "3_list.ratchet.control.msg": b"[1,2,3]",
    }
    for name, content in bad.items():
        (queue / name).write_bytes(content)
    torn_table = embedded.settings.broker_folders["control"] / "ratchet.turns.exchange"
    torn_table.write_bytes(b'[["ratchet.tu')
    processes = WorkerProcesses(embedded_env(data, ledger), tmp_path)
    try:
        worker = processes.start("--pool", "threads")
        ready(worker)
        # Then each is set aside in the dead-letter folder, and the worker keeps running
        store = FolderRejected(rejected_folder(data))
        entries: list[Rejected] = wait_until(
            "four set aside", lambda: store.list() if len(store.list()) >= 4 else None
        )
        alive(worker)
        assert {e.raw_bytes() for e in entries} == {*bad.values(), b'[["ratchet.tu'}
        assert not [p for p in queue.iterdir() if p.name.endswith(".msg")]
        # And the same worker takes a run to its end
        run_id = embedded.start(write_agent(tmp_path / "agent", [turn("Done.")]))
        record = wait_until(
            "the run completes",
            lambda: r if (r := embedded.record(run_id)).status.is_terminal else None,
        )
        assert record.status == RunStatus.COMPLETED, record.error
        alive(worker)
        assert "Unrecoverable error" not in worker.log()
    finally:
        processes.stop_all()
        embedded.close()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (we are root on the test machines)."""
    mount = tmp_path / "data"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)],
        check=True,
        timeout=30,
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def fill(directory: Path) -> Path:
    """Write a file until the disk is full; the file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        # Whatever a smaller write can still squeeze in, too.
        while True:
            try:
                if os.write(fd, b"\0") == 0:
                    break
            except OSError:
                break
    finally:
        os.close(fd)
    return filler


class Beat:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "worker", "beat", "--loglevel", "INFO",
                 "--schedule", str(log_path.with_suffix(".schedule"))],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def test_after_a_full_disk_the_run_finishes_by_itself_and_no_empty_message_is_left(
    tiny_disk: Path, tmp_path: Path, ledger: Path
) -> None:
    data = tiny_disk
    embedded = Embedded(data)
    env = embedded_env(data, ledger)
    processes = WorkerProcesses(env, tmp_path)
    beat = None
    filler = None
    try:
        worker = processes.start("--pool", "threads")
        ready(worker)
        beat = Beat(env, tmp_path / "beat.log")
        # Given a run whose model call is in progress
        script = [
            {**turn("looking", call("lookup_order", order_id="B2")), "sleep_s": 3.0},
            turn("Done."),
        ]
        run_id = embedded.start(write_agent(tmp_path / "agent", script))
        wait_until(
            "the model call starts", lambda: embedded.record(run_id).usage.model_attempts == 1
        )
        # When the disk fills before the turn can record what the model said
        filler = fill(data)
        wait_until(
            "the turn fails on the full disk",
            lambda: "disk is full" in worker.log() or "No space left" in worker.log(),
        )
        # and beat keeps trying to send sweeps onto the full disk for a while
        wait_until(
            "beat fails to send a sweep",
            lambda: (
                "ratchet.sweep" in (beat_log := (tmp_path / "beat.log").read_text())
                and "No space left" in beat_log
            ),
        )
        queue = embedded.settings.broker_folders["queue"]
        empty = [
            p.name for p in queue.iterdir() if p.name.endswith(".msg") and not p.stat().st_size
        ]
        assert empty == [], "a message was written half-way"
        alive(worker)
        # Then once the space is back, the run finishes with no one touching it
        filler.unlink()
        filler = None
        record = wait_until(
            "the run finishes",
            lambda: r if (r := embedded.record(run_id)).status.is_terminal else None,
        )
        assert record.status == RunStatus.COMPLETED, record.error
        alive(worker)
        log = worker.log()
        assert "Unrecoverable error" not in log
        # And a worker started now has nothing left to choke on
        second = processes.start("--pool", "threads")
        ready(second)
        alive(second)
    finally:
        if beat is not None:
            beat.stop()
        processes.stop_all()
        embedded.close()
        if filler is not None:
            filler.unlink(missing_ok=True)
