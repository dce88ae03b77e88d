"""Snapshots in a directory, a head and an appended transcript per run: the embedded default.

Files per run (run ids have no dots)::

    <run>.head                 one JSON header line, then the document with an empty transcript
    <run>.<gen>.transcript     the transcript's messages, each as ``<length>\n<fragment>``
    <run>.json                 a whole document, as the previous layout stored every run
    quarantine/<run>.<UTC time>.head / .<gen>.transcript / .json   moved aside for a person

The header line names the run's seq, the transcript file (``gen``, random
hex), how many of its bytes and messages are the run's, and the hash chain
over them (:func:`store.snapshots.format.chain`). A save appends only the
messages added since the stored seq to the transcript, then replaces the
small head (temp file, rename), so the bytes a checkpoint writes stay flat
however long the transcript grows; ``load_document`` joins head and fragments
back into the document byte-identical to
:func:`store.snapshots.format.encode` (what ``ratchet snapshots show``
prints). A ``<run>.json`` of the previous layout is read as it is, and the
run's next save replaces it by a head and a transcript. A process that loaded
or saved the run before reads only the bytes after the tip it saw.

**Not fsynced** (``fsync=True`` to sync both files and the directory on every
save): a snapshot is a cache of the run's event log, and the embedded run
store commits without an fsync too (SQLite WAL, ``synchronous=NORMAL``), so a
synced snapshot would survive a host crash that the log it caches does not.
After a host crash a head may be missing, older, empty, or ahead of the log;
a load refuses each (header, hash chain, byte counts, the journal's seq
checks) and the run is rebuilt from its events. A crash of the process loses
nothing: the page cache keeps what was written. Measured on this machine
(``bench/embedded_broker.py`` for the broker; the peer bench for turns): an
fsync costs 0.3 ms on an idle disk and several ms on a busy one, three per
save.

**Crash safety** (of a process; a host's: above). The head is renamed into
place last, so it never names bytes that are not stored; bytes a dying save appended past the head's offset
are named by no head, and the next save cuts them off before it appends. A
transcript is rewritten whole (a new ``gen``) only for a run's first save or a
transcript that is not a prefix of the stored one, and the old file is removed
after the new head is in place. Readers take no lock: they read the head, then
exactly the bytes it names, which no later save changes; a reader whose head
was replaced by a rewrite reads the head again. A compare-and-set holds an
exclusive ``flock`` on the directory's lock file, so several worker processes
on one machine may share the directory.

**Nothing here follows a symbolic link.** Every file is opened relative to a
descriptor of the directory (``dir_fd``) with ``O_NOFOLLOW``; a temporary file
has an unpredictable name and is created with ``O_EXCL``, so a link planted
under any name cannot make a save write elsewhere, and a link planted as a
head, transcript or ``<run>.json`` is refused as unreadable rather than read
or written through. Temporary files a killed save left behind are removed
when the store opens.

An unusable snapshot is moved to ``quarantine/`` for a person to inspect;
nothing is ever deleted from there.
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
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import SnapshotMalformed, StaleWrite, StoreUnavailable
from runtime.models import RUN_ID_PATTERN, RunState
from store.private import FILE_MODE, private_dir
from store.snapshots import KNOWN_RUNS, Parts, SnapshotStore, TranscriptMoved, TranscriptTip
from store.snapshots import format as snapshot_format

log = logging.getLogger(__name__)

SUFFIX = ".json"
HEAD = ".head"
TRANSCRIPT = ".transcript"
HEAD_KIND = "ratchet.snapshot.head"
HEADER_MAX = 1024
"""Bytes a head's header line may take (it holds a few numbers and two hashes)."""
READ_ATTEMPTS = 5
LOCK = ".lock"
QUARANTINE = "quarantine"
_TEMP = re.compile(r"^\..*\.tmp$")
_GEN = re.compile(r"^[0-9a-f]{16}$")
_CHAIN = re.compile(r"^[0-9a-f]{64}$")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class _Head:
    seq: int
    transcript: str
    """The generation of the run's transcript file."""
    offset: int
    """Its bytes that are the run's."""
    tip: TranscriptTip
    document: bytes
    """The document with an empty transcript."""


