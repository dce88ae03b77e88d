"""A snapshot that cannot be used is a missing snapshot, on every path that loads a run.

The file snapshot store and the SQLite run store, on disk. Each kind of damage
an unlucky operator or an attacker can leave in ``snapshots/<run>.json`` —
truncated, empty, another kind, another version, an unknown field, over the
size limit, a 5,000-digit integer, 50,000-deep nesting, another run's state, a
link to another run's file, a link out of the directory — and each path that
loads a run (a turn, a sweeper's and an operator's resume, a continuation,
``ratchet runs show``) rebuilds the state from the events, moves the file to
``snapshots/quarantine/`` (never deletes it), logs one WARNING naming the file
and the problem, and carries on.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime.continuation import make_continuation
from runtime.models import RunStatus
from runtime.recovery import OPERATOR, SWEEPER
from store.runs import wall_ms
from store.runs.sqlite import SqliteRunStore
from store.snapshots import format as snapshot_format
from store.snapshots.file import FileSnapshotStore
from tasks.context import Context, set_context
from tasks.control import apply_continuation
from tasks.recovery import resume, sweep_orphans
from tasks.resumption import examine
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, drive, turn, write_agent
from worker.cli import main as cli

Damage = Callable[[Path, str, str], None]
"""Damage ``<dir>/<run>.head`` (the run's head); the second run's is ``<dir>/<other>.head``."""


def _split(path: Path) -> tuple[bytes, bytes]:
    """The head file's header line (newline included) and its document."""
    header, _, document = path.read_bytes().partition(b"\n")
    return header + b"\n", document


def _rewrite(path: Path, edit: Callable[[dict[str, object]], None]) -> None:
    header, data = _split(path)
    document = json.loads(data)
    edit(document)
    path.write_bytes(header + json.dumps(document, indent=2).encode())


def truncated(directory: Path, run_id: str, other: str) -> None:
    path = directory / f"{run_id}.head"
    path.write_bytes(_split(path)[0] + b"{truncated")


def empty(directory: Path, run_id: str, other: str) -> None:
    path = directory / f"{run_id}.head"
    path.write_bytes(_split(path)[0])


def wrong_kind(directory: Path, run_id: str, other: str) -> None:
    _rewrite(directory / f"{run_id}.head", lambda d: d.update(kind="ratchet.memory"))


def wrong_version(directory: Path, run_id: str, other: str) -> None:
    _rewrite(directory / f"{run_id}.head", lambda d: d.update(version=3))


def unknown_field(directory: Path, run_id: str, other: str) -> None:
    _rewrite(directory / f"{run_id}.head", lambda d: d.update(colour="red"))


def over_the_limit(directory: Path, run_id: str, other: str) -> None:
    path = directory / f"{run_id}.head"
    path.write_bytes(path.read_bytes() + b" " * snapshot_format.MAX_BYTES)


def huge_integer(directory: Path, run_id: str, other: str) -> None:
    path = directory / f"{run_id}.head"
    header, data = _split(path)
    text = data.decode()
    seq = f'"seq": {json.loads(text)["run"]["seq"]}'
    assert seq in text
    path.write_bytes(header + text.replace(seq, '"seq": ' + "7" * 5000).encode())


def deep_nesting(directory: Path, run_id: str, other: str) -> None:
    depth = 50_000
    path = directory / f"{run_id}.head"
    path.write_bytes(
        _split(path)[0]
        + b'{"kind": "ratchet.snapshot", "version": 1, "run": '
        + b"[" * depth
        + b"]" * depth
        + b"}"
    )


def another_runs_state(directory: Path, run_id: str, other: str) -> None:
    # The other run's head and the transcript it names, copied under this run's names.
    (directory / f"{run_id}.head").write_bytes((directory / f"{other}.head").read_bytes())
    for transcript in directory.glob(f"{other}.*.transcript"):
        generation = transcript.name.split(".")[1]
        (directory / f"{run_id}.{generation}.transcript").write_bytes(transcript.read_bytes())


def link_to_another_run(directory: Path, run_id: str, other: str) -> None:
    path = directory / f"{run_id}.head"
    path.unlink()
    path.symlink_to(f"{other}.head")


def link_out_of_the_directory(directory: Path, run_id: str, other: str) -> None:
    # The target is this very run's head: a store that follows the link reads a
    # valid snapshot, and one that writes through it overwrites a file outside.
    path = directory / f"{run_id}.head"
    outside = directory.parent / "outside.head"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)


