"""Live streams of the SQLite run store, in a database of their own beside it.

Deltas come many per second per run; in the run store's database each write would take
the lock a checkpoint needs. Here they never do: ``runs.db`` has ``runs.live.db`` beside
it (0600, WAL), which several processes on the machine read and write.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from runtime.errors import StoreUnavailable
from store.live import LiveEntry, LiveStream, decoded
from store.live.memory import integer_cursor
from store.private import private_files
from store.snapshots.sqlite import Connections, transaction

SCHEMA = """
CREATE TABLE IF NOT EXISTS live (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    entry TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS live_by_run ON live (run_id, id);
CREATE TABLE IF NOT EXISTS live_runs (
    run_id TEXT PRIMARY KEY,
    expires_at_ms INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS live_runs_by_expiry ON live_runs (expires_at_ms);
CREATE TABLE IF NOT EXISTS watched (
    run_id TEXT PRIMARY KEY,
    until_ms INTEGER NOT NULL
) WITHOUT ROWID;
"""
_POLL_S = 0.02
"""A blocked reader looks again this often (SQLite cannot wake it)."""


def live_path(runs_db: Path) -> Path:
    """The live streams' database beside the run store's ``runs_db``."""
    return runs_db.with_name(f"{runs_db.stem}.live{runs_db.suffix or '.db'}")


class SqliteLiveStream(LiveStream):
    name = "sqlite live stream"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._where = f"live stream {path}"
        self._connection = Connections(path)
        try:
            self._connection().executescript(SCHEMA)
            private_files(path, *(path.with_name(path.name + s) for s in ("-wal", "-shm")))
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(self._where, str(exc)) from exc

    def _add(self, run_id: str, entries: list[str], maxlen: int, keep_s: float) -> None:
        now_ms = int(time.time() * 1000)
        with transaction(self._connection, self._where, "IMMEDIATE") as conn:
            self._forget_expired(conn, now_ms)
            conn.executemany(
                "INSERT INTO live (run_id, entry) VALUES (?, ?)", [(run_id, e) for e in entries]
            )
            conn.execute(
                "DELETE FROM live WHERE run_id = ? AND id <= (SELECT id FROM live WHERE "
                "run_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (run_id, run_id, maxlen),
            )
            conn.execute(
                "INSERT INTO live_runs (run_id, expires_at_ms) VALUES (?, ?) ON CONFLICT "
                "(run_id) DO UPDATE SET expires_at_ms = excluded.expires_at_ms",
                (run_id, now_ms + int(keep_s * 1000)),
            )

    def _watch(self, run_id: str, for_s: float) -> None:
        now_ms = int(time.time() * 1000)
        with transaction(self._connection, self._where, "IMMEDIATE") as conn:
            conn.execute("DELETE FROM watched WHERE until_ms <= ?", (now_ms,))
            conn.execute(
                "INSERT INTO watched (run_id, until_ms) VALUES (?, ?) ON CONFLICT (run_id) "
                "DO UPDATE SET until_ms = excluded.until_ms",
                (run_id, now_ms + int(for_s * 1000)),
            )

    def _watched(self, run_id: str) -> bool:
        try:
            row = (
                self._connection()
                .execute(
                    "SELECT 1 FROM watched WHERE run_id = ? AND until_ms > ?",
                    (run_id, int(time.time() * 1000)),
                )
                .fetchone()
            )
        except sqlite3.Error as exc:
            raise StoreUnavailable(self._where, str(exc)) from exc
        return row is not None

    @staticmethod
    def _forget_expired(conn: sqlite3.Connection, now_ms: int) -> None:
        expired = [
            row[0]
            for row in conn.execute(
                "SELECT run_id FROM live_runs WHERE expires_at_ms <= ? LIMIT 100", (now_ms,)
            )
        ]
        for run_id in expired:
            conn.execute("DELETE FROM live WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM live_runs WHERE run_id = ?", (run_id,))

    def _read(self, run_id: str, after: str | None, limit: int, block_s: float) -> list[LiveEntry]:
        last = integer_cursor(after)
        deadline = time.monotonic() + block_s
        while True:
            now_ms = int(time.time() * 1000)
            try:
                rows = (
                    self._connection()
                    .execute(
                        "SELECT l.id, l.entry FROM live l JOIN live_runs r ON r.run_id = l.run_id "
                        "WHERE l.run_id = ? AND l.id > ? AND r.expires_at_ms > ? ORDER BY l.id LIMIT ?",
                        (run_id, last, now_ms, limit),
                    )
                    .fetchall()
                )
            except sqlite3.Error as exc:
                raise StoreUnavailable(self._where, str(exc)) from exc
            if rows or time.monotonic() >= deadline:
                return [LiveEntry(str(i), decoded(e)) for i, e in rows]
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        self._connection.close()
