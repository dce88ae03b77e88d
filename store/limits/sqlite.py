"""Limits of the embedded default: a SQLite file beside the run database, one
``BEGIN IMMEDIATE`` transaction per decision, shared by the processes of one machine."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runtime.errors import StoreUnavailable
from store.limits.local import LocalLimitStore
from store.private import private_dir, private_files
from store.snapshots.sqlite import enable_wal


class SqliteLimitStore(LocalLimitStore):
    """The embedded default's limits: a SQLite file shared by one machine's processes."""

    def __init__(self, path: Path, clock: Callable[[], float] | None = None) -> None:
        super().__init__(clock)
        self.path = path
        self._local = threading.local()

    def _connection(self) -> sqlite3.Connection:
        import os

        held = getattr(self._local, "connection", None)
        if held is not None and held[0] == os.getpid():
            return held[1]  # type: ignore[no-any-return]
        private_dir(self.path.parent, tighten=False)
        connection = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        enable_wal(connection, patience_s=10)
        private_files(
            self.path, *(self.path.with_name(self.path.name + s) for s in ("-wal", "-shm"))
        )
        connection.execute(
            "CREATE TABLE IF NOT EXISTS limits (name TEXT PRIMARY KEY, doc TEXT NOT NULL)"
        )
        self._local.connection = (os.getpid(), connection)
        return connection

    @contextmanager
    def _documents(self, *names: str) -> Iterator[dict[str, dict[str, Any]]]:
        try:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"limits {self.path}", str(exc)) from exc
        try:
            docs = {}
            for name in names:
                row = db.execute("SELECT doc FROM limits WHERE name = ?", (name,)).fetchone()
                docs[name] = json.loads(row[0]) if row else {}
            yield docs
            for name, doc in docs.items():
                db.execute(
                    "INSERT OR REPLACE INTO limits (name, doc) VALUES (?, ?)",
                    (name, json.dumps(doc, separators=(",", ":"))),
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
