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
from store import open_snapshot_store
from store.snapshots import format as snapshot_format
from store.snapshots.s3 import S3SnapshotStore
from tests.contract.test_snapshot_store_contract import make_state
from tests.s3_server import CREDENTIALS, S3Server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(s3_url: str) -> Iterator[S3SnapshotStore]:
    opened = open_snapshot_store(s3_url)
    assert isinstance(opened, S3SnapshotStore)
    yield opened
    opened.close()


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
