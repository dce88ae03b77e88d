"""Snapshots in the SQLite run database, a head and appended transcript rows per run.

``sqlite:///path`` names the database file; pointed at the run store's own
(``RATCHET_RUN_STORE``'s, the embedded default), the run store
:meth:`~store.runs.RunStore.commits_with` it and a checkpoint is one SQLite
transaction: the events, the record, the snapshot's head and new transcript
rows, and the lease's release when it rides along. Measured on the peer
benchmark against the file store (``<run>.head`` + ``<run>.<gen>.transcript``),
which pays a temp file and a rename per save on top of the run store's
transaction: see CHANGELOG.md.

Tables (beside the run store's)::

    snapshots              run_id, seq, head (the document with an empty transcript),
                           length, size, chain (the transcript's tip), or document
                           (a whole document, as a bad writer or an old layout leaves)
    snapshot_fragments     run_id, idx, fragment: the transcript's messages, one a row
    snapshots_quarantined  name (<run>.<UTC time>), run_id, document: moved aside

A save appends only the messages added since the stored seq, so the bytes a
checkpoint writes stay flat however long the transcript grows, and
``load_document`` joins head and rows back into the document byte-identical
to :func:`store.snapshots.format.encode` (``ratchet snapshots show``). A
reader reads head and rows in one read transaction (WAL: a consistent
view); a compare-and-set is one ``BEGIN IMMEDIATE`` transaction. Durability
is the run store's (WAL, ``synchronous=NORMAL``): a snapshot never outlives
the log it caches, since both commit in the same file.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from runtime.errors import SnapshotMalformed, StaleWrite, StoreUnavailable
from runtime.models import RunState
from store.private import private_dir, private_files
from store.snapshots import Parts, SnapshotStore, TranscriptMoved, TranscriptTip
from store.snapshots import format as snapshot_format

log = logging.getLogger("ratchet.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    run_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    head BLOB,
    length INTEGER,
    size INTEGER,
    chain TEXT,
    document BLOB
);
CREATE TABLE IF NOT EXISTS snapshot_fragments (
    run_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    fragment BLOB NOT NULL,
    PRIMARY KEY (run_id, idx)
);
CREATE TABLE IF NOT EXISTS snapshots_quarantined (
    name TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    document BLOB NOT NULL
);
"""
_SQLITE_FILES = ("-wal", "-shm", "-journal")


WAL_PATIENCE_S = 30.0
"""How long opening a database waits for another process to let it be switched to WAL."""


def enable_wal(conn: sqlite3.Connection, patience_s: float = WAL_PATIENCE_S) -> None:
    """Put the database in WAL mode, waiting (up to ``patience_s``) for other processes.

    SQLite does not apply the busy timeout here: switching a new database's journal
    while another connection holds a lock either leaves the mode as it was (the pragma
    answers the old one) or fails at once with "database is locked" (a second process
    switching while the first writes in the old mode). Two pool processes opening a new
    database at once met both: one turn failed with StoreUnavailable. Raises
    sqlite3.OperationalError if the database is still not in WAL after ``patience_s``.
    """
    deadline = time.monotonic() + patience_s
    pause_s = 0.001
    while True:
        try:
            row = conn.execute("PRAGMA journal_mode=WAL").fetchone()
            if row is not None and str(row[0]).lower() == "wal":
                return
            problem = f"the journal mode stayed {row[0] if row else 'unknown'}"
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            problem = str(exc)
        if time.monotonic() >= deadline:
            raise sqlite3.OperationalError(
                f"could not switch to WAL within {patience_s:g} s: {problem}"
            )
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.05)


def connect(path: Path) -> sqlite3.Connection:
    """A connection as the run store opens one: WAL, ``synchronous=NORMAL``, autocommit;
    a database it creates has :data:`PAGE_BYTES` pages."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    # Before the switch to WAL, which writes a new database's first page: on a database
    # that exists already the pragma changes nothing (its pages keep their size).
    conn.execute(f"PRAGMA page_size={PAGE_BYTES}")
    enable_wal(conn)
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    # The Checkpointer's thread checkpoints; a commit does only if it fell far behind
    # (the WAL is then ~40 MiB, whatever the database's page size), and a reset WAL is
    # cut back to 4 MiB.
    page_bytes = int(conn.execute("PRAGMA page_size").fetchone()[0])
    conn.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_BYTES // page_bytes}")
    conn.execute(f"PRAGMA journal_size_limit={WAL_KEEP_BYTES}")
    return conn


PAGE_BYTES = 512
"""The page size of a database :func:`connect` creates (SQLite's default: 4096; 512 is
its least).

