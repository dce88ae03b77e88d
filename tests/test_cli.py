"""The ``ratchet`` command against real stores: listing, showing, purging, answering.

In-process through click's CliRunner with a memory or SQLite context, and as a
subprocess on a pseudo-terminal where the command must know it talks to a person.
"""

from __future__ import annotations

import json
import math
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from runtime.errors import InvalidContinuation, SuspensionAlreadyAnswered
from runtime.models import Event
from store.conformance import FakeClock
from store.runs import RunRecord
from store.runs.memory import MemoryRunStore
from store.runs.sqlite import SqliteRunStore
from tasks.context import Context, set_context
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, drive, installed_context, memory_context, turn, write_agent
from worker.api import Ratchet
from worker.cli import main
from worker.exits import Exit

ROOT = Path(__file__).resolve().parents[1]
ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]
TWO_APPROVALS = [
    turn("first", call("issue_refund", order_id="B2", amount_cents=100)),
    turn("second", call("issue_refund", order_id="B2", amount_cents=200)),
    turn("Both refunded."),
]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ctx(clock: FakeClock, ledger: Path) -> Iterator[Context]:
    context = memory_context()
    context.runs = MemoryRunStore(clock=clock)
    with installed_context(context):
        yield context


def cli(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=input)


def finished_run(ctx: Context, agent: Path, text: str = "refund B2") -> str:
    run_id = create_run(ctx, agent, text).run_id
    drive(ctx, run_id)
    return run_id


# --- runs list (item 9) ---------------------------------------------------------


def test_runs_list_filters_by_agent_and_age_pages_with_a_cursor_and_shows_times(
    ctx: Context, clock: FakeClock, tmp_path: Path
) -> None:
    desk = write_agent(tmp_path / "a", [turn("Done.")], name="desk")
    other = write_agent(tmp_path / "b", [turn("Done.")], name="other")
    ids = []
    for i in range(5):
        clock.now_ms += 60_000
        ids.append(finished_run(ctx, desk if i != 2 else other))
    newest_desk = [ids[4], ids[3], ids[1], ids[0]]

    first = cli("runs", "list", "--agent", "desk", "--limit", "2", "--json")
    assert first.exit_code == 0, first.output
    page = json.loads(first.stdout)
    assert [r["run_id"] for r in page] == newest_desk[:2]
    cursor = f"{page[-1]['created_at_ms']}.{page[-1]['run_id']}"  # as the docstring says
    assert first.stderr == f"more: ratchet runs list --cursor {cursor}\n"
    second = cli("runs", "list", "--agent", "desk", "--limit", "2", "--json", "--cursor", cursor)
    assert [r["run_id"] for r in json.loads(second.stdout)] == newest_desk[2:]
    assert second.stderr == ""  # the last page

    # --since 150s: the runs created in the last two and a half minutes (the last three)
    recent = json.loads(cli("runs", "list", "--since", "150s", "--json").stdout)
    assert [r["run_id"] for r in recent] == [ids[4], ids[3], ids[2]]

    table = cli("runs", "list", "--limit", "1")
    assert table.exit_code == 0
    header, row = table.stdout.splitlines()[:2]
    assert "CREATED (UTC)" in header and "UPDATED (UTC)" in header
    assert "2023-11-14 22:" in row  # the injected clock, to the second
    assert "more: ratchet runs list --cursor " in table.stderr

    bad = cli("runs", "list", "--cursor", "nonsense")
    assert bad.exit_code == Exit.USAGE and "is not a cursor a previous page printed" in bad.output


# --- runs show (items 16, 18) ---------------------------------------------------


def test_show_json_counts_the_current_suspension_as_the_text_view_does_and_gives_its_seq(
    ctx: Context, clock: FakeClock, tmp_path: Path
) -> None:
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund").run_id
    drive(ctx, run_id)
    clock.now_ms += 1_800
    shown = json.loads(cli("runs", "show", run_id, "--json").output)
    text = cli("runs", "show", run_id).output
    suspension_seq = ctx.runs.get(run_id).suspension.seq  # type: ignore[union-attr]
    assert shown["suspended_ms"] == 1_800
    assert "suspended 1.8s" in text
    assert shown["suspension_seq"] == suspension_seq
    assert f"(seq {suspension_seq}," in text


