"""Appending snapshot backends (sqlite, redis, s3): a save writes only what is new.

The conformance suite proves they store and load like every backend; these
tests prove what only they promise: the bytes a checkpoint writes stay flat as
the transcript grows, the document read back is byte-identical to the
encoding, and a stored transcript that is not a prefix of the new one is
detected and rewritten.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.errors import SnapshotMalformed, SnapshotTooLarge
from runtime.models import Message, RunState, ToolCall
from store.snapshots import format as snapshot_format
from store.snapshots.redis import RedisSnapshotStore
from store.snapshots.s3 import S3SnapshotStore
from store.snapshots.sqlite import SqliteSnapshotStore
from tests.contract.test_snapshot_store_contract import make_state, rich_state

APPENDING = ("sqlite", "redis", "s3")
Appending = RedisSnapshotStore | S3SnapshotStore | SqliteSnapshotStore


@pytest.fixture(params=APPENDING)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Appending]:
    opened: Appending
    if request.param == "sqlite":
        opened = SqliteSnapshotStore(tmp_path / "runs.sqlite3")
    elif request.param == "redis":
        opened = RedisSnapshotStore.from_url(request.getfixturevalue("redis_url"))
    else:
        opened = S3SnapshotStore.from_url(request.getfixturevalue("s3_url"))
    yield opened
    opened.close()


def another(store: Appending, request: pytest.FixtureRequest) -> Appending:
    """A second worker's store on the same backend."""
    if isinstance(store, SqliteSnapshotStore):
        return SqliteSnapshotStore(store.path)
    url = request.getfixturevalue(
        "redis_url" if isinstance(store, RedisSnapshotStore) else "s3_url"
    )
    return type(store).from_url(url)


def grown(state: RunState, turn: int) -> RunState:
    result = f"turn {turn}: " + " ".join(f"w{(turn * 7919 + i) % 1009}" for i in range(300))
    messages = (
        Message(role="assistant", tool_calls=(ToolCall(id=f"c{turn}", name="look"),)),
        Message(role="tool", content=result, tool_call_id=f"c{turn}", name="look"),
    )
    return state.model_copy(
        update={"seq": state.seq + 2, "transcript": state.transcript + messages}
    )


def test_the_bytes_a_save_writes_do_not_grow_with_the_transcript(
    store: Appending,
) -> None:
    # Given a run checkpointed once per turn for 60 turns
    state = make_state(seq=1)
    store.save(state, expected_seq=None)
    written: list[int] = []
    for turn in range(1, 61):
        before, previous = store.bytes_written, state.seq
        state = grown(state, turn)
        store.save(state, expected_seq=previous)
        written.append(store.bytes_written - before)

    # Then the last saves cost what the first ones did, while the document grew 30-fold
    # (S3 trades a little: a save folds the newest objects together so that a load reads
    # at most three, docs/stores.md; its bytes grow with the cube root of the transcript)
    first, last = sum(written[:10]) / 10, sum(written[-10:]) / 10
    assert last <= first * (1.5 if isinstance(store, S3SnapshotStore) else 1.1), (first, last)
    assert len(snapshot_format.encode(state)) > 30 * last
    # and the document reads back whole and byte-identical
    assert store.load_document("run-1") == snapshot_format.encode(state)
    assert store.load("run-1") == state


def test_a_store_that_did_not_save_the_run_appends_after_reading_the_tip(
    store: Appending, request: pytest.FixtureRequest
) -> None:
    # Given a snapshot saved by one worker
    state = grown(make_state(seq=1), 1)
    store.save(state, expected_seq=None)
    other = another(store, request)

    # When a second worker, which never loaded it, checkpoints the next turn
    newer = grown(state, 2)
    other.save(newer, expected_seq=state.seq)

    # Then it appended (wrote the head and the new turn, not the document) and the result
    # is exact
    new_turn = len(snapshot_format.encode(newer)) - len(snapshot_format.encode(state))
    assert other.bytes_written < len(snapshot_format.encode_head(newer)) + 1.1 * new_turn
    assert other.bytes_written < len(snapshot_format.encode(newer)) - new_turn
    assert store.load_document("run-1") == snapshot_format.encode(newer)
    other.close()


def test_a_transcript_that_is_not_a_prefix_of_the_stored_one_is_rewritten_whole(
    store: Appending, caplog: pytest.LogCaptureFixture
) -> None:
    store.save(grown(make_state(seq=1), 1), expected_seq=None)
    # A state whose earlier messages differ: never produced by the runtime, but the
    # store must not splice it onto what it holds.
    rewritten = grown(make_state(seq=1, content="another question"), 7)

    store.save(rewritten, expected_seq=3)

    assert store.load("run-1") == rewritten
    assert store.load_document("run-1") == snapshot_format.encode(rewritten)
    assert "not a prefix" in caplog.text


