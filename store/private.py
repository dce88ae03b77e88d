"""What ratchet keeps on disk is its user's alone: directories 0700, files 0600.

A run's inputs, tool results and outputs sit in the SQLite database, the file
snapshot store and the ``filesystem://`` broker's message files. Under the usual
umask (022) they were created 0644 in 0755 folders: any local user could read
them. Modes are set here explicitly, never left to the umask, and an existing
file or folder of ours is tightened when it is opened (one made by an older
version). docs/security.md lists what is where.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path, tighten: bool = True) -> Path:
    """``path`` made 0700 (with its missing parents, each 0700); returns it.

    ``tighten``: an existing ``path`` of this user's is made 0700 too (a folder that
    is ratchet's own); without it (the folder a store URL names a file in, which may
    be anyone's home) it is left as it is. A folder of another user's is never
    changed; a data dir others can write is refused by the settings check before
    anything is opened (:func:`writable_by_others`).
    """
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(DIR_MODE)
        except FileExistsError:
            pass  # made by another process meanwhile
        _tighten(folder, DIR_MODE)
    if not missing and tighten:
        _tighten(path, DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """``path`` created empty (never through a link) or tightened to 0600; returns it.

    Not for a SQLite database: see :func:`private_files`."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE))
    _tighten(path, FILE_MODE)
    return path


def private_files(*paths: Path) -> None:
    """Tighten those of ``paths`` that exist to 0600 (a database and its -wal and -shm).

    By ``chmod`` alone: a SQLite database must never be opened and closed beside
    SQLite's own connections, since closing any descriptor of a file drops every POSIX
    lock the process holds on it (SQLite makes its -wal and -shm with the database's
    mode, so a database made private first has them private too).
    """
    for path in paths:
        _tighten(path, FILE_MODE)


def writable_by_others(path: Path) -> bool:
    """``path`` is a folder that its group or everyone may write (and so plant files in)."""
    try:
        return bool(path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    except FileNotFoundError:
        return False


def _tighten(path: Path, mode: int) -> None:
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(found.st_mode) or found.st_uid != os.geteuid():
        return  # a link is refused where it is opened; another user's file is theirs
    if stat.S_IMODE(found.st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(found.st_mode) & mode)


def write_atomically(
    folder: Path, name: str, data: bytes, sync: bool = True, staging: Path | None = None
) -> None:
    """Write ``folder/name`` whole or not at all: temp file (O_EXCL|O_NOFOLLOW), fsync, rename.

    The temp file's name is unpredictable and starts with a dot, so no reader that
    looks for ``*.msg`` or ``*.json`` sees it; on any failure it is removed. Without
    ``sync`` it is not fsynced: still whole or absent for every reader and across a
    crash of the process, but a crash of the host may leave it empty. With
    ``staging`` (a folder on the same file system) the temp file is written there,
    so a watch on ``folder`` sees only the rename.
    """
    temp = (staging or folder) / f".{secrets.token_hex(8)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, folder / name)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def read_no_follow(path: Path, max_bytes: int) -> bytes | None:
    """The file's first ``max_bytes`` bytes, or None if it is gone or is a symlink (never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        return None
    with os.fdopen(fd, "rb") as file:
        return file.read(max_bytes)