class FileSnapshotStore(SnapshotStore):
    name = "file snapshot store"
    appends_transcript = True

    def __init__(self, directory: str | Path, fsync: bool = False) -> None:
        super().__init__()
        self.fsync = fsync
        # The configured directory is the operator's: resolving it once here is
        # following their link. Everything inside it is reached without following any.
        self.directory = Path(directory).resolve()
        self._where = f"snapshot directory {self.directory}"
        self.bytes_written = 0
        """Bytes saves wrote (heads and transcript appends): what checkpoints cost."""
        self._ends: dict[str, tuple[str, TranscriptTip, int]] = {}
        """Per run last loaded or saved: its transcript file, tip, and the tip's byte offset."""
        try:
            private_dir(self.directory)
            with self._dir() as dir_fd:
                self._clean(dir_fd)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def where(self, run_id: str) -> str:
        return f"snapshot of run {run_id} ({self.directory / (run_id + HEAD)})"

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
            entries = [e for e in os.scandir(dir_fd) if not e.is_dir(follow_symlinks=False)]
            names = {entry.name for entry in entries}
            for entry in entries:
                leftover = _TEMP.match(entry.name) is not None
                if entry.name.endswith(TRANSCRIPT):
                    # The first save of a run that died before its head was in place.
                    run_id = entry.name.split(".", 1)[0]
                    leftover = run_id + HEAD not in names and run_id + SUFFIX not in names
                if leftover:
                    os.unlink(entry.name, dir_fd=dir_fd)
                    log.info("%s: removed %s, left by a save that did not finish", self._where,
                             entry.name)  # fmt: skip

    def _read_file(self, dir_fd: int, run_id: str) -> bytes | None:
        """The run's file, read without following a link and at most one byte over the limit."""
        try:
            fd, found = self._open_regular(dir_fd, run_id + SUFFIX, os.O_RDONLY, run_id, "it")
        except FileNotFoundError:
            return None
        try:
            self._check_size(run_id, found.st_size, self.max_bytes)
            return _read_upto(fd, self.max_bytes + 1)
        finally:
            os.close(fd)

    def _open_regular(
        self, dir_fd: int, name: str, flags: int, run_id: str, what: str
    ) -> tuple[int, os.stat_result]:
        """``name`` opened without following a link, and its stat; a link or anything but a
        regular file is SnapshotMalformed (``what`` names it), FileNotFoundError passes through."""
        try:
            fd = os.open(name, flags | os.O_NONBLOCK | _NOFOLLOW, FILE_MODE, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SnapshotMalformed(
                    self.where(run_id), f"{what} is a symbolic link, which this store never follows"
                ) from exc
            raise
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise SnapshotMalformed(self.where(run_id), f"{what} is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, found

    def _check_size(self, run_id: str, size: int, limit: int) -> None:
        """SnapshotMalformed if ``size`` is over ``limit`` (the limit plus what framing may add)."""
        if size > limit:
            raise SnapshotMalformed(
                self.where(run_id), f"{size} bytes is over the {self.max_bytes}-byte limit"
            )

    def _check_holds(self, run_id: str, name: str, size: int, needed: int) -> None:
        if size < needed:
            raise SnapshotMalformed(
                self.where(run_id),
                f"{name} holds {size} bytes, fewer than the {needed} its head names",
            )

    def _stored_seq(self, dir_fd: int, run_id: str) -> int | None:
        data = self._read_file(dir_fd, run_id)
        return None if data is None else self._document_seq(data, run_id)

    def _document_seq(self, data: bytes, run_id: str) -> int:
        """The seq of a stored document (whole, or a head), or SnapshotMalformed saying why not."""
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

    @contextmanager
    def _quarantine_dir(self, dir_fd: int) -> Iterator[int]:
        """The quarantine directory (made if missing), opened without following a link."""
        try:
            os.mkdir(QUARANTINE, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
        quarantine_fd = os.open(QUARANTINE, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
        try:
            yield quarantine_fd
        finally:
            os.close(quarantine_fd)

    def _move_aside(self, dir_fd: int, name: str, target: str) -> str:
        with self._quarantine_dir(dir_fd) as quarantine_fd:
            # rename() moves a link itself, never what it points to.
            os.rename(name, target, src_dir_fd=dir_fd, dst_dir_fd=quarantine_fd)
            os.fsync(quarantine_fd)
        os.fsync(dir_fd)
        return str(self.directory / QUARANTINE / target)

    # --- the head and its transcript ------------------------------------------

    def _read_head(self, dir_fd: int, run_id: str) -> _Head | None:
        """The run's head file, parsed (its document not decoded); None if it has none."""
        data = self._read_bounded(dir_fd, run_id + HEAD, self.max_bytes + HEADER_MAX, run_id)
        if data is None:
            return None
        line, newline, document = data.partition(b"\n")
        try:
            if not newline or len(line) > HEADER_MAX:
                raise ValueError("no header line")
            fields = json.loads(line)
            if fields.get("kind") != HEAD_KIND:
                raise ValueError("another kind")
            if fields.get("run") != run_id:
                raise SnapshotMalformed(
                    self.where(run_id),
                    f"it holds the state of run {str(fields.get('run'))[:80]!r}",
                )
            seq, transcript, offset = fields["seq"], fields["transcript"], fields["offset"]
            length, size, chain_hash = fields["length"], fields["size"], fields["chain"]
            if not (
                all(type(v) is int and v >= 0 for v in (seq, offset, length, size))
                and isinstance(transcript, str)
                and _GEN.fullmatch(transcript)
                and isinstance(chain_hash, str)
                and _CHAIN.fullmatch(chain_hash)
            ):
                raise ValueError("a field of the wrong type")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise SnapshotMalformed(
                self.where(run_id),
                f"its head file {run_id}{HEAD} does not start with a snapshot header ({exc})",
            ) from exc
        if len(document) > self.max_bytes:
            raise SnapshotMalformed(
                self.where(run_id),
                f"{len(document)} bytes is over the {self.max_bytes}-byte limit",
            )
        tip = TranscriptTip(length, size, chain_hash)
        return _Head(seq, transcript, offset, tip, document)

    def _read_transcript(self, dir_fd: int, run_id: str, head: _Head) -> list[bytes] | None:
        """The fragments ``head`` names; None if its transcript file is gone (replaced)."""
        name = f"{run_id}.{head.transcript}{TRANSCRIPT}"
        if head.offset > self.max_bytes + 32 * (head.tip.length + 1):
            raise SnapshotMalformed(
                self.where(run_id), "its head names a transcript over the limit"
            )
        data = self._read_bounded(dir_fd, name, head.offset, run_id, exact=True)
        if data is None:
            return None
        try:
            fragments = _unframe(data)
        except ValueError as exc:
            raise SnapshotMalformed(
                self.where(run_id), f"its transcript file {name} does not parse ({exc})"
            ) from exc
        if (
            len(fragments) != head.tip.length
            or snapshot_format.chain(snapshot_format.GENESIS, fragments) != head.tip.chain
        ):
            raise SnapshotMalformed(
                self.where(run_id),
                f"its transcript file {name} holds {len(fragments)} messages that do not match "
                f"the head's {head.tip.length}; delete the snapshot and "
                f"`ratchet runs resume {run_id}` rebuilds it from the run's events",
            )
        return fragments

    def _document(self, dir_fd: int, run_id: str) -> tuple[bytes, TranscriptTip | None] | None:
        """The assembled document and its tip (None for a whole legacy file), read unlocked.

        A save that replaced the transcript may have removed the file the head read
        first names: the head is read again, a few times at most.
        """
        for _ in range(READ_ATTEMPTS):
            head = self._read_head(dir_fd, run_id)
            if head is None:
                whole = self._read_file(dir_fd, run_id)
                return None if whole is None else (whole, None)
            fragments = self._read_transcript(dir_fd, run_id, head)
            if fragments is None:
                continue
            try:
                document = snapshot_format.assemble(head.document, fragments)
                self._end(run_id, head.transcript, head.tip, head.offset)
                return document, head.tip
            except ValueError:
                # No single empty transcript in the head: say what is wrong with it exactly.
                snapshot_format.decode(head.document, self.where(run_id), self.max_bytes)
                raise SnapshotMalformed(
                    self.where(run_id), "its head holds a transcript of its own"
                ) from None
        raise SnapshotMalformed(
            self.where(run_id),
            f"the transcript file its head names kept disappearing ({READ_ATTEMPTS} reads); "
            "is something else removing files in the snapshot directory?",
        )

    def _read_bounded(
        self, dir_fd: int, name: str, limit: int, run_id: str, exact: bool = False
    ) -> bytes | None:
        """``name`` read without following a link: at most ``limit`` bytes (exactly, if ``exact``)."""
        try:
            fd, found = self._open_regular(dir_fd, name, os.O_RDONLY, run_id, name)
        except FileNotFoundError:
            return None
        try:
            if exact:
                self._check_holds(run_id, name, found.st_size, limit)
            else:
                self._check_size(run_id, found.st_size, limit)
            return _read_upto(fd, limit)
        finally:
            os.close(fd)

    # --- primitives -------------------------------------------------------------

    def _write_head(
        self, dir_fd: int, run_id: str, data: bytes, name: str, sync: bool = True
    ) -> None:
        """Replace ``name`` by ``data``: temp file (O_EXCL, unpredictable name), rename
        (with ``sync``: fsync the file before, the directory after)."""
        tmp = f".{run_id}.{secrets.token_hex(8)}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, FILE_MODE, dir_fd=dir_fd
        )
        try:
            try:
                _write_all(fd, data, 0)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass  # removed at the next open
            raise
        if sync:
            os.fsync(dir_fd)

    def _found_seq(self, dir_fd: int, run_id: str) -> tuple[_Head | None, int | None]:
        """What a compare-and-set reads: the stored head (None: none, or a whole legacy
        file) and the stored seq, checked against the document's kind, version and run."""
        head = self._read_head(dir_fd, run_id)
        if head is None:
            return None, self._stored_seq(dir_fd, run_id)
        if self._document_seq(head.document, run_id) != head.seq:
            raise SnapshotMalformed(
                self.where(run_id), "its head's header and document name different seqs"
            )
        return head, head.seq

    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        # A whole document, as the previous layout stored it (and a test standing in
        # for a bad writer): the saves of this store go through _put_parts.
        try:
            with self._dir() as dir_fd, self._locked(dir_fd):
                head, found = self._found_seq(dir_fd, run_id)
                if found != expected_seq:
                    raise StaleWrite(run_id, expected_seq, found)
                self._write_head(dir_fd, run_id, data, run_id + SUFFIX)
                self.bytes_written += len(data)
                self._remove(dir_fd, run_id, keep=SUFFIX)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _put_parts(self, run_id: str, parts: Parts, expected_seq: int | None) -> None:
        frames = b"".join(b"%d\n%s" % (len(f), f) for f in parts.fragments)
        try:
            with self._dir() as dir_fd, self._locked(dir_fd):
                head, found = self._found_seq(dir_fd, run_id)
                if found != expected_seq:
                    raise StaleWrite(run_id, expected_seq, found)
                if parts.base is not None:
                    if head is None or head.tip != parts.base:
                        raise TranscriptMoved(run_id)
                    generation, offset = head.transcript, head.offset
                    self._append(dir_fd, run_id, generation, offset, frames)
                else:
                    generation, offset = secrets.token_hex(8), 0
                    self._append(dir_fd, run_id, generation, None, frames)
                header = {
                    "chain": parts.tip.chain,
                    "kind": HEAD_KIND,
                    "length": parts.tip.length,
                    "offset": offset + len(frames),
                    "run": run_id,
                    "seq": parts.seq,
                    "size": parts.tip.size,
                    "transcript": generation,
                }
                data = json.dumps(header, sort_keys=True).encode() + b"\n" + parts.head
                self._write_head(dir_fd, run_id, data, run_id + HEAD, sync=self.fsync)
                self.bytes_written += len(frames) + len(data)
                self._end(run_id, generation, parts.tip, offset + len(frames))
                if head is None or head.transcript != generation:
                    # What the new head no longer names: a whole legacy file, the old transcript.
                    self._remove(dir_fd, run_id, keep=HEAD, generation=generation)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _append(
        self, dir_fd: int, run_id: str, generation: str, offset: int | None, frames: bytes
    ) -> None:
        """Write ``frames`` at ``offset`` of the run's transcript (None: a new file), fsynced.

        Bytes past ``offset`` were left by a save that died before its head was
        renamed into place: no head names them, and they are cut off first.
        """
        name = f"{run_id}.{generation}{TRANSCRIPT}"
        flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if offset is None else 0)
        try:
            fd, found = self._open_regular(dir_fd, name, flags, run_id, name)
        except FileNotFoundError as exc:
            raise SnapshotMalformed(
                self.where(run_id), f"its transcript file {name} is gone"
            ) from exc
        try:
            start = 0 if offset is None else offset
            self._check_holds(run_id, name, found.st_size, start)
            if found.st_size > start:
                os.ftruncate(fd, start)
            _write_all(fd, frames, start)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _transcripts(self, dir_fd: int, run_id: str) -> list[str]:
        """Names of every transcript file of the run (the current one, and any left behind)."""
        return [
            entry.name
            for entry in os.scandir(dir_fd)
            if entry.name.startswith(run_id + ".")
            and entry.name.endswith(TRANSCRIPT)
            and _GEN.fullmatch(entry.name[len(run_id) + 1 : -len(TRANSCRIPT)])
        ]

    def _remove(
        self, dir_fd: int, run_id: str, keep: str | None = None, generation: str | None = None
    ) -> None:
        """Remove the run's files (unlink removes a link itself, never its target)."""
        names = [run_id + SUFFIX, run_id + HEAD]
        names += [n for n in self._transcripts(dir_fd, run_id) if n.split(".")[1] != generation]
        for name in names:
            if keep is not None and name == run_id + keep:
                continue
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass

    def _read_tip(self, run_id: str) -> tuple[int, TranscriptTip | None] | None:
        try:
            with self._dir() as dir_fd:
                head, found = self._found_seq(dir_fd, run_id)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc
        if found is None:
            return None
        return found, head.tip if head is not None else None

    def _read(self, run_id: str) -> tuple[bytes, TranscriptTip | None] | None:
        try:
            with self._dir() as dir_fd:
                return self._document(dir_fd, run_id)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _end(self, run_id: str, generation: str, tip: TranscriptTip, offset: int) -> None:
        self._ends.pop(run_id, None)
        self._ends[run_id] = (generation, tip, offset)
        while len(self._ends) > KNOWN_RUNS:
            self._ends.pop(next(iter(self._ends)), None)

    def _read_after(
        self, run_id: str, base: TranscriptTip
    ) -> tuple[bytes, list[bytes], TranscriptTip] | None:
        known = self._ends.get(run_id)
        if known is None or known[1] != base:
            return None
        generation, _, start = known
        try:
            with self._dir() as dir_fd:
                head = self._read_head(dir_fd, run_id)
                if head is None or head.transcript != generation or head.offset < start:
                    return None
                name = f"{run_id}.{generation}{TRANSCRIPT}"
                data = self._read_range(dir_fd, name, start, head.offset - start)
        except (OSError, SnapshotMalformed):
            return None  # the whole read says what is wrong, or finds the replaced file
        if data is None:
            return None
        fragments = _unframe(data)
        self._end(run_id, generation, head.tip, head.offset)
        return head.document, fragments, head.tip

    def _read_range(self, dir_fd: int, name: str, start: int, length: int) -> bytes | None:
        """``length`` bytes of ``name`` from ``start``; None if it is gone, a link, or short."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = os.pread(fd, length, start)
            return data if len(data) == length else None
        finally:
            os.close(fd)

    def _get(self, run_id: str) -> bytes | None:
        found = self._read(run_id)
        return found[0] if found is not None else None

    def _delete(self, run_id: str) -> None:
        try:
            with self._dir() as dir_fd, self._locked(dir_fd):
                self._remove(dir_fd, run_id)
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _quarantine(self, run_id: str, stamp: str) -> str | None:
        try:
            with self._dir() as dir_fd, self._locked(dir_fd):
                try:
                    found = self._document(dir_fd, run_id)
                except SnapshotMalformed:
                    found = None
                if found is not None and found[1] is not None:
                    # Head and transcript assemble: keep the document a person reads.
                    target = f"{run_id}.{stamp}{SUFFIX}"
                    self._keep_aside(dir_fd, target, found[0])
                    self._remove(dir_fd, run_id)
                    return str(self.directory / QUARANTINE / target)
                moved: list[str] = []
                for name in [run_id + SUFFIX, run_id + HEAD, *self._transcripts(dir_fd, run_id)]:
                    try:
                        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    rest = name[len(run_id) :]
                    moved.append(self._move_aside(dir_fd, name, f"{run_id}.{stamp}{rest}"))
                if not moved:
                    return None
                return moved[0] if len(moved) == 1 else f"{moved[0]} (and {len(moved) - 1} more)"
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc

    def _keep_aside(self, dir_fd: int, target: str, data: bytes) -> None:
        with self._quarantine_dir(dir_fd) as quarantine_fd:
            self._write_head(quarantine_fd, target.split(".", 1)[0], data, target)

    def _list(self) -> list[str]:
        try:
            with self._dir() as dir_fd:
                names = [entry.name for entry in os.scandir(dir_fd)]
        except OSError as exc:
            raise StoreUnavailable(self._where, exc.strerror or str(exc)) from exc
        ids = {
            name.rsplit(".", 1)[0]
            for name in names
            if name.endswith((SUFFIX, HEAD)) and name.count(".") == 1
        }
        return [run_id for run_id in ids if RUN_ID_PATTERN.fullmatch(run_id)]


def _unframe(data: bytes) -> list[bytes]:
    """The fragments of ``<length>\\n<fragment>`` frames; ValueError if they do not parse."""
    fragments, at = [], 0
    while at < len(data):
        newline = data.index(b"\n", at, at + 24)
        size = int(data[at:newline])
        end = newline + 1 + size
        if size < 0 or end > len(data):
            raise ValueError("a message runs past the head's offset")
        fragments.append(data[newline + 1 : end])
        at = end
    return fragments


def _read_upto(fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes from ``fd``'s position, fewer at its end."""
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written
