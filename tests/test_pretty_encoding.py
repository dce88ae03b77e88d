"""The snapshot's pretty printer writes exactly what ``json.dumps(indent=2, sort_keys=True)`` does.

The readable document's bytes are part of the format (golden files, byte-identical
reassembly from a head and fragments), so the faster encoder must never differ:
checked on arbitrary JSON values, on a full snapshot, and on values it leaves to json.
"""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.models import Message
from store.snapshots import format as snapshot_format
from tasks.start import create_run
from tasks.turn import advance
from tests.contract.test_snapshot_store_contract import rich_state
from tests.helpers import call, memory_context, turn, write_agent
from tests.workers import redis_context


def dumped(value: object) -> str:
    return json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False)


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=40,
)


@settings(max_examples=500, deadline=None)
@given(values)
def test_any_json_value_is_encoded_as_json_dumps_does(value: object) -> None:
    assert snapshot_format.pretty(value) == dumped(value)


def test_a_snapshot_document_and_its_fragments_are_the_bytes_json_dumps_gives() -> None:
    state = rich_state()
    document = snapshot_format.SnapshotV2(run=state).model_dump(mode="json")
    assert snapshot_format.encode(state) == (dumped(document) + "\n").encode()
    head = snapshot_format.encode_head(state)
    fragments = [snapshot_format.encode_fragment(m) for m in state.transcript]
    assert snapshot_format.assemble(head, fragments) == snapshot_format.encode(state)


def test_subclasses_of_the_json_types_come_out_as_json_dumps_writes_them() -> None:
    # The walk tries the exact types first; a subclass takes json.encoder's own order.
    class Colour(enum.StrEnum):
        RED = "red"

    class Level(enum.IntEnum):
        HIGH = 3

    class Tagged(dict[str, object]):
        pass

    value = Tagged(
        {"c": Colour.RED, "l": Level.HIGH, "t": (True, False, None, 1.5), Colour.RED: [Level.HIGH]}
    )
    for shaped in (value, [value, Colour.RED, Level.HIGH, (value,)], {"nested": value}):
        assert snapshot_format.pretty(shaped) == dumped(shaped)


def test_what_it_does_not_encode_itself_is_left_to_json() -> None:
    # Keys that are not strings, and floats JSON has no literal for: json.dumps' own text.
    for value in ({1: "a", 2: "b"}, {"x": [math.inf, -math.inf]}, [math.nan], {True: None}):
        assert snapshot_format.pretty(value) == dumped(value)
    # Keys json.dumps cannot even sort: its own error, not a document.
    for mixed in ({1: "a", "b": 2}, {"x": {None: 1, "a": 2}}):
        with pytest.raises(TypeError):
            json.dumps(mixed, sort_keys=True, indent=2)
        with pytest.raises(TypeError):
            snapshot_format.pretty(mixed)


def test_a_head_is_the_document_of_the_state_without_its_transcript() -> None:
    # encode_head dumps the state itself instead of wrapping a copy in SnapshotV2: the
    # bytes must stay those of the wrapped copy, with the lineage fields set or absent.
    plain = rich_state()
    child = plain.model_copy(
        update={
            "parent": "run-0",
            "parent_told": True,
            "throttled_since_ms": 7,
            "priority": 3,
            "concurrency_key": "tenant-ä",
        }
    )
    for state in (plain, child, plain.model_copy(update={"transcript": ()})):
        emptied = state.model_copy(update={"transcript": ()})
        document = snapshot_format.SnapshotV2(run=emptied).model_dump(mode="json")
        assert snapshot_format.encode_head(state) == (dumped(document) + "\n").encode()
        assert snapshot_format.encode_head(state) == snapshot_format.encode(emptied)


def test_a_remembered_fragment_is_the_message_s_own_and_the_memo_stays_bounded() -> None:
    # Given more messages than the memo keeps, each encoded twice (as a turn measures a
    # message, then saves it), and equal-looking messages that are other objects
    messages = [
        Message(role="tool", content=f"result {i} " + "x" * (i % 7) * 100, tool_call_id=f"c{i}")
        for i in range(snapshot_format._fragments.entries * 2)
    ]
    for message in messages:
        first = snapshot_format.encode_fragment(message)
        # Then the second encoding is the first, and a copy of the message encodes the same
        assert snapshot_format.encode_fragment(message) is first
        assert snapshot_format.encode_fragment(message.model_copy()) == first
    # And the memo holds at most its count and its bytes, every entry its message's own
    memo = dict(snapshot_format._fragments.items())
    assert 0 < len(memo) <= snapshot_format._fragments.entries
    assert sum(len(f) for _, f in memo.values()) <= snapshot_format._fragments.max_bytes
    assert sum(len(f) for _, f in memo.values()) == snapshot_format._fragments.size
    for key, (message, fragment) in memo.items():
        assert id(message) == key
        text = snapshot_format._document(snapshot_format._plain(message), end="")
        assert fragment == snapshot_format._INDENT + text.replace(b"\n", b"\n      ")


def fragments_encoded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The plain form of every transcript message encoded from now on, in order."""
    encoded: list[dict[str, object]] = []
    document = snapshot_format._document

    def counting(value: Any, end: str = "\n") -> bytes:
        if end == "":  # a transcript fragment (a head ends with a newline)
            encoded.append(value)
        return document(value, end=end)

    monkeypatch.setattr(snapshot_format, "_document", counting)
    return encoded


def test_a_turn_encodes_each_new_transcript_message_once(
    tmp_path: Path, ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run past its first turn, whose next turn asks for a lookup (two new messages:
    # the answer and the lookup's result)
    script = [turn("look", call("lookup_order", order_id="B2")),
              turn("again", call("lookup_order", order_id="A1")), turn("ok")]  # fmt: skip
    ctx = memory_context()
    run_id = create_run(ctx, write_agent(tmp_path, script), "look").run_id
    first = advance(ctx, run_id, 1)
    encoded = fragments_encoded(monkeypatch)
    # When the turn measures the answer, measures the lookup's result and saves the snapshot
    assert advance(ctx, run_id, first.seq).outcome == "next"
    # Then each of the two new messages was encoded once: the answer is measured as the
    # message the fold put in the transcript, the one the snapshot encodes after
    assert [m["role"] for m in encoded] == ["assistant", "tool"]


def test_a_turn_on_the_other_process_does_not_encode_the_messages_it_read_again(
    tmp_path: Path, ledger: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run on Redis whose turns alternate between two processes' contexts, as a
    # prefork pool's two processes take them: each turn reads the messages the other wrote
    script = [turn(f"look {i}", call("lookup_order", order_id="B2")) for i in range(3)]
    one, two = redis_context(redis_url), redis_context(redis_url)
    run_id = create_run(one, write_agent(tmp_path, [*script, turn("ok")]), "look").run_id
    done = advance(two, run_id, advance(one, run_id, 1).seq)
    encoded = fragments_encoded(monkeypatch)
    # When the first process takes the next turn, reading the answer and the lookup's
    # result the other process wrote since its own last turn
    assert advance(one, run_id, done.seq).outcome == "next"
    # Then it encodes only the two messages of its own turn: those it read are measured
    # and saved as the fragments they were read as
    assert [str(m["content"])[:6] for m in encoded] == ["look 2", '{"amou']
    one.close()
    two.close()
