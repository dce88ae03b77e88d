"""The embedded stores never follow a link planted in their directory (real files, real links).

Whoever can write into ``snapshots/`` must not be able to make a worker (often
root) write a file elsewhere: temp files have unpredictable names and are
created with ``O_EXCL | O_NOFOLLOW``, every file is opened with
``O_NOFOLLOW`` relative to the directory, a linked lock file is moved aside at
open, and leftover temp files are removed then.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.errors import SnapshotMalformed, StoreUnavailable
from runtime.models import Budgets, Message, RunState, RunStatus
from store.runs.sqlite import SqliteRunStore
from store.snapshots.file import FileSnapshotStore

PRECIOUS = b"precious: must never be written by a snapshot store\n"


def state(run_id: str = "run-1", seq: int = 1) -> RunState:
    return RunState(
        run_id=run_id,
        seq=seq,
        agent="echo",
        agent_file="agents/echo.toml",
        binding="0" * 64,
        input="hi",
        status=RunStatus.MODEL,
        budgets=Budgets(),
        created_at_ms=1,
        transcript=(Message(role="user", content=f"at seq {seq}"),),
    )


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_bytes(PRECIOUS)
    return path


def test_a_planted_temp_file_link_does_not_make_a_save_overwrite_its_target(
    tmp_path: Path, victim: Path
) -> None:
    # Given a store holding run-1, and links planted under the temp names a save
    # used to pick (`.<run>.<pid>.tmp`) for this process and its neighbours
    directory = tmp_path / "snapshots"
    store = FileSnapshotStore(directory)
    store.save(state(seq=1), None)
    pid = os.getpid()
    for guess in range(max(pid - 50, 1), pid + 50):
        (directory / f".run-1.{guess}.tmp").symlink_to(victim)
    # When the run's next checkpoint is saved
    store.save(state(seq=2), 1)
    # Then the target is untouched and the snapshot saved where it belongs
    assert victim.read_bytes() == PRECIOUS
    loaded = store.load("run-1")
    assert loaded is not None and loaded.seq == 2
    assert not (directory / "run-1.head").is_symlink()


@pytest.mark.parametrize("layout", ["head", "whole"])
def test_a_snapshot_file_that_is_a_link_to_another_runs_is_never_written_through(
    tmp_path: Path, layout: str
) -> None:
    directory = tmp_path / "snapshots"
    store = FileSnapshotStore(directory)
    if layout == "head":
        store.save(state("other", seq=3), None)
    else:  # a whole document, as the previous layout stored every run
        store._put("other", state("other", seq=3), b"{}", None)
    suffix = ".head" if layout == "head" else ".json"
    other = (directory / f"other{suffix}").read_bytes()
    (directory / f"run-1{suffix}").symlink_to(f"other{suffix}")
    # A save that expects the seq the link's target holds is refused, not written through
    with pytest.raises(SnapshotMalformed, match="symbolic link"):
        store.save(state("run-1", seq=4), 3)
    assert (directory / f"other{suffix}").read_bytes() == other
    with pytest.raises(SnapshotMalformed, match="symbolic link"):
        store.load("run-1")


def test_a_transcript_file_that_is_a_link_is_neither_read_nor_appended_through(
    tmp_path: Path, victim: Path
) -> None:
    # Given a run whose transcript file was replaced by a link to a file outside
    directory = tmp_path / "snapshots"
    store = FileSnapshotStore(directory)
    store.save(state(seq=1), None)
    (transcript,) = directory.glob("run-1.*.transcript")
    victim.write_bytes(transcript.read_bytes() + PRECIOUS)
    transcript.unlink()
    transcript.symlink_to(victim)
    before = victim.read_bytes()
    # Then neither a load nor an append goes through it
    with pytest.raises(SnapshotMalformed, match="symbolic link"):
        store.load("run-1")
    again = FileSnapshotStore(directory)  # remembers nothing: plans from the stored tip
    with pytest.raises(SnapshotMalformed, match="symbolic link"):
        again.save(state(seq=2).model_copy(update={"transcript": state(seq=1).transcript * 2}), 1)
    assert victim.read_bytes() == before


def test_a_lock_file_planted_as_a_link_is_moved_aside_at_open_and_never_followed(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "snapshots"
    directory.mkdir()
    created_through_link = tmp_path / "created-through-the-link"
    (directory / ".lock").symlink_to(created_through_link)
    # When the store opens and saves
    store = FileSnapshotStore(directory)
    store.save(state(seq=1), None)
    # Then the link was moved aside, nothing was created through it, the lock is a file
    assert not created_through_link.exists()
    assert (directory / ".lock").is_file() and not (directory / ".lock").is_symlink()
    assert [p.is_symlink() for p in (directory / "quarantine").glob(".lock.*")] == [True]
    # And a link planted after the store opened stops saves instead of being followed
    (directory / ".lock").unlink()
    (directory / ".lock").symlink_to(created_through_link)
    with pytest.raises(StoreUnavailable, match="lock file .lock is a symbolic link"):
        store.save(state(seq=2), 1)
    assert not created_through_link.exists()


def test_leftover_temp_files_are_removed_when_the_store_opens_and_links_are_not_followed(
    tmp_path: Path, victim: Path
) -> None:
    directory = tmp_path / "snapshots"
    FileSnapshotStore(directory).save(state(seq=1), None)
    (directory / ".run-1.4242.tmp").write_bytes(b'{"kind": "half a document')
    (directory / ".run-1.0123456789abcdef.tmp").symlink_to(victim)
    # When a worker opens the store
    store = FileSnapshotStore(directory)
    # Then the leftovers are gone, their targets untouched, the snapshot kept
    names = sorted(p.name for p in directory.iterdir())
    assert [names[0], names[2]] == [".lock", "run-1.head"] and len(names) == 3, names
    assert names[1].startswith("run-1.") and names[1].endswith(".transcript")
    assert victim.read_bytes() == PRECIOUS
    loaded = store.load("run-1")
    assert loaded is not None and loaded.seq == 1


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_the_sqlite_run_store_refuses_its_own_files_as_links_naming_the_file(
    tmp_path: Path, victim: Path, suffix: str
) -> None:
    path = tmp_path / "runs.sqlite3"
    SqliteRunStore(path).close()
    for leftover in ("-wal", "-shm", "-journal"):
        path.with_name(path.name + leftover).unlink(missing_ok=True)
    link = path.with_name(path.name + suffix)
    link.symlink_to(victim)
    with pytest.raises(StoreUnavailable, match=f"{link} is a symbolic link"):
        SqliteRunStore(path)
    assert victim.read_bytes() == PRECIOUS
