"""One JSON file per run in a directory: the embedded default.

A save writes a temporary file in the same directory, fsyncs it, renames it
over the old one and fsyncs the directory, so a crash at any instant leaves
either the old document or the new one, never a torn file. The
compare-and-set holds an exclusive ``flock`` on the directory's lock file, so
several worker processes on one machine may share the directory.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.errors import InvalidRunId, SnapshotMalformed, StaleWrite, StoreUnavailable
from runtime.models import RunState
from store.snapshots import SnapshotStore

SUFFIX = ".json"


class FileSnapshotStore(SnapshotStore):
    name = "file snapshot store"

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).resolve()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(
                f"snapshot directory {self.directory}", exc.strerror or str(exc)
            ) from exc

    def _path(self, run_id: str) -> Path:
        path = (self.directory / f"{run_id}{SUFFIX}").resolve()
        # validate_run_id already excludes separators; this is the second lock on the door.
        if path.parent != self.directory:
            raise InvalidRunId(run_id)
        return path

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.directory / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _stored_seq(self, path: Path) -> int | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return int(json.loads(data)["run"]["seq"])
        except (ValueError, KeyError, TypeError) as exc:
            raise SnapshotMalformed(
                str(path),
                f"cannot read its seq ({exc}); move the file "
                "aside and `ratchet runs resume` rebuilds it from events",
            ) from exc

    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        path = self._path(run_id)
        try:
            with self._locked():
                found = self._stored_seq(path)
                if found != expected_seq:
                    raise StaleWrite(run_id, expected_seq, found)
                tmp = path.with_name(f".{run_id}.{os.getpid()}.tmp")
                with open(tmp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
                dir_fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as exc:
            raise StoreUnavailable(
                f"snapshot directory {self.directory}", exc.strerror or str(exc)
            ) from exc

    def _get(self, run_id: str) -> bytes | None:
        try:
            return self._path(run_id).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(
                f"snapshot directory {self.directory}", exc.strerror or str(exc)
            ) from exc

    def _delete(self, run_id: str) -> None:
        try:
            with self._locked():
                self._path(run_id).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreUnavailable(
                f"snapshot directory {self.directory}", exc.strerror or str(exc)
            ) from exc

    def _list(self) -> list[str]:
        return [
            p.name[: -len(SUFFIX)]
            for p in self.directory.glob(f"*{SUFFIX}")
            if not p.name.startswith(".")
        ]
