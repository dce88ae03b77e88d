"""What only the S3 snapshot store can show: the extra, the URL, crashes mid-save, a dead endpoint.

The conformance suite (tests/contract/) runs every contract test on it too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import StaleWrite, StoreUnavailable
from runtime.models import Message, RunState
from store import open_snapshot_store
from store.snapshots import format as snapshot_format
from store.snapshots.s3 import GARBAGE_BATCH, LOAD_OBJECTS, S3SnapshotStore, Span, absorbed
from tests.contract.test_snapshot_store_contract import make_state
from tests.s3_layouts import requests_sent, save_before_paths
from tests.s3_server import CREDENTIALS, S3Server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(s3_url: str) -> Iterator[S3SnapshotStore]:
    opened = open_snapshot_store(s3_url)
    assert isinstance(opened, S3SnapshotStore)
    yield opened
    opened.close()


@pytest.fixture
def another(s3_url: str) -> Iterator[S3SnapshotStore]:
    """A second handle on the same bucket, as another worker opens it: it knows no run."""
    opened = open_snapshot_store(s3_url)
    assert isinstance(opened, S3SnapshotStore)
    yield opened
    opened.close()


def run_of(saves: int) -> list[RunState]:
    """The states of a run saved ``saves`` times, each save adding one or two messages."""
    state = make_state(seq=1)
    states = [state]
    for seq in range(2, saves + 1):
        added = tuple(
            Message(role="tool", content=f"result {seq}.{i} " + "x" * (seq % 50), name="look")
            for i in range(1 + seq % 2)
        )
        state = state.model_copy(update={"seq": seq, "transcript": state.transcript + added})
        states.append(state)
    return states


def transcript_objects(store: S3SnapshotStore, run_id: str = "run-1") -> list[str]:
    return list(store._keys(store._transcript_prefix(run_id)))


def test_a_400_save_run_loads_in_at_most_4_requests_and_saves_in_at_most_5(
    store: S3SnapshotStore, another: S3SnapshotStore
) -> None:
    # Given a run saved 400 times, counting each save's requests
    saves: list[int] = []
    previous: int | None = None
    for state in run_of(400):
        with requests_sent(store) as sent:
            store.save(state, expected_seq=previous)
        saves.append(sum(sent.values()))
        previous = state.seq

    # When a worker that never saw the run loads it
    with requests_sent(another) as sent:
        loaded = another.load("run-1")

    # Then it is the last state, read with one GET of the head and at most three more
    assert loaded == state
    assert sum(sent.values()) <= 1 + LOAD_OBJECTS == 4, sent
    assert set(sent) == {"GetObject"}
    # And a save is still the head's read, one object, the head, its read-back, and now
    # and then one delete of replaced objects
    assert max(saves) <= 5
    assert sum(saves) <= 4 * 400 + 400 // GARBAGE_BATCH
    # And the replaced objects do not pile up
    assert len(transcript_objects(store)) <= LOAD_OBJECTS + GARBAGE_BATCH + LOAD_OBJECTS


def test_a_run_saved_by_the_release_before_paths_loads_and_saves_onwards_flat(
    store: S3SnapshotStore, another: S3SnapshotStore
) -> None:
    # Given a run of 40 saves stored as the release before paths stored it
    states = run_of(41)
    previous: int | None = None
    for state in states[:40]:
        save_before_paths(store, state, previous)
        previous = state.seq
    assert len(transcript_objects(store)) == 40

    # When this release loads it, it lists the run's objects and reads each, as that one did
    with requests_sent(another) as sent:
        assert another.load("run-1") == states[39]
    assert sent["ListObjectsV2"] == 1
    assert sent["GetObject"] == 1 + 40

    # And once this release saved it, a load is flat
    another.save(states[40], expected_seq=40)
    store.forget_transcript("run-1")
    with requests_sent(store) as sent:
        assert store.load("run-1") == states[40]
    assert sum(sent.values()) == 2, sent


def test_the_release_before_paths_reads_what_this_one_writes(store: S3SnapshotStore) -> None:
    # Given a run saved 100 times by this release, with replaced objects not yet deleted
    previous: int | None = None
    for state in run_of(100):
        store.save(state, expected_seq=previous)
        previous = state.seq
    head = store._read_head("run-1")
    assert head is not None and head.tip is not None and head.garbage

    # When a reader that knows no path walks back from the tip through the objects' names
    walked = store._walk("run-1", head.tip)

    # Then it finds exactly the transcript
    assert walked is not None
    assert snapshot_format.assemble(head.document, walked) == snapshot_format.encode(state)


def test_a_save_that_dies_after_its_compacted_object_leaves_the_previous_snapshot_whole(
    store: S3SnapshotStore, another: S3SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run of 20 saves or more, whose next save rewrites two objects into its own
    states = run_of(60)
    previous: int | None = None
    for at, state in enumerate(states[:-1]):
        store.save(state, expected_seq=previous)
        previous = state.seq
        head = store._read_head("run-1")
        assert head is not None and head.path is not None
        if at >= 20 and absorbed(head.path, len(states[at + 1].transcript)) >= 2:
            break
    else:
        pytest.fail("no save of the run rewrote two objects into its own")
    states = states[: at + 2]

    # When that save writes its object and dies before its head
    def die(*args: Any, **kwargs: Any) -> None:
        raise SystemExit("killed")

    monkeypatch.setattr(store, "_write_head", die)
    with pytest.raises(SystemExit):
        store.save(states[-1], expected_seq=previous)
    monkeypatch.undo()

    # Then a load finds the previous snapshot, every object its head names still there
    assert another.load("run-1") == states[-2]
    names = {key.rsplit("/", 1)[-1] for key in transcript_objects(store)}
    assert {span.name for span in head.path} <= names
    # And the run saves onwards
    store.save(states[-1], expected_seq=previous)
    another.forget_transcript("run-1")
    assert another.load("run-1") == states[-1]


def test_a_zombie_writer_cannot_make_a_load_mix_two_lines_of_saves(
    store: S3SnapshotStore, another: S3SnapshotStore
) -> None:
    # Given a zombie that loaded the run at seq 10 and paused
    states = run_of(60)
    previous: int | None = None
    for state in states[:10]:
        store.save(state, expected_seq=previous)
        previous = state.seq
    assert another.load("run-1") == states[9]
    # While the run went on 50 saves, compacting and deleting replaced objects
    for state in states[10:]:
        store.save(state, expected_seq=previous)
        previous = state.seq

    # When the zombie wakes and saves its own eleventh state
    own = states[9].model_copy(
        update={
            "seq": 11,
            "transcript": states[9].transcript + (Message(role="user", content="zombie"),),
        }
    )
    with pytest.raises(StaleWrite):
        another.save(own, expected_seq=10)

    # Then a load by anyone is the run's line, not a mix
    another.forget_transcript("run-1")
    assert another.load("run-1") == states[-1]
    store.forget_transcript("run-1")
    assert store.load("run-1") == states[-1]


def test_compaction_keeps_at_most_three_objects_and_rewrites_a_message_a_few_times() -> None:
    # Given 5000 saves of one to three messages each, as the store plans them
    path: tuple[Span, ...] = ()
    rewritten = longest = 0
    end = 0
    for save in range(5000):
        end += 1 + save % 3
        kept = path[: len(path) - absorbed(path, end)]
        start = kept[-1].end if kept else 0
        path = (*kept, Span(start, end, "0", "0"))
        rewritten += end - start
        longest = max(longest, len(path))

    # Then the path never names more than three objects
    assert longest == LOAD_OBJECTS
    # And a message is written about the cube root of the run's length times, not its length
    assert rewritten / end <= 2 * end ** (1 / 3)


def test_without_boto3_the_s3_store_is_refused_naming_the_extra() -> None:
    # Given an interpreter where boto3 cannot be imported
    code = (
        "import sys; sys.modules['boto3'] = None\n"
        "from store import open_snapshot_store\n"
        "open_snapshot_store('s3://bucket/prefix')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )

    assert done.returncode != 0
    assert "pip install 'ratchet[s3]'" in done.stderr


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("s3://key:secret@bucket/p", "credentials come from"),
        ("s3:///no-bucket", "use s3://bucket/prefix"),
        ("s3://bucket/p?endpoint=http://x", "unknown parameter(s) endpoint"),
    ],
)
def test_a_malformed_s3_url_is_refused_saying_what_is_accepted(url: str, fragment: str) -> None:
    with pytest.raises(ValueError) as refused:
        open_snapshot_store(url)

    assert fragment in str(refused.value)
    assert "secret" not in str(refused.value)


def test_a_save_that_dies_between_its_messages_and_its_head_leaves_the_previous_snapshot(
    store: S3SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run checkpointed at seq 1
    first = make_state(seq=1)
    store.save(first, expected_seq=None)
    longer = first.model_copy(
        update={"seq": 2, "transcript": first.transcript + make_state(content="more").transcript}
    )

    # When a save writes its transcript object and dies before the head
    def die(*args: Any, **kwargs: Any) -> None:
        raise SystemExit("killed")

    monkeypatch.setattr(store, "_write_head", die)
    with pytest.raises(SystemExit):
        store.save(longer, expected_seq=1)
    monkeypatch.undo()

    # Then the orphan is there, the snapshot is the previous one, and the run saves onwards
    assert len(list(store._keys(store._transcript_prefix("run-1")))) == 2
    assert store.load_document("run-1") == snapshot_format.encode(first)
    store.save(longer, expected_seq=1)
    assert store.load("run-1") == longer

    # And a delete removes every object of the run, orphans included
    store.delete("run-1")
    assert list(store._keys(store._transcript_prefix("run-1"))) == []
    assert store.list() == []


def test_a_racing_save_the_server_let_through_is_caught_by_the_read_back(
    store: S3SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a server whose conditional PUT is not atomic (moto's): both writers of
    # seq 2 pass the If-Match check, which we stand in for by not sending it.
    store.save(make_state(seq=1), expected_seq=None)
    other = S3SnapshotStore(store._client, store._bucket, "snapshots")
    monkeypatch.setattr(store, "_put_object", _unconditional(store))
    monkeypatch.setattr(other, "_put_object", _unconditional(other))
    base = store._read_head("run-1")
    read_head = store._read_head
    calls = 0

    def read_back_after_the_other_lands(run_id: str) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            # When the other writer's PUT on the same base lands after ours
            assert base is not None
            winner = snapshot_format.encode(make_state(seq=2, content="winner"))
            other._write_head(run_id, base, {"form": "whole", "seq": 2}, winner)
        return read_head(run_id)

    monkeypatch.setattr(store, "_read_head", read_back_after_the_other_lands)

    # Then ours, overwritten, reports the race lost instead of success
    with pytest.raises(StaleWrite):
        store._put(
            "run-1", make_state(seq=2), snapshot_format.encode(make_state(seq=2)), expected_seq=1
        )
    assert store.load("run-1") == make_state(seq=2, content="winner")


def _unconditional(store: S3SnapshotStore) -> Any:
    put = store._put_object

    def put_without_condition(key: str, body: bytes, **condition: str) -> str:
        return put(key, body)

    return put_without_condition


def test_a_dead_endpoint_raises_store_unavailable_within_seconds(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as env:
        for name, value in CREDENTIALS.items():
            env.setenv(name, value)
        server = S3Server(tmp_path)
        server.start()
        try:
            server.create_bucket("dies")
            store = S3SnapshotStore.from_url(server.url("dies"))
            store.save(make_state(seq=1), expected_seq=None)

            # Given the endpoint dies
            server.kill()

            # When a worker checkpoints, it is told the store is unavailable, quickly
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as refused:
                store.save(make_state(seq=2), expected_seq=1)

            assert time.monotonic() - started < 15
            message = str(refused.value)
            assert f"127.0.0.1:{server.port}" in message
            assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in message
            assert "check that it is running and reachable" in message
            store.close()
        finally:
            server.close()


def test_credentials_are_not_part_of_the_store_or_its_messages(store: S3SnapshotStore) -> None:
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in repr(vars(store))
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in store._where