A commit writes every page it touched to the WAL whole, and a turn's five commits
touch 30-70 pages however little they change (the record's page, the newest events'
page, an index page or two each): with 4 KiB pages a worker wrote 152 KB of WAL a turn
for 2.5 KB of events (``python -m bench.embedded_bytes --by-file``), and the embedded
default 160 KB a turn all told on the peer benchmark, against 47 KB for DBOS on
SQLite-WAL. The same commits write 46 KB of WAL with 1 KiB pages and 35 KB with 512
bytes (54 KB and 42 KB all told on the peer benchmark): only the smallest pages come
under DBOS's. The database grows by 3.4 KB a turn with them, 2.6 KB with 1 KiB and
9.4 KB with 4 KiB pages (an event over ~1 KB, a model's answer or a tool's result,
overflowed the events table's 4 KiB page onto a page of its own, mostly empty), and
a worker's CPU per turn did not move beyond the noise. The page size decides no
durability: the commits, fsyncs and checkpoints are as before. A database made with
other pages keeps them (SQLite reads any page size)."""
WAL_BACKSTOP_BYTES = 10_000 * 4096
"""A commit that finds the WAL this long checkpoints it itself (SQLite's default: 1,000
pages). In bytes, not pages: 10,000 pages were 40 MiB with 4 KiB pages but would be 5 MiB
with 512 bytes, which a prefork pool of five processes, each asking for a checkpoint
after its own :data:`CHECKPOINT_EVERY_COMMITS` commits, passes before any of them asks."""
WAL_KEEP_BYTES = 4 * 1024 * 1024
"""A WAL longer than this is truncated when it is reset (SQLite's default: never)."""
CHECKPOINT_EVERY_COMMITS = 192
"""How many of a process's commits to a database ask its :class:`Checkpointer` for a
checkpoint (a turn commits five times and writes about 35 KB of WAL with 512-byte
pages). A checkpoint copies a page back once however many commits rewrote it since the
last, so fewer checkpoints copy less: 64 commits copied 4.9 KB a turn into the database
file with 1 KiB pages, 256 commits 3.2 KB. 192 keeps the WAL between checkpoints about
as long in bytes as 64 did with 4 KiB pages (a few MiB with two processes writing)."""


class Checkpointer:
    """Copies a database's WAL back into it from a daemon thread, off the turns' path.

    SQLite does it in the commit that takes the WAL past 1,000 pages (its
    ``wal_autocheckpoint``): two fsyncs and the copy inside a turn's last write, every
    few dozen turns (measured on the peer benchmark: 225 fsyncs in 800 turns, ~2 ms
    each, all on the sequential path). Here every :data:`CHECKPOINT_EVERY_COMMITS`
    commits of this process wake a thread that runs a PASSIVE checkpoint on its own
    connection: it waits for no lock and holds up no writer or reader, and the WAL
    stays short enough that SQLite's own checkpoint, kept as the backstop, rarely
    fires. Durability is unchanged: a commit is in the WAL before it returns
    (``synchronous=NORMAL``), and a checkpoint only moves committed pages. A failed
    checkpoint (a full disk) leaves the WAL as it was; the next one retries.
    One per process and database file (:func:`checkpointer`); made again after a fork.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._due = threading.Event()
        self._commits = 0
        self.checkpoints = 0
        """Checkpoints run so far (PASSIVE: all frames or as many as readers allowed)."""
        threading.Thread(target=self._run, name="ratchet-sqlite-checkpoint", daemon=True).start()

    def committed(self) -> None:
        """Count one commit of this process; every so many, ask for a checkpoint.
        (Unlocked: a count two threads lose only delays a checkpoint by a commit.)"""
        self._commits += 1
        if self._commits >= CHECKPOINT_EVERY_COMMITS:
            self._commits = 0
            self._due.set()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        while True:
            self._due.wait()
            self._due.clear()
            try:
                if conn is None:
                    conn = sqlite3.connect(self._path, timeout=1, isolation_level=None)
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                self.checkpoints += 1
            except sqlite3.Error as exc:
                log.debug("checkpoint of %s failed (the next one retries): %s", self._path, exc)
                if conn is not None:
                    conn.close()
                conn = None


_checkpointers: dict[Path, Checkpointer] = {}
_checkpointers_pid: int | None = None
_checkpointers_lock = threading.Lock()


def checkpointer(path: Path) -> Checkpointer:
    """This process's :class:`Checkpointer` of ``path`` (a forked child makes its own:
    the parent's thread did not come along)."""
    global _checkpointers_pid
    pid = os.getpid()
    found = _checkpointers.get(path) if _checkpointers_pid == pid else None
    if found is not None:
        return found
    with _checkpointers_lock:
        if _checkpointers_pid != pid:
            _checkpointers.clear()
            _checkpointers_pid = pid
        found = _checkpointers.get(path)
        if found is None:
            found = _checkpointers[path] = Checkpointer(path)
        return found


class Connections:
    """A :func:`connect` connection to ``path`` per thread and per process: a forked
    pool child opens its own (a SQLite connection must not cross a fork)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._local = threading.local()

    def committed(self) -> None:
        """A write transaction committed on one of these connections."""
        checkpointer(self._path).committed()

    def __call__(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            conn = connect(self._path)
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def close(self) -> None:
        """Close this thread's connection, if it has one."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


@contextmanager
def transaction(connection: Connections, where: str, mode: str) -> Iterator[sqlite3.Connection]:
    """A transaction on ``connection()``: IMMEDIATE to write, DEFERRED for a consistent
    read of several rows. Rolled back if the block raises; StoreUnavailable naming
    ``where`` if SQLite fails (a locked database past the busy timeout, a full disk)."""
    try:
        conn = connection()
        conn.execute(f"BEGIN {mode}")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    except sqlite3.OperationalError as exc:
        raise StoreUnavailable(where, str(exc)) from exc
    if mode == "IMMEDIATE":
        connection.committed()


def write_parts(
    conn: sqlite3.Connection, run_id: str, parts: Parts, expected_seq: int | None
) -> int:
    """Inside a write transaction: store ``parts`` if the stored seq is ``expected_seq``;
    the payload bytes written. StaleWrite, TranscriptMoved as ``_put_parts`` says."""
    row = conn.execute(
        "SELECT seq, length, size, chain FROM snapshots WHERE run_id = ?", (run_id,)
    ).fetchone()
    found = row[0] if row is not None else None
    if found != expected_seq:
        raise StaleWrite(run_id, expected_seq, found)
    base = parts.base
    if base is not None:
        if row[1] is None or TranscriptTip(row[1], row[2], row[3]) != base:
            raise TranscriptMoved(run_id)
        start = base.length
    else:
        start = 0
        if row is not None:
            conn.execute("DELETE FROM snapshot_fragments WHERE run_id = ?", (run_id,))
    if parts.fragments:
        conn.executemany(
            "INSERT INTO snapshot_fragments (run_id, idx, fragment) VALUES (?, ?, ?)",
            [(run_id, start + i, f) for i, f in enumerate(parts.fragments)],
        )
    tip = parts.tip
    values = (parts.seq, parts.head, tip.length, tip.size, tip.chain, run_id)
    if row is None:
        conn.execute(
            "INSERT INTO snapshots (seq, head, length, size, chain, run_id, document) "
            "VALUES (?, ?, ?, ?, ?, ?, NULL)",
            values,
        )
    else:
        # (An UPDATE leaves the run_id index's page alone; a REPLACE would rewrite it.)
        conn.execute(
            "UPDATE snapshots SET seq = ?, head = ?, length = ?, size = ?, chain = ?, "
            "document = NULL WHERE run_id = ?",
            values,
        )
    return len(parts.head) + sum(len(f) for f in parts.fragments)


class SqliteSnapshotStore(SnapshotStore):
    name = "sqlite snapshot store"
    appends_transcript = True

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path).resolve()
        self._where = f"snapshot store {self.path}"
        self._connection = Connections(self.path)
        self.bytes_written = 0
        """Payload bytes saves wrote (heads and transcript rows): what checkpoints cost."""
        try:
            private_dir(self.path.parent, tighten=False)
            for suffix in _SQLITE_FILES:
                sibling = self.path.with_name(self.path.name + suffix)
                if sibling.is_symlink():
                    raise StoreUnavailable(
                        self._where,
                        f"{sibling} is a symbolic link, which SQLite never follows; remove it "
                        "(a database's -wal, -shm and -journal files are SQLite's own)",
                    )
            self._connection().executescript(SCHEMA)
            private_files(
                self.path, *(self.path.with_name(self.path.name + s) for s in _SQLITE_FILES)
            )
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(self._where, str(exc)) from exc

    def where(self, run_id: str) -> str:
        return f"snapshot of run {run_id} (in {self.path})"

    def _tx(self, mode: str = "IMMEDIATE") -> AbstractContextManager[sqlite3.Connection]:
        """A transaction: IMMEDIATE to write, DEFERRED for a consistent read of several rows."""
        return transaction(self._connection, self._where, mode)

    # --- primitives -------------------------------------------------------------

    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        # A whole document (a bad writer, in tests): the saves of this store go through
        # _put_parts.
        with self._tx() as conn:
            row = conn.execute("SELECT seq FROM snapshots WHERE run_id = ?", (run_id,)).fetchone()
            found = row[0] if row is not None else None
            if found != expected_seq:
                raise StaleWrite(run_id, expected_seq, found)
            conn.execute("DELETE FROM snapshot_fragments WHERE run_id = ?", (run_id,))
            conn.execute(
                "REPLACE INTO snapshots (run_id, seq, document) VALUES (?, ?, ?)",
                (run_id, state.seq, data),
            )
        self.bytes_written += len(data)

    def _put_parts(self, run_id: str, parts: Parts, expected_seq: int | None) -> None:
        with self._tx() as conn:
            written = write_parts(conn, run_id, parts, expected_seq)
        self.bytes_written += written

    def _read_tip(self, run_id: str) -> tuple[int, TranscriptTip | None] | None:
        with self._tx("DEFERRED") as conn:
            row = conn.execute(
                "SELECT seq, length, size, chain FROM snapshots WHERE run_id = ?", (run_id,)
            ).fetchone()
        if row is None:
            return None
        if row[1] is None:
            return int(row[0]), None
        return int(row[0]), TranscriptTip(row[1], row[2], row[3])

    def _stored(
        self, conn: sqlite3.Connection, run_id: str, after: int = 0
    ) -> tuple[bytes | None, bytes | None, TranscriptTip | None, list[bytes]] | None:
        """Inside a transaction: (document, head, tip, fragments from index ``after``)."""
        row = conn.execute(
            "SELECT document, head, length, size, chain FROM snapshots WHERE run_id = ?",
            (run_id,),
        ).fetchone()
        if row is None:
            return None
        document, head, length, size, chain = row
        if document is not None or head is None:
            return document, None, None, []
        fragments = [
            r[0]
            for r in conn.execute(
                "SELECT fragment FROM snapshot_fragments WHERE run_id = ? AND idx >= ? "
                "ORDER BY idx",
                (run_id, after),
            )
        ]
        return None, head, TranscriptTip(length, size, chain), fragments

    def _read(self, run_id: str) -> tuple[bytes, TranscriptTip | None] | None:
        with self._tx("DEFERRED") as conn:
            found = self._stored(conn, run_id)
        if found is None:
            return None
        document, head, tip, fragments = found
        if head is None or tip is None:
            return (document or b""), None
        self._check(run_id, tip, fragments)
        return snapshot_format.assemble(head, fragments), tip

    def _check(self, run_id: str, tip: TranscriptTip, fragments: Sequence[bytes]) -> None:
        if (
            len(fragments) != tip.length
            or snapshot_format.chain(snapshot_format.GENESIS, fragments) != tip.chain
        ):
            raise SnapshotMalformed(
                self.where(run_id),
                f"its transcript holds {len(fragments)} messages that do not match the head's "
                f"{tip.length}; delete the snapshot and `ratchet runs resume {run_id}` rebuilds "
                "it from the run's events",
            )

    def _read_after(
        self, run_id: str, base: TranscriptTip
    ) -> tuple[bytes, list[bytes], TranscriptTip] | None:
        with self._tx("DEFERRED") as conn:
            found = self._stored(conn, run_id, after=base.length)
        if found is None or found[1] is None or found[2] is None:
            return None
        return found[1], found[3], found[2]

    def _get(self, run_id: str) -> bytes | None:
        found = self._read(run_id)
        return found[0] if found is not None else None

    def _delete(self, run_id: str) -> None:
        with self._tx() as conn:
            conn.execute("DELETE FROM snapshot_fragments WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM snapshots WHERE run_id = ?", (run_id,))

    def _quarantine(self, run_id: str, stamp: str) -> str | None:
        name = f"{run_id}.{stamp}"
        with self._tx() as conn:
            found = self._stored(conn, run_id)
            if found is None:
                return None
            document, head, tip, fragments = found
            if head is not None and tip is not None:
                try:
                    self._check(run_id, tip, fragments)
                    document = snapshot_format.assemble(head, fragments)
                except (SnapshotMalformed, ValueError):
                    # Kept as stored, head then rows, for a person to piece together.
                    document = b"\n".join([head, *fragments])
            conn.execute(
                "INSERT INTO snapshots_quarantined (name, run_id, document) VALUES (?, ?, ?)",
                (name, run_id, document or b""),
            )
            conn.execute("DELETE FROM snapshot_fragments WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM snapshots WHERE run_id = ?", (run_id,))
        return f"{self.path} (table snapshots_quarantined, name {name})"

    def _list(self) -> list[str]:
        with self._tx("DEFERRED") as conn:
            return [r[0] for r in conn.execute("SELECT run_id FROM snapshots")]

    def close(self) -> None:
        self._connection.close()
