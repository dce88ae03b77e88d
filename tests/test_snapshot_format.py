"""The snapshot document: golden files of every format version, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.errors import (
    SnapshotError,
    SnapshotMalformed,
    SnapshotUnsupportedVersion,
    SnapshotWrongKind,
)
from runtime.fsm import rebuild
from runtime.models import RunState, RunStatus
from store.snapshots import format as snapshot_format

GOLDEN = Path(__file__).parent / "golden"


def test_every_golden_snapshot_version_still_decodes() -> None:
    # Given every format version this project has ever written
    files = sorted(GOLDEN.glob("snapshot-v*.json"))
    assert [f.name for f in files] == ["snapshot-v1.json", "snapshot-v2.json"], (
        "add a golden file for each new version"
    )
    for path in files:
        # When this build reads it
        state = snapshot_format.decode(path.read_bytes(), path.name)
        # Then it is the run the file describes
        assert state.run_id == "golden-run-1"
        assert state.status == RunStatus.NEEDS_USER_INPUT
        assert state.seq == 8
        assert state.suspension is not None
        assert state.suspension.prompt == "Which card should the refund go to?"
        assert [m.role for m in state.transcript] == [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        assert state.usage.total_tokens == 30


def test_a_snapshot_is_sorted_indented_json_with_a_trailing_newline() -> None:
    data = (GOLDEN / "snapshot-v2.json").read_bytes()
    state = snapshot_format.decode(data, "golden")
    encoded = snapshot_format.encode(state)
    assert encoded.endswith(b"}\n")
    value = json.loads(encoded)
    assert list(value) == sorted(value) == ["kind", "run", "version"]
    assert encoded == data, (
        "format 2 must encode exactly as it did when the golden file was written"
    )


def test_a_format_1_document_reads_as_the_same_run_in_format_2() -> None:
    v1 = snapshot_format.decode((GOLDEN / "snapshot-v1.json").read_bytes(), "v1")
    v2 = snapshot_format.decode((GOLDEN / "snapshot-v2.json").read_bytes(), "v2")
    assert v1 == v2
    # A format-1 run cut short with its one call in flight keeps that call open.
    value = _golden()
    value["run"]["in_flight"] = "call_2_1"  # type: ignore[index]
    state = snapshot_format.decode(json.dumps(value).encode(), "v1-in-flight")
    assert state.running == ("call_2_1",) and state.in_flight == "call_2_1"
    assert b'"in_flight"' not in snapshot_format.encode(state)
    # Format 1 never had `running`: it is refused there as the unknown field it is.
    value["run"]["running"] = []  # type: ignore[index]
    del value["run"]["in_flight"]  # type: ignore[attr-defined]
    with pytest.raises(SnapshotMalformed, match="unknown field"):
        snapshot_format.decode(json.dumps({**value, "version": 1}).encode(), "v1")


def _golden() -> dict[str, object]:
    value: dict[str, object] = json.loads((GOLDEN / "snapshot-v1.json").read_bytes())
    return value


def test_an_unknown_field_is_refused_naming_it() -> None:
    value = _golden()
    value["run"]["surprise"] = 1  # type: ignore[index]
    with pytest.raises(SnapshotMalformed, match=r"`run.surprise`: unknown field"):
        snapshot_format.decode(json.dumps(value).encode(), "snap.json")


def test_another_kind_of_document_is_refused_saying_which_it_is() -> None:
    value = _golden()
    value["kind"] = "ratchet.memory"
    with pytest.raises(SnapshotWrongKind) as refused:
        snapshot_format.decode(json.dumps(value).encode(), "snap.json")
    message = str(refused.value)
    assert "`ratchet.memory` document, not a `ratchet.snapshot` one" in message
    assert "point the snapshot store at" in message


def test_a_future_version_is_refused_saying_what_to_do() -> None:
    value = _golden()
    value["version"] = 3
    with pytest.raises(SnapshotUnsupportedVersion) as refused:
        snapshot_format.decode(json.dumps(value).encode(), "snap.json")
    assert "version `3`" in str(refused.value) and "upgrade ratchet" in str(refused.value)


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b"\xff\xfe"])
def test_something_that_is_not_a_snapshot_is_refused(data: bytes) -> None:
    with pytest.raises(SnapshotMalformed, match="is not a ratchet snapshot"):
        snapshot_format.decode(data, "snap.json")


def test_the_golden_run_rebuilt_from_its_events_matches_its_snapshot(tmp_path: Path) -> None:
    # The golden events were not kept, so replay the same script and compare the shapes.
    from tasks.start import create_run
    from tasks.turn import advance
    from tests.helpers import call, memory_context, turn, write_agent

    ctx = memory_context()
    agent = write_agent(
        tmp_path,
        [
            turn("Looking up order B2.", call("lookup_order", order_id="B2")),
            turn(
                "Need to ask.",
                call("request_user_input", prompt="Which card should the refund go to?"),
            ),
        ],
        name="golden-desk",
    )
    run_id = create_run(ctx, agent, "Refund order B2, please.").run_id
    done = advance(ctx, run_id, 1)
    advance(ctx, run_id, done.seq)
    saved = ctx.snapshots.load(run_id)
    assert saved is not None
    assert rebuild(ctx.runs.events(run_id)) == saved


# --- fuzz: only the documented refusals escape the decoder ----------------------

GOLDEN_BYTES = (GOLDEN / "snapshot-v1.json").read_bytes()
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def damaged_golden(draw: st.DrawFn) -> bytes:
    """The golden document with a slice cut out, replaced, or the tail dropped."""
    data = GOLDEN_BYTES
    start = draw(st.integers(0, len(data)))
    end = draw(st.integers(start, min(len(data), start + 64)))
    return data[:start] + draw(st.binary(max_size=16)) + data[end:]


@st.composite
def golden_with_a_value_replaced(draw: st.DrawFn) -> bytes:
    """The golden document with one field, at any depth, set to any JSON value."""
    value: object = json.loads(GOLDEN_BYTES)
    path: list[object] = []
    node = value
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    replacement = draw(JSON_VALUES)
    if not path:
        return json.dumps(replacement).encode()
    parent = value
    for key in path[:-1]:
        parent = parent[key]  # type: ignore[index]
    parent[path[-1]] = replacement  # type: ignore[index]
    return json.dumps(value).encode()


DOCUMENTS = (
    st.binary(max_size=512)
    | damaged_golden()
    | golden_with_a_value_replaced()
    | JSON_VALUES.map(lambda v: json.dumps(v).encode())
)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(DOCUMENTS)
@example(b'{"kind": "ratchet.snapshot", "version": 1, "run": ' + b"7" * 5000 + b"}")
@example(b"[" * 50_000 + b"]" * 50_000)
@example(b'{"kind": "ratchet.snapshot", "version": 1, "run": ' + b"[" * 50_000 + b"}")
@example(b'{"kind": "ratchet.snapshot", "version": true, "run": {}}')
@example(b'{"kind": ["ratchet.snapshot"], "version": 1}')
@example(b"\xef\xbb\xbf" + GOLDEN_BYTES)
def test_the_decoder_refuses_any_bytes_only_with_a_snapshot_error_naming_where(data: bytes) -> None:
    try:
        state = snapshot_format.decode(data, "snapshots/fuzzed.json")
    except SnapshotError as refused:
        message = str(refused)
        assert message.startswith("snapshots/fuzzed.json"), message
        assert len(message) < 600, "a refusal names the problem, it does not quote the file"
    else:
        assert isinstance(state, RunState)
