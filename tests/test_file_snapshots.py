"""The file snapshot store (the embedded default) is flat: a head plus an appended transcript.

The conformance suite proves it stores and loads like every backend; these
tests prove what its layout promises: a long run's document reads back exactly
as the whole-file layout wrote it, the bytes a checkpoint writes stay flat,
files of the previous layout stay readable and are converted by the next save,
and what a dying save leaves behind is never read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.errors import SnapshotMalformed
from runtime.fsm import rebuild
from runtime.models import Message, RunState, ToolCall
from store.runs.sqlite import SqliteRunStore
from store.snapshots import format as snapshot_format
from store.snapshots.file import FileSnapshotStore
from store.snapshots.memory import MemorySnapshotStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.contract.test_snapshot_store_contract import make_state
from tests.helpers import call, turn, write_agent

GOLDEN = Path(__file__).parent / "golden" / "snapshot-v1.json"
GOLDEN_V2 = Path(__file__).parent / "golden" / "snapshot-v2.json"
"""The same run as :data:`GOLDEN`, in the format this build writes (2)."""
TURNS = 60


def grown(state: RunState, turn_no: int) -> RunState:
    result = f"turn {turn_no}: " + " ".join(f"w{(turn_no * 7919 + i) % 1009}" for i in range(300))
    messages = (
        Message(role="assistant", tool_calls=(ToolCall(id=f"c{turn_no}", name="look"),)),
        Message(role="tool", content=result, tool_call_id=f"c{turn_no}", name="look"),
    )
    return state.model_copy(
        update={"seq": state.seq + 2, "transcript": state.transcript + messages}
    )


def test_a_long_run_on_the_file_store_reads_back_as_the_document_the_whole_file_held(
    tmp_path: Path,
) -> None:
    # Given a 60-turn run driven through the engine on the embedded stores, every turn
    # as a process that remembers nothing would take it (it reads the snapshot back)
    data = tmp_path / "data"
    snapshots = FileSnapshotStore(data / "snapshots")
    ctx = Context(Settings(), snapshots, SqliteRunStore(data / "runs.sqlite3"))
    script = [turn(f"looking {i}", call("lookup_order", order_id=f"A{i}")) for i in range(TURNS)]
    agent = write_agent(
        tmp_path,
        [*script, turn("Done.")],
        budgets={"max_turns": TURNS + 5, "max_tool_calls": TURNS + 5},
    )
    run_id = create_run(ctx, agent, "check sixty orders").run_id
    memory = MemorySnapshotStore()
    written: list[int] = []
    done = advance(ctx, run_id, None)
    for _ in range(TURNS - 1):
        assert done.outcome == "next"
        ctx.forget_checkpoint(run_id)
        before, previous = snapshots.bytes_written, memory.load(run_id)
        done = advance(ctx, run_id, done.seq)
        written.append(snapshots.bytes_written - before)
        saved = snapshots.load(run_id)
        assert saved is not None and saved.seq == done.seq
        memory.save(saved, previous.seq if previous is not None else None)

    # Then the document is byte-identical to the one the whole-file layout wrote (the
    # readable encoding, which the memory store holds as it is) and to the state the
    # event log rebuilds
    document = snapshots.load_document(run_id)
    rebuilt = rebuild(ctx.runs.events(run_id))
    assert rebuilt is not None and len(rebuilt.transcript) > 2 * TURNS
    assert document == memory.load_document(run_id) == snapshot_format.encode(rebuilt)
    assert snapshots.load(run_id) == rebuilt
    # (and the run goes on to complete from it)
    while done.outcome == "next":
        done = advance(ctx, run_id, done.seq)
    assert done.outcome == "completed"
    # and the last turns wrote what the first ones did, while the document grew many-fold
    first, last = sum(written[1:11]) / 10, sum(written[-11:-1]) / 10
    assert last <= first * 1.25, (first, last)
    assert len(document) > 5 * last
    ctx.close()


def test_a_snapshot_file_of_the_previous_layout_is_read_shown_and_converted_by_the_next_save(
    tmp_path: Path,
) -> None:
    # Given the golden snapshot, stored as the whole-file layout stored every run
    directory = tmp_path / "data" / "snapshots"
    directory.mkdir(parents=True)
    golden = GOLDEN.read_bytes()
    run_id = json.loads(golden)["run"]["run_id"]
    (directory / f"{run_id}.json").write_bytes(golden)
    store = FileSnapshotStore(directory)

    # Then it loads (format 1, upgraded on load), and reads as the document it holds (what
    # `ratchet snapshots show` prints) exactly
    state = store.load(run_id)
    assert state is not None and snapshot_format.encode(state) == GOLDEN_V2.read_bytes()
    assert store.load_document(run_id) == golden

    # When a process that never loaded it saves the run's next checkpoint
    newer = grown(state, 1)
    FileSnapshotStore(directory).save(newer, expected_seq=state.seq)

    # Then the whole file is replaced by a head and a transcript holding the same document
    assert not (directory / f"{run_id}.json").exists()
    assert (directory / f"{run_id}.head").is_file()
    assert len(list(directory.glob(f"{run_id}.*.transcript"))) == 1
    assert store.load_document(run_id) == snapshot_format.encode(newer)
    assert store.list() == [run_id]


@pytest.mark.parametrize("fsync", [False, True])
def test_bytes_a_dying_save_appended_are_never_read_and_the_next_save_cuts_them_off(
    tmp_path: Path, fsync: bool
) -> None:
    # Given a run saved twice, and a save that died after appending to the transcript
    # but before its head was renamed into place (bytes no head names)
    directory = tmp_path / "snapshots"
    store = FileSnapshotStore(directory, fsync=fsync)
    state = grown(make_state(seq=1), 1)
    store.save(state, expected_seq=None)
    (transcript,) = directory.glob("run-1.*.transcript")
    with transcript.open("ab") as torn:
        torn.write(b'812\n      {\n        "content": "half a mess')

    # Then a reader sees the saved document, not the torn tail
    assert store.load_document("run-1") == snapshot_format.encode(state)
    # and the next save, from a process that remembers nothing, appends after the head's end
    newer = grown(state, 2)
    FileSnapshotStore(directory, fsync=fsync).save(newer, expected_seq=state.seq)
    assert store.load_document("run-1") == snapshot_format.encode(newer)
    assert b"half a mess" not in transcript.read_bytes()


def test_a_store_that_loaded_the_run_before_decodes_only_the_new_messages_and_agrees(
    tmp_path: Path,
) -> None:
    # Given two processes on one directory, taking a run's turns in alternation
    directory = tmp_path / "snapshots"
    one, other = FileSnapshotStore(directory), FileSnapshotStore(directory)
    state = make_state(seq=1)
    one.save(state, expected_seq=None)
    for turn_no in range(1, 21):
        saver = one if turn_no % 2 else other
        loaded = saver.load("run-1")
        assert loaded == state
        state = grown(state, turn_no)
        saver.save(state, expected_seq=loaded.seq)
    # Then what each loads (only the messages after its last tip) is the whole read's state
    fresh = FileSnapshotStore(directory).load("run-1")
    assert one.load("run-1") == other.load("run-1") == fresh == state
    assert one.load_document("run-1") == snapshot_format.encode(state)


def test_a_save_that_replaces_the_transcript_removes_the_old_file(tmp_path: Path) -> None:
    directory = tmp_path / "snapshots"
    store = FileSnapshotStore(directory)
    store.save(grown(make_state(seq=1), 1), expected_seq=None)
    (old,) = directory.glob("run-1.*.transcript")
    # A transcript that is not a prefix of the stored one is rewritten whole
    rewritten = grown(make_state(seq=1, content="another question"), 7)

    store.save(rewritten, expected_seq=3)

    (new,) = directory.glob("run-1.*.transcript")
    assert new != old and not old.exists()
    assert store.load_document("run-1") == snapshot_format.encode(rewritten)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda t: t.write_bytes(t.read_bytes()[:-5]), "fewer than"),
        (lambda t: t.write_bytes(t.read_bytes().replace(b"turn 1", b"turn 9")), "do not match"),
        (lambda t: t.unlink(), "kept disappearing"),
    ],
    ids=["cut-short", "tampered", "removed"],
)
def test_a_damaged_transcript_is_refused_on_load_not_returned(
    tmp_path: Path, damage: object, problem: str
) -> None:
    directory = tmp_path / "snapshots"
    store = FileSnapshotStore(directory)
    store.save(grown(make_state(seq=1), 1), expected_seq=None)
    (transcript,) = directory.glob("run-1.*.transcript")

    damage(transcript)  # type: ignore[operator]

    # (a process that remembers nothing of the run: this one may trust what it saved)
    with pytest.raises(SnapshotMalformed, match=problem):
        FileSnapshotStore(directory).load("run-1")


def test_a_transcript_no_head_names_is_removed_when_the_store_opens(tmp_path: Path) -> None:
    # Given a run's first save that died after writing its transcript, beside a saved run
    directory = tmp_path / "snapshots"
    store = FileSnapshotStore(directory)
    store.save(grown(make_state(seq=1), 1), expected_seq=None)
    (kept,) = directory.glob("run-1.*.transcript")
    (directory / "run-2.0123456789abcdef.transcript").write_bytes(b"3\nabc")
    # When a worker opens the store, the orphan is gone and the saved run intact
    FileSnapshotStore(directory)
    assert sorted(p.name for p in directory.glob("*.transcript")) == [kept.name]
    assert store.load_document("run-1") == snapshot_format.encode(grown(make_state(seq=1), 1))
