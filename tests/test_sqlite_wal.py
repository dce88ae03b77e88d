"""Opening a new SQLite database while another process writes to it in the old journal mode.

Seen on the peer benchmark's embedded worker: both pool processes opened the new limits
database at their first turn; one's switch to WAL did not take (SQLite answers the old
mode while another connection holds a lock) and it wrote in rollback mode, and the
other's switch then failed at once with "database is locked" — SQLite does not apply
the busy timeout there. That turn failed with StoreUnavailable and its run stayed
queued until a sweep. Both stores' openings now wait for the lock instead.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from store.limits.sqlite import SqliteLimitStore
from store.snapshots.sqlite import connect

REAL_CONNECT = sqlite3.connect


@pytest.fixture
def writer_in_rollback_mode(tmp_path: Path) -> Iterator[tuple[Path, threading.Event]]:
    """A new database in rollback mode with a write under way (``BEGIN IMMEDIATE``),
    committed once another connection has asked for WAL (the event is set then)."""
    path = tmp_path / "new.sqlite3"
    first = REAL_CONNECT(path, isolation_level=None, check_same_thread=False)
    first.execute("CREATE TABLE t (x)")
    first.execute("BEGIN IMMEDIATE")
    first.execute("INSERT INTO t VALUES (1)")
    asked = threading.Event()

    def commit_once_asked() -> None:
        assert asked.wait(30), "nobody asked for WAL"
        first.execute("COMMIT")

    committer = threading.Thread(target=commit_once_asked)
    committer.start()
    yield path, asked
    asked.set()
    committer.join()
    first.close()


def watching_for_wal(monkeypatch: pytest.MonkeyPatch, path: Path, asked: threading.Event) -> None:
    """Set ``asked`` when a connection to ``path`` first asks for WAL (the sqlite3 module's
    trace callback: the statement as it starts)."""

    def connect_traced(database: object, *args: object, **kwargs: object) -> sqlite3.Connection:
        conn: sqlite3.Connection = REAL_CONNECT(database, *args, **kwargs)  # type: ignore[call-overload]
        if Path(str(database)) == path:
            trace: Callable[[str], None] = lambda sql: (  # noqa: E731
                asked.set() if "journal_mode" in sql else None
            )
            conn.set_trace_callback(trace)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect_traced)


def test_the_run_store_opening_a_database_another_process_writes_waits_and_gets_wal(
    writer_in_rollback_mode: tuple[Path, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, asked = writer_in_rollback_mode
    watching_for_wal(monkeypatch, path, asked)
    conn = connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT x FROM t").fetchall() == [(1,)]
    conn.close()


def test_the_limit_store_opening_a_database_another_process_writes_waits_and_gets_wal(
    writer_in_rollback_mode: tuple[Path, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, asked = writer_in_rollback_mode
    watching_for_wal(monkeypatch, path, asked)
    store = SqliteLimitStore(path)
    assert store.overrides() == {}
    probe = REAL_CONNECT(path)
    assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    probe.close()
