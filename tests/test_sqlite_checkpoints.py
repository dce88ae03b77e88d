"""The SQLite stores' WAL is checkpointed by a thread of each process, not inside a turn.

SQLite checkpoints in the commit that takes the WAL past ``wal_autocheckpoint`` pages:
two fsyncs and the copy inside a turn's write, and, while readers kept the WAL from
being reset, in every commit after it (225 fsyncs in 800 turns on the peer benchmark).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from store.snapshots import sqlite as store_sqlite


def test_a_processs_commits_are_checkpointed_by_its_checkpointer_thread(tmp_path: Path) -> None:
    # Given a database written through the stores' connections
    path = tmp_path / "runs.sqlite3"
    connections = store_sqlite.Connections(path)
    connections().execute("CREATE TABLE t (x BLOB)")
    checkpointer = store_sqlite.checkpointer(path)
    before = checkpointer.checkpoints
    # When this process commits as many transactions as ask for a checkpoint
    for _ in range(store_sqlite.CHECKPOINT_EVERY_COMMITS):
        with store_sqlite.transaction(connections, "test", "IMMEDIATE") as conn:
            conn.execute("INSERT INTO t VALUES (?)", (b"x" * 3000,))
    # Then its thread checkpoints the WAL (waited for, not slept on)
    deadline = time.monotonic() + 30
    while checkpointer.checkpoints == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert checkpointer.checkpoints > before
    # and every frame committed so far is in the database file
    probe = sqlite3.connect(path, isolation_level=None)
    busy, frames, done = probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    probe.close()
    assert busy == 0 and frames == done
    # while a commit does not checkpoint before the WAL is ten times SQLite's default
    assert connections().execute("PRAGMA wal_autocheckpoint").fetchone()[0] >= 10_000
    connections.close()
