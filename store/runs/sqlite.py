"""SQLite run store: the embedded default, shared by processes on one machine.

WAL mode lets the CLI read while workers write; every append is one
``BEGIN IMMEDIATE`` transaction that checks the fences, inserts the events
and replaces the record. Connections are per process and per thread (Celery's
prefork pool forks, and a SQLite connection must not cross a fork).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from runtime import json_values
from runtime.errors import LeaseLost, NotStorable, StaleWrite, StoreError, StoreUnavailable
from runtime.models import Event, RunStatus
from store.live.sqlite import SqliteLiveStream, live_path
from store.private import private_dir, private_files
from store.runs import (
    FINISHED_STATUSES,
    PROCESS_SEPARATOR,
    Claim,
    Lease,
    Orphan,
    RunRecord,
    RunStore,
    Transition,
)
from store.snapshots import SnapshotStore
from store.snapshots.sqlite import Connections, SqliteSnapshotStore, transaction, write_parts

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    last_seq INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    due_at_ms INTEGER,
    record TEXT NOT NULL,
    finished_at_ms INTEGER
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status, created_at_ms);
CREATE INDEX IF NOT EXISTS runs_by_created ON runs (created_at_ms);
CREATE INDEX IF NOT EXISTS runs_by_due ON runs (due_at_ms) WHERE due_at_ms IS NOT NULL;
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (
    run_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at_ms INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS leases_by_owner ON leases (owner);
CREATE TABLE IF NOT EXISTS processes (
    process TEXT PRIMARY KEY,
    expires_at_ms INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS processes_by_expiry ON processes (expires_at_ms);
"""
SQLITE_FILES = ("-wal", "-shm", "-journal")
"""The files SQLite keeps beside a database (path + suffix)."""
# A process's leases are the owner ids from "<process>/" up to "<process>0" ("0" follows
# "/"): a range on leases_by_owner, so the leases table itself is the per-process index.
_HELD_BY = f"l.owner >= p.process || '{PROCESS_SEPARATOR}' AND l.owner < p.process || '0'"
_ROW = (
    "(run_id, status, last_seq, created_at_ms, due_at_ms, record, finished_at_ms) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)


class SqliteRunStore(RunStore):
    name = "sqlite run store"

    def __init__(self, path: str | Path, clock: Callable[[], int] | None = None) -> None:
        super().__init__(clock)
        self.path = Path(path).resolve()
        self._connection = Connections(self.path)
        self._live: SqliteLiveStream | None = None
        self._live_lock = threading.Lock()
        try:
            private_dir(self.path.parent, tighten=False)
            self._refuse_links()
            conn = self._connection()
            conn.executescript(SCHEMA)
            private_files(
                self.path, *(self.path.with_name(self.path.name + s) for s in SQLITE_FILES)
            )
            self._migrate(conn)
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(f"run store {self.path}", str(exc)) from exc

    def live(self) -> SqliteLiveStream:
        with self._live_lock:
            if self._live is None:  # opened on first use: most processes never stream
                self._live = SqliteLiveStream(live_path(self.path))
            return self._live

    def _refuse_links(self) -> None:
        """SQLite will not open its own files through a link (it uses O_NOFOLLOW) and then
        says only "unable to open database file": say which file and what to do."""
        for suffix in SQLITE_FILES:
            sibling = self.path.with_name(self.path.name + suffix)
            if sibling.is_symlink():
                raise StoreUnavailable(
                    f"run store {self.path}",
                    f"{sibling} is a symbolic link, which SQLite never follows; remove it "
                    "(a database's -wal, -shm and -journal files are SQLite's own)",
                )

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        """Add ``finished_at_ms`` (the retention index) to a database made before it existed."""
        columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
        if "finished_at_ms" not in columns:
            finished = ", ".join(f"'{s.value}'" for s in FINISHED_STATUSES)
            conn.executescript(
                "BEGIN IMMEDIATE;"
                "ALTER TABLE runs ADD COLUMN finished_at_ms INTEGER;"
                "UPDATE runs SET finished_at_ms = json_extract(record, '$.updated_at_ms') "
                f"WHERE status IN ({finished});"
                "COMMIT;"
            )
        conn.execute(
            "CREATE INDEX IF NOT EXISTS runs_by_finished ON runs (finished_at_ms) "
            "WHERE finished_at_ms IS NOT NULL"
        )

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return transaction(self._connection, f"run store {self.path}", "IMMEDIATE")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        try:
            yield self._connection()
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"run store {self.path}", str(exc)) from exc

    @staticmethod
    def _insert_events(conn: sqlite3.Connection, run_id: str, events: list[Event]) -> None:
        conn.executemany(
            "INSERT INTO events (run_id, seq, type, at_ms, data) VALUES (?, ?, ?, ?, ?)",
            [(run_id, e.seq, e.type, e.at_ms, _encoded(e.data)) for e in events],
        )

    @staticmethod
    def _record_row(record: RunRecord) -> tuple[str, str, int, int, int | None, str, int | None]:
        finished = record.finished
        return (
            record.run_id,
            record.status.value,
            record.last_seq,
            record.created_at_ms,
            record.due_at_ms,
            record.model_dump_json(),
            record.updated_at_ms if finished else None,
        )

    def _create(self, record: RunRecord, first: Event) -> None:
        with self._tx() as conn:
            row = conn.execute(
                "SELECT last_seq FROM runs WHERE run_id = ?", (record.run_id,)
            ).fetchone()
            if row is not None:
                raise StaleWrite(record.run_id, 0, row[0])
            conn.execute(f"INSERT INTO runs {_ROW}", self._record_row(record))
            self._insert_events(conn, record.run_id, [first])

    def _append(
        self, record: RunRecord, events: list[Event], owner: str | None, now_ms: int
    ) -> None:
        with self._tx() as conn:
            self._fenced_append(conn, record, events, owner, now_ms)

    def _fenced_append(
        self,
        conn: sqlite3.Connection,
        record: RunRecord,
        events: list[Event],
        owner: str | None,
        now_ms: int,
    ) -> None:
        """Inside a write transaction: the seq and lease fences, the events, the record."""
        row = conn.execute(
            "SELECT last_seq, status, due_at_ms, finished_at_ms FROM runs WHERE run_id = ?",
            (record.run_id,),
        ).fetchone()
        found = row[0] if row else None
        if found != events[0].seq - 1:
            raise StaleWrite(record.run_id, events[0].seq - 1, found)
        if owner is not None:
            lease = conn.execute(
                "SELECT owner, expires_at_ms FROM leases WHERE run_id = ?", (record.run_id,)
            ).fetchone()
            if lease is None or lease[0] != owner or lease[1] <= now_ms:
                raise LeaseLost(record.run_id, owner)
        self._insert_events(conn, record.run_id, events)
        # An UPDATE of the columns that changed, not a REPLACE (a delete and an insert):
        # the indexes on unchanged columns keep their pages, so a commit writes fewer
        # pages to the WAL (status and finished change a few times in a run's life).
        run_id, status, last_seq, _, due_at_ms, document, finished_at_ms = self._record_row(record)
        changed = {"last_seq": last_seq, "record": document}
        for column, old, new in (
            ("status", row[1], status),
            ("due_at_ms", row[2], due_at_ms),
            ("finished_at_ms", row[3], finished_at_ms),
        ):
            if old != new:
                changed[column] = new
        conn.execute(
            f"UPDATE runs SET {', '.join(f'{c} = ?' for c in changed)} WHERE run_id = ?",
            (*changed.values(), run_id),
        )

    def commits_with(self, snapshots: SnapshotStore) -> bool:
        """True for a SQLite snapshot store in this store's own database file."""
        return isinstance(snapshots, SqliteSnapshotStore) and snapshots.path == self.path

    def _commit(self, whole: Transition, now_ms: int) -> None:
        # One transaction, one WAL commit: the fences, the events and record, the snapshot's
        # head and new transcript rows, and the release.
        snapshots, record, owner = whole.snapshots, whole.record, whole.owner
        assert isinstance(snapshots, SqliteSnapshotStore)
        with self._tx() as conn:
            self._fenced_append(conn, record, whole.events, owner, now_ms)
            written = 0
            if whole.parts is None:  # the run finished: its snapshot goes (Dropped)
                conn.execute("DELETE FROM snapshot_fragments WHERE run_id = ?", (record.run_id,))
                conn.execute("DELETE FROM snapshots WHERE run_id = ?", (record.run_id,))
            else:
                written = write_parts(conn, record.run_id, whole.parts, whole.expected_seq)
            if whole.release and owner is not None:
                conn.execute(
                    "DELETE FROM leases WHERE run_id = ? AND owner = ?", (record.run_id, owner)
                )
        snapshots.bytes_written += written

    def _acquire_and_get(
        self, run_id: str, owner: str, lease_ms: int, now_ms: int
    ) -> tuple[bool, RunRecord | None]:
        # The lease and the record in one transaction.
        with self._tx() as conn:
            if not self._take(conn, run_id, owner, lease_ms, now_ms):
                return False, None
            row = conn.execute("SELECT record FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return True, RunRecord.model_validate_json(row[0]) if row else None

    def _get(self, run_id: str) -> RunRecord | None:
        with self._read() as conn:
            row = conn.execute("SELECT record FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return RunRecord.model_validate_json(row[0]) if row else None

    def _list(self, status: RunStatus | None, limit: int) -> list[RunRecord]:
        with self._read() as conn:
            if status is None:
                rows = conn.execute(
                    "SELECT record FROM runs ORDER BY created_at_ms DESC, run_id DESC LIMIT ?",
                    (limit,),
                ).fetchall()
            else:
                rows = conn.execute(
                    "SELECT record FROM runs WHERE status = ? "
                    "ORDER BY created_at_ms DESC, run_id DESC LIMIT ?",
                    (status.value, limit),
                ).fetchall()
        return [RunRecord.model_validate_json(r[0]) for r in rows]

    def _events(self, run_id: str, after_seq: int, limit: int | None) -> list[Event]:
        with self._read() as conn:
            rows = conn.execute(
                "SELECT seq, type, at_ms, data FROM events WHERE run_id = ? AND seq > ? "
                "ORDER BY seq LIMIT ?",
                (run_id, after_seq, -1 if limit is None else limit),
            ).fetchall()
        return [
            Event(seq=s, type=t, at_ms=a, data=_decoded(self.path, run_id, s, d))
            for s, t, a, d in rows
        ]

    def _acquire(self, run_id: str, owner: str, lease_ms: int, now_ms: int) -> bool:
        with self._tx() as conn:
            return self._take(conn, run_id, owner, lease_ms, now_ms)

    @staticmethod
    def _take(
        conn: sqlite3.Connection, run_id: str, owner: str, lease_ms: int, now_ms: int
    ) -> bool:
        row = conn.execute(
            "SELECT owner, expires_at_ms FROM leases WHERE run_id = ?", (run_id,)
        ).fetchone()
        if row is not None and row[0] != owner and row[1] > now_ms:
            return False
        conn.execute("REPLACE INTO leases VALUES (?, ?, ?)", (run_id, owner, now_ms + lease_ms))
        return True

    def _extend(self, run_id: str, owner: str, lease_ms: int, now_ms: int) -> bool:
        return self._renew([(run_id, owner)], lease_ms, now_ms)[0]

    def _renew(self, leases: list[tuple[str, str]], lease_ms: int, now_ms: int) -> list[bool]:
        # One transaction for a whole heartbeat round: one commit, not one per lease.
        with self._tx() as conn:
            return [
                conn.execute(
                    "UPDATE leases SET expires_at_ms = ? WHERE run_id = ? AND owner = ?",
                    (now_ms + lease_ms, run_id, owner),
                ).rowcount
                == 1
                for run_id, owner in leases
            ]

    def _release(self, run_id: str, owner: str) -> None:
        with self._tx() as conn:
            conn.execute("DELETE FROM leases WHERE run_id = ? AND owner = ?", (run_id, owner))

    def _lease(self, run_id: str, now_ms: int) -> Lease | None:
        with self._read() as conn:
            row = conn.execute(
                "SELECT owner, expires_at_ms FROM leases WHERE run_id = ? AND expires_at_ms > ?",
                (run_id, now_ms),
            ).fetchone()
        return Lease(owner=row[0], expires_at_ms=row[1]) if row else None

    def _overdue(self, now_ms: int, limit: int) -> list[str]:
        with self._read() as conn:
            rows = conn.execute(
                "SELECT r.run_id FROM runs r LEFT JOIN leases l ON l.run_id = r.run_id "
                "WHERE r.due_at_ms IS NOT NULL AND r.due_at_ms <= ? "
                "AND (l.expires_at_ms IS NULL OR l.expires_at_ms <= ?) "
                "ORDER BY r.due_at_ms, r.run_id LIMIT ?",
                (now_ms, now_ms, limit),
            ).fetchall()
        return [r[0] for r in rows]

    def _postpone(self, run_id: str, seen_seq: int, due_at_ms: int) -> bool:
        with self._tx() as conn:
            moved = conn.execute(
                "UPDATE runs SET due_at_ms = ?, record = json_set(record, '$.due_at_ms', ?) "
                "WHERE run_id = ? AND last_seq = ? AND due_at_ms IS NOT NULL",
                (due_at_ms, due_at_ms, run_id, seen_seq),
            ).rowcount
        return moved == 1

    def _claim(
        self, run_id: str, owner: str, process: str | None, lease_ms: int, now_ms: int
    ) -> Claim:
        with self._tx() as conn:
            row = conn.execute(
                "SELECT owner, expires_at_ms FROM leases WHERE run_id = ?", (run_id,)
            ).fetchone()
            held = Lease(owner=row[0], expires_at_ms=row[1]) if row else None
            claim = Claim.decide(held, owner, now_ms, lambda holder: _alive_until(conn, holder))
            if claim.taken:
                conn.execute(
                    "REPLACE INTO leases VALUES (?, ?, ?)", (run_id, owner, now_ms + lease_ms)
                )
            return claim

    def _beat(self, process: str, expires_at_ms: int, now_ms: int) -> bool:
        with self._tx() as conn:
            before = _alive_until(conn, process)
            conn.execute("REPLACE INTO processes VALUES (?, ?)", (process, expires_at_ms))
        return before is not None and before > now_ms

    def _liveness(self, process: str) -> int | None:
        with self._read() as conn:
            return _alive_until(conn, process)

    def _orphaned(self, now_ms: int, limit: int) -> list[Orphan]:
        with self._tx() as conn:
            # Dead processes holding nothing unexpired: forgotten first, so the read below
            # walks only the dead that still hold runs (and their leases, by index).
            conn.execute(
                "DELETE FROM processes WHERE expires_at_ms <= ? AND NOT EXISTS ("
                f"SELECT 1 FROM leases l WHERE {_HELD_BY.replace('p.process', 'processes.process')} "
                "AND l.expires_at_ms > ?)",
                (now_ms, now_ms),
            )
            rows = conn.execute(
                f"SELECT l.run_id, l.owner FROM processes p JOIN leases l ON {_HELD_BY} "
                "WHERE p.expires_at_ms <= ? AND l.expires_at_ms > ? "
                "ORDER BY l.run_id LIMIT ?",
                (now_ms, now_ms, limit),
            ).fetchall()
        return [Orphan(run_id, owner) for run_id, owner in rows]

    def _purge(self, before_ms: int, limit: int) -> list[str]:
        with self._tx() as conn:
            run_ids = [
                row[0]
                for row in conn.execute(
                    "SELECT run_id FROM runs WHERE finished_at_ms IS NOT NULL "
                    "AND finished_at_ms < ? ORDER BY finished_at_ms, run_id LIMIT ?",
                    (before_ms, limit),
                )
            ]
            for table in ("events", "leases", "runs"):
                conn.executemany(f"DELETE FROM {table} WHERE run_id = ?", [(r,) for r in run_ids])
        return run_ids

    def close(self) -> None:
        with self._live_lock:
            if self._live is not None:
                self._live.close()
        self._connection.close()


def _encoded(data: dict[str, Any]) -> str:
    """An event's data as its column holds it (the text ``json.dumps`` wrote before)."""
    return json_values.dumps(data, sort_keys=True, separators=None).decode()


def _decoded(path: object, run_id: str, seq: int, data: str) -> dict[str, Any]:
    """An event's data column read back; StoreError if it is not what :func:`_encoded` writes."""
    try:
        value = json_values.loads(data)
    except NotStorable as exc:
        raise StoreError(
            f"run store {path}: run {run_id}'s event at seq {seq} is unreadable "
            f"({exc.problem}); the log is damaged — restore the file from a backup"
        ) from exc
    if not isinstance(value, dict):
        raise StoreError(f"run store {path}: run {run_id}'s event at seq {seq} is not an object")
    return value


def _alive_until(conn: sqlite3.Connection, process: str) -> int | None:
    """When ``process``'s liveness record expires (ms), or None if it keeps none."""
    row = conn.execute(
        "SELECT expires_at_ms FROM processes WHERE process = ?", (process,)
    ).fetchone()
    return int(row[0]) if row else None