# --- continue: the suspension it answers (item 16) ----------------------------


def wait_for(api: Ratchet, run_id: str, done: Callable[[RunRecord], bool]) -> RunRecord:
    deadline = time.monotonic() + 60
    while True:
        record = api.ctx.runs.get(run_id)
        if record is not None and done(record):
            return record
        assert time.monotonic() < deadline, f"run {run_id} did not get there: {record}"
        time.sleep(0.02)


def suspended_at(api: Ratchet, run_id: str, after_seq: int = 0) -> int:
    """Wait until the run waits for a person at a suspension after ``after_seq``; its seq."""
    record = wait_for(
        api,
        run_id,
        lambda r: (
            r.status.is_suspended and r.suspension is not None and r.suspension.seq > after_seq
        ),
    )
    assert record.suspension is not None
    return record.suspension.seq


# These answer runs, which chains turns: on the session worker (a real broker), never
# on the default app's broker.


def test_the_cli_answers_the_suspension_it_shows_and_says_which(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, TWO_APPROVALS, require_approval=["issue_refund"])
    run_id = ratchet.start(agent, "refund twice")
    first_seq = suspended_at(ratchet, run_id)
    answered = cli("runs", "continue", run_id, "--approve", "--json")
    assert answered.exit_code == 0, answered.output
    assert json.loads(answered.output)["suspension_seq"] == first_seq
    second_seq = suspended_at(ratchet, run_id, first_seq)
    text = cli("runs", "continue", run_id, "--approve")
    assert text.exit_code == 0, text.output
    assert f"answering the suspension at seq {second_seq} awaiting_approval: tool issue_refund" in (
        text.output
    )
    assert wait_for(ratchet, run_id, lambda r: r.status.is_terminal).output == "Both refunded."


def test_an_answer_naming_neither_its_id_nor_its_suspension_is_refused_unless_allowed(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, TWO_APPROVALS, require_approval=["issue_refund"])
    run_id = ratchet.start(agent, "refund twice")
    first_seq = suspended_at(ratchet, run_id)
    assert ratchet.continue_run(run_id, approve=True, suspension_seq=first_seq) == "continued"
    suspended_at(ratchet, run_id, first_seq)
    # A client retrying its first approval late, without saying which one, is refused:
    with pytest.raises(InvalidContinuation, match="neither a continuation_id nor a suspension_seq"):
        ratchet.continue_run(run_id, approve=True)
    # and the same retry naming the first suspension is refused as already answered.
    with pytest.raises(SuspensionAlreadyAnswered):
        ratchet.continue_run(run_id, approve=True, suspension_seq=first_seq)
    assert [e.type for e in ratchet.events(run_id)].count("run.continued") == 1

    ctx = ratchet.ctx
    settings = ctx.settings.model_copy(update={"allow_unpinned_continuations": True})
    lax = Ratchet(Context(settings, ctx.snapshots, ctx.runs))
    assert lax.continue_run(run_id, approve=True) == "continued"
    assert wait_for(ratchet, run_id, lambda r: r.status.is_terminal).status.value == "completed"


def test_the_continue_task_refuses_an_unpinned_answer(ratchet: Ratchet, tmp_path: Path) -> None:
    from tasks.control import continue_run

    run_id = ratchet.start(write_agent(tmp_path, ASK), "refund")
    seq = suspended_at(ratchet, run_id)
    before = ratchet.events(run_id)
    # The task body, run here (Celery's apply): what a worker does with such a message.
    assert continue_run.apply(kwargs={"run_id": run_id, "input": "B2"}).get() == "refused"
    assert ratchet.events(run_id) == before
    pinned = {"run_id": run_id, "input": "B2", "suspension_seq": seq}
    assert continue_run.apply(kwargs=pinned).get() == "continued"


# --- purge (item 10) ------------------------------------------------------------