def test_the_size_limit_counts_the_whole_document_not_the_bytes_sent(
    store: Appending,
) -> None:
    state = make_state(seq=1)
    for turn in range(1, 6):
        state = grown(state, turn)
    store.save(make_state(seq=1), expected_seq=None)
    store.save(state, expected_seq=1)
    store.max_bytes = len(snapshot_format.encode(state)) + 100

    with pytest.raises(SnapshotTooLarge) as refused:
        store.save(grown(state, 6), expected_seq=state.seq)

    assert f"{len(snapshot_format.encode(grown(state, 6)))} bytes" in str(refused.value)
    assert store.load("run-1") == state


def test_a_tampered_transcript_is_refused_on_load_not_returned(
    store: Appending, request: pytest.FixtureRequest
) -> None:
    state = grown(make_state(seq=1), 1)
    store.save(state, expected_seq=None)
    if isinstance(store, SqliteSnapshotStore):
        store._connection().execute(
            "UPDATE snapshot_fragments SET fragment = ? WHERE run_id = 'run-1' AND idx = 1",
            (b'      {"role": "user"}',),
        )
    elif isinstance(store, RedisSnapshotStore):
        store._client.lset(store._transcript_key("run-1"), 1, '      {"role": "user"}')
    else:
        prefix = store._transcript_prefix("run-1")
        (key,) = list(store._keys(prefix))
        store._client.put_object(Bucket=store._bucket, Key=key, Body=b"3\nabc")

    # (Read by a worker that does not remember the run: one that does reads only what
    # follows the tip it saved, and keeps what it remembers of the rest.)
    reader = another(store, request)
    with pytest.raises(SnapshotMalformed) as refused:
        reader.load("run-1")

    assert "ratchet runs resume run-1" in str(refused.value)
    reader.close()


def test_a_store_that_loaded_the_run_before_reads_only_the_new_messages_and_agrees(
    store: Appending, request: pytest.FixtureRequest
) -> None:
    # Given two workers taking a run's turns in alternation
    other = another(store, request)
    state = grown(make_state(seq=1), 1)
    store.save(state, expected_seq=None)
    for turn_no in range(2, 22):
        saver = store if turn_no % 2 else other
        loaded = saver.load("run-1")
        assert loaded == state
        state = grown(state, turn_no)
        saver.save(state, expected_seq=loaded.seq)

    # Then each one's load is the whole read's state and document
    fresh = another(store, request)
    assert store.load("run-1") == other.load("run-1") == fresh.load("run-1") == state
    assert store.load_document("run-1") == snapshot_format.encode(state)
    if isinstance(store, RedisSnapshotStore):
        # On Redis a worker that loaded the run reads only the messages after its tip:
        # the first message, spoiled now, is not read again (a fresh store refuses it).
        store._client.lset(store._transcript_key("run-1"), 0, "spoiled")
        state = grown(state, 22)
        other.save(state, expected_seq=state.seq - 2)
        assert store.load("run-1") == state
        unknowing = another(store, request)
        with pytest.raises(SnapshotMalformed):
            unknowing.load("run-1")
        unknowing.close()
    fresh.close()
    other.close()


@settings(max_examples=60, deadline=None)
@given(
    contents=st.lists(st.text(max_size=40), max_size=6),
    arguments=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
)
def test_head_and_fragments_assemble_into_exactly_the_document(
    contents: list[str], arguments: dict[str, str]
) -> None:
    base = rich_state()
    messages = tuple(
        Message(role="tool", content=c, tool_call_id="x", name="transcript") for c in contents
    )
    call = ToolCall(id="t", name="transcript", arguments={"transcript": [], **arguments})
    state = base.model_copy(update={"transcript": messages, "pending": (call,)})
    fragments = [snapshot_format.encode_fragment(m) for m in messages]
    head = snapshot_format.encode_head(state)

    document = snapshot_format.assemble(head, fragments)

    assert document == snapshot_format.encode(state)
    assert snapshot_format.document_size(head, len(fragments), sum(map(len, fragments))) == len(
        document
    )


def test_a_worker_that_remembers_an_older_seq_appends_after_the_stored_tip_not_its_own(
    store: Appending, request: pytest.FixtureRequest
) -> None:
    # Given worker A saved a run at seq 3, and worker B then took it on to seq 5
    state = grown(make_state(seq=1), 1)
    store.save(state, expected_seq=None)
    other = another(store, request)
    taken_on = grown(state, 2)
    other.save(taken_on, expected_seq=state.seq)
    one_turn = other.bytes_written  # B appended one turn after the tip it read

    # When A (which remembers seq 3, not 5) checkpoints the turn after B's
    before = store.bytes_written
    newest = grown(taken_on, 3)
    store.save(newest, expected_seq=taken_on.seq)

    # Then it wrote only the newest turn (on S3, folded with the stored tip's newest
    # object, never the whole transcript): its remembered tip was not trusted
    bound = 2.0 if isinstance(store, S3SnapshotStore) else 1.5
    assert store.bytes_written - before < bound * one_turn
    assert other.load_document("run-1") == snapshot_format.encode(newest)
    other.close()
