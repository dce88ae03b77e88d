"""One JSON file per run in a directory: the embedded default.

A save writes a temporary file in the same directory, fsyncs it, renames it
over the old one and fsyncs the directory, so a crash at any instant leaves
either the old document or the new one, never a torn file. The
compare-and-set holds an exclusive ``flock`` on the directory's lock file, so
several worker processes on one machine may share the directory.

**Nothing here follows a symbolic link.** Every file is opened relative to a
descriptor of the directory (``dir_fd``) with ``O_NOFOLLOW``; a temporary file
has an unpredictable name and is created with ``O_EXCL``, so a link planted
under any name cannot make a save write elsewhere, and a link planted as
``<run>.json`` is refused as unreadable rather than read through. Temporary
files a killed save left behind are removed when the store opens.

An unusable snapshot is moved to ``quarantine/<run>.<UTC time>.json`` for a
person to inspect; nothing is ever deleted from there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.errors import SnapshotMalformed, StaleWrite, StoreUnavailable
from runtime.models import RUN_ID_PATTERN, RunState
from store.snapshots import SnapshotStore
from store.snapshots import format as snapshot_format

log = logging.getLogger(__name__)

SUFFIX = ".json"
LOCK = ".lock"
QUARANTINE = "quarantine"
_TEMP = re.compile(r"^\..*\.tmp$")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class FileSnapshotStore(SnapshotStore):
    name = "file snapshot store"

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        # The configured directory is the operator's: resolving it once here is
        # following their link. Everything inside it is reached without following any.
        self.directory = Path(directory).resolve()
        self._where = f"snapshot directory {self.directory}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self._dir() as dir_fd:
                self._clean(dir_fd)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def where(self, run_id: str) -> str:
        return f"snapshot of run {run_id} ({self.directory / (run_id + SUFFIX)})"

    # --- the directory, its lock, and files in it ------------------------------

    @contextmanager
    def _dir(self) -> Iterator[int]:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def _locked(self, dir_fd: int) -> Iterator[None]:
        try:
            fd = os.open(LOCK, os.O_CREAT | os.O_RDWR | _NOFOLLOW, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StoreUnavailable(
                    self._where,
                    f"its lock file {LOCK} is a symbolic link, which this store never follows; "
                    "remove the link (a worker moves it aside when it starts)",
                ) from exc
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _clean(self, dir_fd: int) -> None:
        """At open: move a lock file that is not a plain file aside, remove leftover temp files."""
        try:
            found = os.stat(LOCK, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(found.st_mode):
                moved = self._move_aside(dir_fd, LOCK, f"{LOCK}.{self.stamp()}")
                log.warning(
                    "%s: %s was not a plain file (a symbolic link?); moved it to %s",
                    self._where,
                    LOCK,
                    moved,
                )
        except FileNotFoundError:
            pass
        with self._locked(dir_fd):
            # Saves write their temp file while holding the lock: none is in progress now.
            for entry in os.scandir(dir_fd):
                if _TEMP.match(entry.name) and not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=dir_fd)
                    log.info("%s: removed %s, left by a save that did not finish", self._where,
                             entry.name)  # fmt: skip

    def _read_file(self, dir_fd: int, run_id: str) -> bytes | None:
        """The run's file, read without following a link and at most one byte over the limit."""
        try:
            fd = os.open(run_id + SUFFIX, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SnapshotMalformed(
                    self.where(run_id),
                    "it is a symbolic link, which this store never follows",
                ) from exc
            raise
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise SnapshotMalformed(self.where(run_id), "it is not a regular file")
            if found.st_size > self.max_bytes:
                raise SnapshotMalformed(
                    self.where(run_id),
                    f"{found.st_size} bytes is over the {self.max_bytes}-byte limit",
                )
            chunks, left = [], self.max_bytes + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _stored_seq(self, dir_fd: int, run_id: str) -> int | None:
        data = self._read_file(dir_fd, run_id)
        if data is None:
            return None
        # Not a full decode (a save would cost a third more): what the compare-and-set
        # relies on. A document that is wrong only deeper inside is replaced by the save.
        try:
            document = json.loads(data)
            run = document["run"]
            if (
                document["kind"] == snapshot_format.KIND
                and document["version"] in snapshot_format.READABLE_VERSIONS
                and run["run_id"] == run_id
                and type(run["seq"]) is int
            ):
                return int(run["seq"])
        except (ValueError, KeyError, TypeError, RecursionError):
            pass
        # Rare, so worth a full decode: its refusal says exactly what is wrong.
        state = snapshot_format.decode(data, self.where(run_id), self.max_bytes)
        if state.run_id != run_id:
            raise SnapshotMalformed(
                self.where(run_id), f"it holds the state of run {state.run_id[:80]!r}"
            )
        return state.seq

    def _move_aside(self, dir_fd: int, name: str, target: str) -> str:
        try:
            os.mkdir(QUARANTINE, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
        quarantine_fd = os.open(QUARANTINE, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
        try:
            # rename() moves a link itself, never what it points to.
            os.rename(name, target, src_dir_fd=dir_fd, dst_dir_fd=quarantine_fd)
            os.fsync(quarantine_fd)
        finally:
            os.close(quarantine_fd)
        os.fsync(dir_fd)
        return str(self.directory / QUARANTINE / target)

    # --- primitives -------------------------------------------------------------

    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        try:
            with self._dir() as dir_fd, self._locked(dir_fd):
                found = self._stored_seq(dir_fd, run_id)
                if found != expected_seq:
                    raise StaleWrite(run_id, expected_seq, found)
                tmp = f".{run_id}.{secrets.token_hex(8)}.tmp"
                fd = os.open(
                    tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666, dir_fd=dir_fd
                )
                try:
                    try:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view) :]
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.replace(tmp, run_id + SUFFIX, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=dir_fd)
                    except OSError:
                        pass  # removed at the next open
                    raise
                os.fsync(dir_fd)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _get(self, run_id: str) -> bytes | None:
        try:
            with self._dir() as dir_fd:
                return self._read_file(dir_fd, run_id)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _delete(self, run_id: str) -> None:
        try:
            with self._dir() as dir_fd, self._locked(dir_fd):
                try:
                    os.unlink(run_id + SUFFIX, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _quarantine(self, run_id: str, stamp: str) -> str | None:
        try:
            with self._dir() as dir_fd, self._locked(dir_fd):
                try:
                    os.stat(run_id + SUFFIX, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    return None
                return self._move_aside(dir_fd, run_id + SUFFIX, f"{run_id}.{stamp}{SUFFIX}")
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _list(self) -> list[str]:
        try:
            with self._dir() as dir_fd:
                names = [entry.name for entry in os.scandir(dir_fd)]
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc
        ids = (name[: -len(SUFFIX)] for name in names if name.endswith(SUFFIX))
        return [run_id for run_id in ids if RUN_ID_PATTERN.fullmatch(run_id)]