def test_purge_dry_run_lists_and_deletes_nothing_and_an_absurd_age_is_named_as_typed(
    ctx: Context, clock: FakeClock, tmp_path: Path
) -> None:
    agent = write_agent(tmp_path, [turn("Done.")])
    old = [finished_run(ctx, agent) for _ in range(3)]
    clock.now_ms += 10 * 86_400_000
    fresh = finished_run(ctx, agent)
    dry = cli("runs", "purge", "--older-than", "1d", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would purge 3 finished run(s)" in dry.output
    assert all(run_id in dry.output for run_id in old) and fresh not in dry.output
    assert all(ctx.runs.get(run_id) is not None for run_id in old)
    as_json = json.loads(cli("runs", "purge", "--older-than", "1d", "--dry-run", "--json").output)
    assert sorted(as_json["would_purge"]) == sorted(old)

    absurd = cli("runs", "purge", "--older-than", "99999999999999d")
    assert absurd.exit_code == Exit.USAGE
    assert "--older-than 99999999999999d reaches back before 1970" in absurd.output
    assert "before_ms" not in absurd.output

    # Not on a terminal (a script) and no --yes: refused in one line, nothing deleted
    unasked = cli("runs", "purge", "--older-than", "1d")
    assert unasked.exit_code == Exit.REFUSED, unasked.output
    assert unasked.stderr.count("\n") == 1 and "no terminal to ask on; add --yes" in unasked.stderr
    assert all(ctx.runs.get(run_id) is not None for run_id in old)
    # With --yes: no question, and --json says how many.
    done = cli("runs", "purge", "--older-than", "1d", "--yes", "--json")
    assert json.loads(done.output)["purged"] == 3
    assert all(ctx.runs.get(run_id) is None for run_id in old) and ctx.runs.get(fresh)


def run_on_a_terminal(args: list[str], env: dict[str, str], answer: bytes) -> tuple[int, str]:
    """Run ``python -m worker ARGS`` with a pseudo-terminal as stdin/stdout; type ``answer``."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "worker", *args],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        cwd=ROOT,
    )
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 60
    typed = False
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        if not typed and b"[y/N]" in seen:
            os.write(leader, answer)
            typed = True
        if process.poll() is not None and not ready:
            break
    code = process.wait(timeout=30)
    os.close(leader)
    return code, seen.decode(errors="replace")


def test_purge_on_a_terminal_asks_first_and_no_keeps_everything(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_DATA_DIR=str(data),
        PYTHONPATH=str(ROOT),
        RATCHET_EXAMPLE_LEDGER=str(tmp_path / "ledger"),
    )
    store = SqliteRunStore(data / "runs.sqlite3")
    local = Context(Settings(data_dir=data), memory_context().snapshots, store)
    agent = write_agent(tmp_path, [turn("Done.")])
    ids = [finished_run(local, agent) for _ in range(2)]
    store.close()

    code, seen = run_on_a_terminal(["runs", "purge", "--older-than", "0s"], env, b"n\n")
    assert "delete 2 finished run(s) last updated before" in seen, seen
    assert code == 1 and "Aborted" in seen
    code, seen = run_on_a_terminal(["runs", "list", "--json"], env, b"")
    assert sorted(r["run_id"] for r in json.loads(seen)) == sorted(ids)

    code, seen = run_on_a_terminal(["runs", "purge", "--older-than", "0s"], env, b"y\n")
    assert code == 0 and "purged 2 finished run(s)" in seen, seen
    code, seen = run_on_a_terminal(["runs", "purge", "--older-than", "0s", "--yes"], env, b"")
    assert code == 0 and "purged 0 finished run(s)" in seen and "[y/N]" not in seen


# --- --json everywhere (item 9) and small things (item 18) -------------------------


def test_every_command_that_prints_has_json(ratchet: Ratchet, tmp_path: Path) -> None:
    run_id = ratchet.start(write_agent(tmp_path, ASK), "refund")
    seq = suspended_at(ratchet, run_id)
    continued = json.loads(cli("runs", "continue", run_id, "--input", "B2", "--json").output)
    assert continued["outcome"] == "continued" and continued["suspension_seq"] == seq
    wait_for(ratchet, run_id, lambda r: r.status.is_terminal)
    other = ratchet.start(write_agent(tmp_path / "x", ASK), "refund")
    suspended_at(ratchet, other)
    cancelled = json.loads(cli("runs", "cancel", other, "--json").output)
    assert cancelled["status"] == "cancelled"
    assert json.loads(cli("sweep", "--once", "--json").output) == {"orphaned": []}
    refused = cli("runs", "resume", run_id, "--json")
    assert refused.exit_code == 1 and "nothing to resume" in refused.output
    for command in (
        "resume",
        "reconcile",
        "purge",
        "sweep",
        "continue",
        "cancel",
        "list",
        "show",
        "events",
        "start",
    ):
        group = [] if command == "sweep" else ["runs"]
        assert "--json" in cli(*group, command, "--help").output, command


def test_small_things_are_said_plainly(ctx: Context, tmp_path: Path) -> None:
    assert cli("sweep", "--once").output == "sweep: no orphaned runs\n"
    missing = cli("runs", "start", str(tmp_path / "nope.toml"), "--input", "hi")
    assert missing.exit_code == Exit.USAGE  # the agent file argument is bad
    assert "Errno" not in missing.output and "nope.toml" in missing.output
    assert "check the path" in missing.output or "no such file" in missing.output
    empty = cli("runs", "start", str(tmp_path / "nope.toml"), "--input", "hi", "--run-id", "")
    assert empty.exit_code == 2 and "'' is not a run id" in empty.output
    keyed = tmp_path / "keyed.toml"
    keyed.write_text('name = "k"\nmodel = "scripted"\nscript = "k.json"\napi_key = "sk-x"\n')
    refused = cli("runs", "start", str(keyed), "--input", "hi")
    assert refused.exit_code == Exit.USAGE and "RATCHET_OPENAI_API_KEY" in refused.output
    assert "sk-x" not in refused.output
    for package in ("runtime", "runtime_io", "store", "tasks", "worker"):
        assert (ROOT / package / "py.typed").is_file()


def test_a_refused_request_is_one_line_naming_the_run_and_what_to_do(
    ctx: Context, tmp_path: Path
) -> None:
    # Given a run waiting for an answer, with a max_turns of 5
    agent = write_agent(tmp_path, ASK, budgets={"max_turns": 5})
    run_id = create_run(ctx, agent, "refund it").run_id
    drive(ctx, run_id)
    # When an operator "raises" its max_turns to less than it is
    refused = cli("runs", "budget", run_id, "--max-turns", "1", "--reason", "more")
    # Then one line on stderr names the run, what is wrong and what to do, and exit 1
    assert refused.exit_code == 1
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.output
    assert refused.stderr.startswith(f"ratchet: run {run_id}: `max_turns` is 5: 1 would not")
    assert "nothing was changed — correct it and try again" in refused.stderr


def test_snapshots_show_prints_the_embedded_defaults_document_byte_for_byte(
    tmp_path: Path,
) -> None:
    # The embedded default, as a worker with nothing set opens it: the snapshots live in the
    # run store's SQLite database, and a checkpoint is one transaction with its events.
    from runtime.fsm import rebuild
    from store import open_run_store, open_snapshot_store
    from store.snapshots import format as snapshot_format
    from store.snapshots.sqlite import SqliteSnapshotStore
    from tasks.turn import advance

    settings = Settings(data_dir=tmp_path / "data")
    ctx = Context(
        settings,
        open_snapshot_store(settings.resolved_snapshot_store),
        open_run_store(settings.resolved_run_store),
    )
    assert isinstance(ctx.snapshots, SqliteSnapshotStore)
    assert ctx.runs.commits_with(ctx.snapshots)
    agent = write_agent(
        tmp_path,
        [turn(f"step {i}", call("lookup_order", order_id="A1")) for i in range(4)] + [turn("ok")],
    )
    run_id = create_run(ctx, agent, "where is my order?").run_id
    done = advance(ctx, run_id, None)
    for _ in range(2):
        done = advance(ctx, run_id, done.seq)
    assert done.outcome == "next"
    set_context(ctx)
    try:
        shown = cli("snapshots", "show", run_id)
    finally:
        set_context(None)

    assert shown.exit_code == 0, shown.output
    state = rebuild(ctx.runs.events(run_id))  # what the run's own events fold to
    assert state is not None and state.usage.model_turns == 3
    assert shown.output.encode() == snapshot_format.encode(state)
    assert not (tmp_path / "data" / "snapshots").exists()


# --- any stored event prints (issue 30) ---------------------------------------------------


def test_show_and_events_print_any_stored_event_text_and_json_without_a_traceback(
    ctx: Context, tmp_path: Path
) -> None:
    # Given a finished run whose log holds what a store may hand back from older builds and
    # odd writers: lone surrogates, an integer too long for text, NaN, missing keys
    run_id = finished_run(ctx, write_agent(tmp_path, [turn("Done.")]))
    record = ctx.runs.get(run_id)
    assert record is not None
    odd: list[tuple[str, dict[str, Any]]] = [
        ("tool.completed", {"call_id": "c1", "name": "t\ud800", "result": {"k\udc00": "\ud83d"}}),
        ("tool.completed", {"call_id": "c2", "name": "big", "result": 10**5000}),
        ("tool.probed", {"call_id": "c3", "name": "p", "answer": "ran", "result": math.nan}),
        ("tool.requested", {"call_id": "c4", "name": "q", "arguments": {"id": "\ud800"}}),
        ("run.created", {"input": 7}),
        ("something.new", {"note": "partial emoji \ud83d", "when": math.inf}),
    ]
    events = [
        Event(seq=record.last_seq + i, type=kind, at_ms=record.updated_at_ms, data=data)
        for i, (kind, data) in enumerate(odd, start=1)
    ]
    last = record.model_copy(update={"last_seq": events[-1].seq, "output": "Done \ud83d"})
    ctx.runs.append(last, events, None)
    # When the CLI shows the run and its events, as text and as JSON
    shown = cli("runs", "show", run_id)
    as_json = cli("runs", "show", run_id, "--json")
    listed = cli("runs", "events", run_id)
    listed_json = cli("runs", "events", run_id, "--json")
    # Then each prints, with U+FFFD for a lone surrogate and a note for the integer
    for result in (shown, as_json, listed, listed_json):
        assert result.exit_code == 0 and result.exception is None, result.output
    assert "output     Done \ufffd" in shown.output
    assert json.loads(as_json.output)["output"] == "Done \ufffd"
    lines = listed.output.splitlines()
    assert len(lines) == events[-1].seq
    assert "t\ufffd → " in lines[-6] and "<an integer of about 5000 digits>" in lines[-5]
    documents = [json.loads(line) for line in listed_json.output.splitlines()]
    assert documents[-6]["data"]["result"] == {"k\ufffd": "\ufffd"}
    assert documents[-4]["data"]["result"] == "nan" and documents[-1]["data"]["when"] == "inf"


def test_limits_cap_refuses_a_negative_count_by_its_range_and_unset_keys_are_not_listed(
    ctx: Context,
) -> None:
    # A negative count is a count out of range, not an option `-1`
    negative = cli("limits", "cap", "key:tenant-a", "-1")
    assert negative.exit_code == Exit.USAGE
    assert "-1 is not in the range x>=1" in negative.output, negative.output
    # A key set at run time is listed while it is set, and not once it is unset
    assert cli("limits", "set", "tenant-a", "--rpm", "60").exit_code == 0
    assert cli("limits", "cap", "key:tenant-a", "3").exit_code == 0
    listed = cli("limits").output
    assert "tenant-a:" in listed and "key:tenant-a:" in listed
    assert cli("limits", "unset", "tenant-a").exit_code == 0
    assert cli("limits", "uncap", "key:tenant-a").exit_code == 0
    assert cli("limits", "--json").output.strip() == '{"caps": [], "limits": []}'
    assert cli("limits").output.startswith("no limits used yet")


def test_a_run_cancelled_while_suspended_counts_its_wait_as_suspended_not_running(
    ctx: Context, clock: FakeClock, tmp_path: Path
) -> None:
    from runtime.fsm import rebuild

    # Given a run that has waited 1.35 s for an answer
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund it").run_id
    drive(ctx, run_id)
    clock.now_ms += 1350
    waiting = json.loads(cli("runs", "show", run_id, "--json").output)
    assert waiting["suspended_ms"] == 1350
    # When it is cancelled, and looked at a while later
    assert cli("runs", "cancel", run_id, "--reason", "hung up").exit_code == 0
    clock.now_ms += 5000
    shown = json.loads(cli("runs", "show", run_id, "--json").output)
    # Then its wait counts as suspended, and its running time is what it was
    assert shown["status"] == "cancelled"
    assert (shown["running_ms"], shown["suspended_ms"]) == (waiting["running_ms"], 1350)
    # and the fold of its events agrees with the record
    state = rebuild(ctx.runs.events(run_id))
    assert state is not None and state.suspended_ms == 1350 and state.suspension is None
