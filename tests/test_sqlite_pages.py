"""The embedded run database's pages: 512 bytes in a new database; an old one keeps its own.

A commit writes each page it touched to the WAL whole, so the page size sets what a
turn writes (store/snapshots/sqlite.py, ``PAGE_BYTES``). Every database made before
has 4 KiB pages, and SQLite cannot change them in WAL mode: such a database keeps
them, and its runs load and go on as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.fsm import rebuild
from runtime.models import RunStatus
from store.runs.sqlite import SqliteRunStore
from store.snapshots import sqlite as store_sqlite
from store.snapshots.sqlite import SqliteSnapshotStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, drive, turn, write_agent

RUN_ID = "paged-1"


def agent(directory: Path) -> Path:
    return write_agent(
        directory,
        [turn("looking it up " * 90, call("lookup_order", order_id=f"A{i}")) for i in range(6)]
        + [turn("Done.")],
        budgets={"max_turns": 10, "max_tool_calls": 10},
    )


def context(db: Path) -> Context:
    return Context(Settings(), SqliteSnapshotStore(db), SqliteRunStore(db))


def pragma(db: Path, name: str) -> object:
    conn = store_sqlite.connect(db)
    try:
        return conn.execute(f"PRAGMA {name}").fetchone()[0]
    finally:
        conn.close()


def test_a_new_run_database_has_512_byte_pages(tmp_path: Path) -> None:
    # Given no database yet; When the embedded stores open one
    db = tmp_path / "runs.sqlite3"
    ctx = context(db)
    # Then its pages are PAGE_BYTES, and WAL as before
    assert pragma(db, "page_size") == store_sqlite.PAGE_BYTES == 512
    assert pragma(db, "journal_mode") == "wal"
    # and a commit checkpoints the WAL itself only at the backstop's bytes (~40 MiB), not pages
    assert pragma(db, "wal_autocheckpoint") == store_sqlite.WAL_BACKSTOP_BYTES // 512
    ctx.close()


def test_a_database_made_with_four_kib_pages_keeps_them_and_its_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run three turns in, in a database made with 4 KiB pages (as every one was)
    db, path = tmp_path / "runs.sqlite3", agent(tmp_path)
    with monkeypatch.context() as before:
        before.setattr(store_sqlite, "PAGE_BYTES", 4096)
        old = context(db)
        create_run(old, path, "where are my orders?", run_id=RUN_ID)
        done = advance(old, RUN_ID, None)
        for _ in range(2):
            done = advance(old, RUN_ID, done.seq)
        assert done.outcome == "next"
        document = old.snapshots.load_document(RUN_ID)
        old.close()
    assert pragma(db, "page_size") == 4096
    # When this release opens it
    ctx = context(db)
    # Then it keeps its pages (and its backstop of 10,000 of them), the snapshot loads as it
    # was written and equals the events' fold
    assert pragma(db, "page_size") == 4096
    assert pragma(db, "wal_autocheckpoint") == 10_000
    assert ctx.snapshots.load_document(RUN_ID) == document
    state = ctx.snapshots.load(RUN_ID)
    assert state is not None and state == rebuild(ctx.runs.events(RUN_ID))
    # and the run goes on to the end there
    assert drive(ctx, RUN_ID).outcome == "completed"
    record = ctx.runs.get(RUN_ID)
    assert record is not None and record.status == RunStatus.COMPLETED
    final = rebuild(ctx.runs.events(RUN_ID))
    assert final is not None and final.usage.tool_calls == 6
    ctx.close()