DAMAGES = [
    pytest.param(truncated, "not JSON", id="truncated"),
    pytest.param(empty, "empty", id="empty"),
    pytest.param(wrong_kind, "`ratchet.memory` document", id="wrong-kind"),
    pytest.param(wrong_version, "version `3`", id="wrong-version"),
    pytest.param(unknown_field, "`colour`: unknown field", id="unknown-field"),
    pytest.param(over_the_limit, "byte limit", id="over-16-mib"),
    pytest.param(huge_integer, "integer", id="5000-digit-integer"),
    pytest.param(deep_nesting, "nested too deeply", id="50000-deep-nesting"),
    pytest.param(another_runs_state, "holds the state of run 'other-run'", id="another-runs-state"),
    pytest.param(link_to_another_run, "symbolic link", id="link-to-another-run"),
    pytest.param(link_out_of_the_directory, "symbolic link", id="link-out-of-the-directory"),
]


@pytest.fixture
def ctx(tmp_path: Path, ledger: Path) -> Iterator[Context]:
    context = Context(
        Settings(),
        FileSnapshotStore(tmp_path / "data" / "snapshots"),
        SqliteRunStore(tmp_path / "data" / "runs.sqlite3"),
    )
    try:
        yield context
    finally:
        context.close()


def snapshots_dir(ctx: Context) -> Path:
    assert isinstance(ctx.snapshots, FileSnapshotStore)
    return ctx.snapshots.directory


def agent(directory: Path) -> Path:
    return write_agent(
        directory,
        [
            turn("look", call("lookup_order", order_id="B2")),
            turn("ask", call("request_user_input", prompt="which card?")),
            turn("Refunded."),
        ],
    )


def two_runs(ctx: Context, directory: Path) -> str:
    """The run under test, one turn in (a snapshot at seq 5), beside `other-run`'s snapshot."""
    path = agent(directory)
    create_run(ctx, path, "someone else's", run_id="other-run")
    run_id = create_run(ctx, path, "refund B2", run_id="the-run").run_id
    assert advance(ctx, run_id, None).outcome == "next"
    return run_id


def damaged_run(
    ctx: Context, directory: Path, damage: Damage, forget: bool = True
) -> tuple[str, int]:
    """:func:`two_runs`, then the run's snapshot damaged: its id and last seq. ``forget``:
    as in another process (a turn's, the CLI's), no checkpoint of the run remembered."""
    run_id = two_runs(ctx, directory)
    record = ctx.runs.get(run_id)
    assert record is not None
    damage(snapshots_dir(ctx), run_id, "other-run")
    if forget:
        ctx.forget_checkpoint(run_id)
    return run_id, record.last_seq


def assert_set_aside(
    ctx: Context, run_id: str, caplog: pytest.LogCaptureFixture, problem: str
) -> None:
    """Moved aside, never deleted, with exactly one WARNING naming the file and the problem."""
    directory = snapshots_dir(ctx)
    # The document, or (when head and transcript do not assemble) the head and its transcript.
    aside = directory / "quarantine"
    quarantined = [*aside.glob(f"{run_id}.*.json"), *aside.glob(f"{run_id}.*Z.head")]
    assert len(quarantined) == 1, sorted(aside.iterdir())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert str(directory / f"{run_id}.head") in message
    assert problem in message
    assert str(quarantined[0]) in message
    # The other run's snapshot, and whatever a link pointed to, are untouched.
    assert ctx.snapshots.load("other-run") is not None


def assert_a_turn_sets_it_aside_and_saves(
    ctx: Context,
    directory: Path,
    damage: Damage,
    problem: str,
    caplog: pytest.LogCaptureFixture,
    forget: bool,
) -> None:
    """A turn of the run whose snapshot ``damage`` spoiled goes on to its suspension, the
    file set aside and the turn's checkpoint saved."""
    run_id, last_seq = damaged_run(ctx, directory, damage, forget)
    with caplog.at_level(logging.WARNING):
        done = advance(ctx, run_id, last_seq)
    assert done.outcome == "suspended"
    assert_set_aside(ctx, run_id, caplog, problem)
    saved = ctx.snapshots.load(run_id)
    assert saved is not None and saved.seq == done.seq


