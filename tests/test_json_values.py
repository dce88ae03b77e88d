"""The JSON ratchet stores: its decoders read exactly what its encoders write (issue 30).

A property test over values with what JSON text can carry and ratchet cannot store as
it is — lone surrogates, NaN and infinities, integers longer than Python writes as text
— through the codec itself and through each store's encoding of events and snapshots:
a value one side refuses, the other refuses too; a value both take comes back equal.
Then the check at the boundary (:func:`runtime.json_values.checked`), one refusal each.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import Ran, ToolContext, json_values, tool
from runtime.errors import NotStorable, SnapshotMalformed, StoreError
from runtime.json_values import MAX_DEPTH, MAX_INT_DIGITS, MAX_OUTPUT_BYTES, checked
from runtime.models import Event, Message, ToolCall
from runtime.probes import Answer, probed_event
from runtime.tools import spec_from_function
from runtime_io.tools import ask_probe
from store.runs.redis import _packed, _unpacked
from store.runs.sqlite import _decoded, _encoded
from store.snapshots import format as snapshot_format
from tests.contract.test_snapshot_store_contract import rich_state

text = st.text(st.characters(exclude_categories=()), max_size=6) | st.sampled_from(
    ["\ud800", "partial emoji \ud83d", "\udc00\ud800", "\ud83d\ude00", "😀", "\\ud800"]
)
"""Strings with every code point, lone surrogates included (Hypothesis leaves them out)."""
numbers = (
    st.integers()
    | st.integers(min_value=MAX_INT_DIGITS - 2, max_value=MAX_INT_DIGITS + 2).map(
        lambda digits: 10**digits - 1
    )
    | st.floats()
)
values = st.recursive(
    st.none() | st.booleans() | numbers | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)


def lenient(value: Any) -> str | None:
    """``value`` as Python's json writes it when nothing is refused: lone surrogates as
    escapes, NaN and infinities as literals; None if it cannot even write it."""
    try:
        return json.dumps(value)
    except ValueError:  # an integer of more digits than Python writes as text
        return None


def outcome(fn: Any, *args: Any) -> tuple[bool, Any]:
    try:
        return True, fn(*args)
    except NotStorable:
        return False, None


@settings(max_examples=400, deadline=None)
@given(values)
def test_the_decoder_reads_exactly_what_the_encoder_writes(value: Any) -> None:
    written, data = outcome(json_values.dumps, value)
    document = lenient(value)
    if document is not None:
        # The same value as any JSON text: read if and only if the encoder writes it
        read, found = outcome(json_values.loads, document)
        assert read == written, (value, document)
        if read:
            assert json_values.loads(data) == found
    if written:
        # What the encoder wrote reads back, and is written again to the same bytes
        again = json_values.loads(data)
        assert json_values.dumps(again) == data
        assert again == json_values.canonical(value)


@settings(max_examples=200, deadline=None)
@given(values)
def test_events_in_each_store_read_back_exactly_what_was_written_or_are_refused(
    tmp_path_factory: pytest.TempPathFactory, value: Any
) -> None:
    event = Event(seq=5, type="tool.completed", at_ms=1, data={"call_id": "c", "result": value})
    written, _ = outcome(json_values.dumps, event.data)
    # Redis: the packed event
    try:
        packed = _packed(event)
    except NotStorable:
        assert not written
    else:
        assert written and _unpacked(packed, "test").data == json_values.canonical(event.data)
    # SQLite: the data column
    try:
        column = _encoded(event.data)
    except NotStorable:
        assert not written
    else:
        assert written
        assert _decoded("runs.sqlite3", "r", 5, column) == json_values.canonical(event.data)


@settings(max_examples=150, deadline=None)
@given(values)
def test_a_snapshot_holding_any_value_decodes_to_it_or_is_refused_both_ways(value: Any) -> None:
    base = rich_state()
    call = ToolCall(id="call_x", name="lookup_order", arguments={"v": value})
    message = Message(role="assistant", content="asks", tool_calls=(call,))
    state = base.model_copy(update={"transcript": (*base.transcript, message)})
    # Python's own dump: pydantic's JSON mode refuses a lone surrogate in a key
    document = lenient(snapshot_format.SnapshotV2(run=state).model_dump())
    try:
        data = snapshot_format.encode(state)
    except NotStorable:
        if document is not None:
            with pytest.raises(SnapshotMalformed):
                snapshot_format.decode(document.encode("utf-8", "surrogatepass"), "test")
        return
    decoded = snapshot_format.decode(data, "test")
    assert decoded.transcript[-1].tool_calls[0].arguments == json_values.canonical({"v": value})
    # And from its head and fragments, as the appending backends store it
    head = snapshot_format.encode_head(state)
    fragments = [snapshot_format.encode_fragment(m) for m in state.transcript]
    assert snapshot_format.assemble(head, fragments) == data


def test_events_older_builds_wrote_with_lone_surrogates_or_nan_read_as_u_fffd_and_null() -> None:
    # json.dumps wrote "\ud800" as an escape (ensure_ascii) and NaN as a literal: such logs
    # exist in SQLite. Both read as the codec writes them now.
    older = json.dumps({"note": "partial emoji \ud83d", "x": math.nan}, sort_keys=True)
    assert _decoded("runs.sqlite3", "r", 1, older) == {"note": "partial emoji \ufffd", "x": None}
    with pytest.raises(StoreError, match="event at seq 2 is unreadable .*more than 4300 digits"):
        _decoded("runs.sqlite3", "r", 2, '{"result": ' + "1" * 4301 + "}")


def test_what_the_decoder_refuses_it_refuses_saying_what_and_where() -> None:
    for data, problem in (
        (b'{"a": "\xed\xa0\x80"}', "not UTF-8 at byte 7"),  # a surrogate encoded as UTF-8
        (b'{"a": ' + b"1" * (MAX_INT_DIGITS + 1) + b"}", f"more than {MAX_INT_DIGITS} digits"),
        (b'{"a": ', "not JSON (Expecting value at line 1 column 7)"),
    ):
        with pytest.raises(NotStorable, match=problem.replace("(", r"\(").replace(")", r"\)")):
            json_values.loads(data)
    # What JSON has no number for reads as null, as the encoder writes it
    assert json_values.loads(b"[1e400, -Infinity, NaN, 1.5]") == [None, None, None, 1.5]
    assert json_values.dumps([math.inf, math.nan, 1.5]) == b"[null,null,1.5]"


# --- the check at the boundary ------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"id": "\ud800"}, r"holds a lone surrogate \(\\ud800\), which is not Unicode"),
        ([10**5000], "holds an integer of about 5000 digits, over 4300; return it as a string"),
        ({"x": math.nan}, "holds nan, which is not a JSON number"),
        ([-math.inf], "holds -inf, which is not a JSON number"),
        ({"k": {1: "a"}}, "holds an object key that is a int, not a string"),
        ({"s": {1, 2}}, "holds a set, which is not a JSON value"),
        ("x" * MAX_OUTPUT_BYTES, f"is {MAX_OUTPUT_BYTES + 2} bytes as JSON, over the"),
    ],
)
def test_the_boundary_refuses_what_cannot_be_stored_in_one_clause(value: Any, problem: str) -> None:
    with pytest.raises(NotStorable, match=problem):
        checked(value, surrogates="refuse")


def test_the_boundary_replaces_lone_surrogates_in_values_and_keys_when_asked() -> None:
    plain, size = checked({"\udc00": ["partial emoji \ud83d", ("t", 1.5)], "ok": "😀"})
    assert plain == {"\ufffd": ["partial emoji \ufffd", ["t", 1.5]], "ok": "😀"}
    assert size == len(json_values.dumps(plain))


def test_the_boundary_refuses_nesting_deeper_than_its_limit_and_takes_the_limit_itself() -> None:
    def nested(depth: int) -> Any:
        value: Any = "leaf"
        for _ in range(depth):
            value = [value]
        return value

    assert checked(nested(MAX_DEPTH))[0] == nested(MAX_DEPTH)
    with pytest.raises(NotStorable, match=f"nests deeper than {MAX_DEPTH} levels"):
        checked(nested(MAX_DEPTH + 1))
    with pytest.raises(NotStorable, match="nests deeper"):
        checked(nested(100_000))


def test_a_probe_that_found_the_call_ran_with_a_result_that_cannot_be_stored_records_an_error() -> (
    None
):
    # Given a probe that says the call ran, with a result of 5,001 digits
    def found(order_id: str) -> Ran:
        return Ran(10**5000)

    @tool(probe=found)
    def refund(order_id: str) -> str:
        return order_id

    spec = spec_from_function(refund, "mine:refund")
    context = ToolContext(run_id="r", call_id="c", idempotency_key="k")
    # When it is asked, its answer is still "ran" — the call is never run again —
    probed = ask_probe(spec, {"order_id": "A1"}, context)
    assert probed.answer == Answer.RAN and probed.result is None
    assert "its result holds an integer of about 5000 digits" in probed.detail
    # And it is journaled with the error, which the fold makes the call's error result
    kind, data = probed_event("c", "refund", probed)
    assert kind == "tool.probed" and "result" not in data and data["error"] == probed.detail
    assert json_values.dumps(data)