@pytest.mark.parametrize(("damage", "problem"), DAMAGES)
def test_a_turn_on_an_unusable_snapshot_rebuilds_from_events_and_the_run_completes(
    ctx: Context, tmp_path: Path, damage: Damage, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A turn of another process: no checkpoint of this run remembered
    assert_a_turn_sets_it_aside_and_saves(ctx, tmp_path, damage, problem, caplog, forget=True)


@pytest.mark.parametrize(("damage", "problem"), DAMAGES)
def test_a_sweeper_resume_of_an_unusable_snapshot_resumes_the_run(
    ctx: Context, tmp_path: Path, damage: Damage, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_id, last_seq = damaged_run(ctx, tmp_path, damage)
    with caplog.at_level(logging.WARNING):
        done = resume(ctx, run_id, SWEEPER, last_seq)
    assert done.outcome == "suspended", done
    assert_set_aside(ctx, run_id, caplog, problem)
    events = [e.type for e in ctx.runs.events(run_id)]
    assert "run.resumed" in events and "run.dead_lettered" not in events


@pytest.mark.parametrize(("damage", "problem"), DAMAGES)
def test_an_operator_resume_of_an_unusable_snapshot_is_not_refused(
    ctx: Context, tmp_path: Path, damage: Damage, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_id, _ = damaged_run(ctx, tmp_path, damage)
    with caplog.at_level(logging.WARNING):
        # What `ratchet runs resume` checks before it enqueues, then what the worker does
        state, _, verdict = examine(ctx, run_id)
        assert verdict.eligible, verdict.reason
        assert state is not None and state.status == RunStatus.MODEL
        done = resume(ctx, run_id, OPERATOR)
    assert done.outcome == "suspended", done
    assert_set_aside(ctx, run_id, caplog, problem)


@pytest.mark.parametrize(("damage", "problem"), DAMAGES)
def test_a_continuation_on_an_unusable_snapshot_is_applied_and_chains_the_next_turn(
    ctx: Context, tmp_path: Path, damage: Damage, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_id = two_runs(ctx, tmp_path)
    assert drive(ctx, run_id).outcome == "suspended"
    damage(snapshots_dir(ctx), run_id, "other-run")
    chained: list[tuple[str, int]] = []
    continuation = make_continuation(run_id, "answer-1", input="the visa card")
    with caplog.at_level(logging.WARNING):
        outcome = apply_continuation(ctx, continuation, enqueue=lambda r, s: chained.append((r, s)))
    assert outcome == "continued"
    # `run.continued` recorded and the turn chained at it: the run is not stuck live
    last = ctx.runs.events(run_id)[-1]
    assert last.type == "run.continued" and chained == [(run_id, last.seq)]
    assert_set_aside(ctx, run_id, caplog, problem)
    assert advance(ctx, run_id, last.seq).outcome == "completed"


@pytest.mark.parametrize(("damage", "problem"), DAMAGES)
def test_runs_show_of_an_unusable_snapshot_shows_the_run_and_sets_the_file_aside(
    ctx: Context, tmp_path: Path, damage: Damage, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_id, _ = damaged_run(ctx, tmp_path, damage)  # the CLI's process: no checkpoint
    set_context(ctx)
    try:
        with caplog.at_level(logging.WARNING):
            shown = CliRunner().invoke(cli, ["runs", "show", run_id])
    finally:
        set_context(None)
    assert shown.exit_code == 0, shown.output
    assert "snapshot   none usable; the state is rebuilt from the run's events" in shown.output
    assert_set_aside(ctx, run_id, caplog, problem)


UNREADABLE_FOR_A_SAVE = [d for d in DAMAGES if d.id != "unknown-field"]
"""What a save's compare-and-set reads: kind, version, run id, seq. A document damaged
only deeper inside (an unknown field) is replaced by a save from a process that
remembers the run's state, like any older snapshot."""


@pytest.mark.parametrize(("damage", "problem"), UNREADABLE_FOR_A_SAVE)
def test_a_turn_in_the_process_that_saved_the_snapshot_sets_a_damaged_one_aside_when_saving(
    ctx: Context, tmp_path: Path, damage: Damage, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given this process remembers the run's last checkpoint, so its turn reads no file,
    # when the turn saves its next checkpoint over the damaged file, then the file is set
    # aside and the checkpoint saved
    assert_a_turn_sets_it_aside_and_saves(ctx, tmp_path, damage, problem, caplog, forget=False)


def test_a_sweeper_that_finds_neither_a_snapshot_nor_events_to_rebuild_dead_letters_the_run(
    ctx: Context, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a live run whose snapshot is unreadable and whose event log was wiped
    run_id = two_runs(ctx, tmp_path)
    truncated(snapshots_dir(ctx), run_id, "other-run")
    record = ctx.runs.get(run_id)
    assert record is not None
    with sqlite3.connect(tmp_path / "data" / "runs.sqlite3") as db:
        db.execute("DELETE FROM events WHERE run_id = ? AND seq > 1", (run_id,))
        db.execute("UPDATE events SET type = 'run.mangled' WHERE run_id = ?", (run_id,))
    ctx.forget_checkpoint(run_id)
    # When the sweeper resumes it
    assert resume(ctx, run_id, SWEEPER, record.last_seq).outcome == "dead_lettered"
    # Then it is no longer live, so no sweep finds it again
    ended = ctx.runs.get(run_id)
    assert ended is not None and ended.status == RunStatus.DEAD_LETTERED
    assert ended.error is not None and "the sweeper cannot resume it" in ended.error
    assert run_id not in sweep_orphans(ctx, enqueue=lambda r, s: None)


def test_a_snapshot_of_an_earlier_run_with_the_same_id_is_set_aside(
    ctx: Context, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an earlier run's snapshot left under a reused id (a purge that lost its delete)
    path = agent(tmp_path)
    first = create_run(ctx, path, "first", run_id="reused")
    assert advance(ctx, first.run_id, None).outcome == "next"
    earlier = {p.name: p.read_bytes() for p in snapshots_dir(ctx).glob("reused.*")}
    with sqlite3.connect(tmp_path / "data" / "runs.sqlite3") as db:
        for table in ("events", "leases", "runs"):
            db.execute(f"DELETE FROM {table} WHERE run_id = ?", ("reused",))
    ctx.snapshots.delete("reused")
    while wall_ms() <= first.created_at_ms:
        pass  # the second run is created in a later millisecond, as any reuse is
    create_run(ctx, path, "second", run_id="reused")
    assert advance(ctx, "reused", None).outcome == "next"
    for name, data in earlier.items():
        (snapshots_dir(ctx) / name).write_bytes(data)
    ctx.forget_checkpoint("reused")
    # When its next turn loads it
    with caplog.at_level(logging.WARNING):
        assert advance(ctx, "reused", None).outcome == "suspended"
    # Then the earlier run's state is not used
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "earlier run with this id" in warnings[0]
    saved = ctx.snapshots.load("reused")
    assert saved is not None
    assert [m.content for m in saved.transcript if m.role == "user"] == ["second"]


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"doc": b"{truncated"}, id="not-a-packed-document"),
        pytest.param({"seq": b"five", "head": b"x", "n": b"1", "size": b"1", "chain": b"0"},
                     id="unparsable-parts"),
    ],
)  # fmt: skip
def test_on_redis_an_unusable_snapshot_is_renamed_into_its_quarantine_and_the_run_goes_on(
    redis_url: str, tmp_path: Path, ledger: Path, fields: dict[str, bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    from store.snapshots.redis import RedisSnapshotStore
    from tests.workers import redis_context

    ctx = redis_context(redis_url)
    try:
        run_id = two_runs(ctx, tmp_path)
        record = ctx.runs.get(run_id)
        assert record is not None and isinstance(ctx.snapshots, RedisSnapshotStore)
        client = ctx.snapshots._client
        key = f"ratchet:run:{{{run_id}}}:snapshot"
        client.delete(key)
        client.hset(key, "seq", str(record.last_seq).encode())
        for name, value in fields.items():
            client.hset(key, name, value)
        ctx.forget_checkpoint(run_id)
        with caplog.at_level(logging.WARNING):
            assert advance(ctx, run_id, record.last_seq).outcome == "suspended"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and f"snapshot of run {run_id} in snapshot store" in warnings[0]
        aside = client.keys(f"ratchet:quarantine:{{{run_id}}}:*:snapshot")
        assert len(aside) == 1 and client.hgetall(aside[0])[b"seq"] == fields.get(
            "seq", str(record.last_seq).encode()
        )
        assert ctx.snapshots.load(run_id) is not None
    finally:
        ctx.close()
