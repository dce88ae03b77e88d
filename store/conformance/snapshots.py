"""The SnapshotStore contract: save and load, the compare-and-set on seq, delete and list,
run ids from outside, the size limit, refusing what this build cannot read, quarantine.

Two things a harness may offer beyond the ``snapshot_store`` fixture, by overriding a
fixture of the class: ``another_snapshot_store`` (a second handle on the same storage,
as another worker opens it) and ``quarantined`` (where the backend keeps the documents
it moved aside). A test that needs one the harness does not offer is skipped, saying so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import (
    InvalidRunId,
    SnapshotMalformed,
    SnapshotTooLarge,
    SnapshotUnsupportedVersion,
    SnapshotWrongKind,
    StaleWrite,
)
from runtime.models import Budgets, Message, RunState, RunStatus, Suspension, ToolCall, Usage
from store.conformance.capabilities import APPENDS_TRANSCRIPT, require
from store.conformance.support import T0_MS, race
from store.snapshots import Parts, SnapshotStore
from store.snapshots import format as snapshot_format

OpenAnother = Callable[[], SnapshotStore]
"""Opens another handle on the storage the ``snapshot_store`` fixture's store uses."""
Quarantined = Callable[[SnapshotStore, str], list[bytes]]
"""The documents ``store`` keeps moved aside for a run, each as it was stored."""


def make_state(run_id: str = "run-1", seq: int = 1, content: str = "say hello") -> RunState:
    """A run about to call the model, the user having said ``content``."""
    said = (Message(role="system", content="be brief"), Message(role="user", content=content))
    return RunState(run_id=run_id, seq=seq, agent="echo", agent_file="agents/echo.toml",
                    binding="0" * 64, input="say hello", status=RunStatus.MODEL,
                    budgets=Budgets(), created_at_ms=T0_MS, transcript=said)  # fmt: skip


def rich_state(run_id: str = "run-1", seq: int = 9) -> RunState:
    """A state using every optional field, with text a naive encoder would mangle."""
    lookup = ToolCall(id="call-1", name="lookup", arguments={"q": "zürich ☃", "n": [1, 2.5, None]})
    ask = ToolCall(id="call-2", name="request_user_input", arguments={"prompt": "which one?"})
    return RunState(
        run_id=run_id,
        seq=seq,
        agent="travel",
        agent_file="agents/travel.toml",
        binding="f" * 64,
        input="plan a trip\nwith \"quotes\" and \\ backslashes",
        status=RunStatus.NEEDS_USER_INPUT,
        budgets=Budgets(max_turns=5, max_total_tokens=1000, max_tool_calls=3, timeout_seconds=60),
        created_at_ms=T0_MS,
        transcript=(
            Message(role="user", content="plan a trip"),
            Message(role="assistant", content="", tool_calls=(lookup, ask)),
            Message(role="tool", content="{}", tool_call_id="call-1", name="lookup", is_error=True),
        ),
        pending=(ask,),
        running=(),
        approved=("call-0",),
        usage=Usage(model_attempts=2, model_turns=1, input_tokens=10, output_tokens=5,
                    total_tokens=15, responses_without_usage=1, tool_calls=1),
        suspended_ms=1234,
        suspension=Suspension(
            reason=RunStatus.NEEDS_USER_INPUT,
            call_id="call-2",
            tool="request_user_input",
            arguments={"prompt": "which one?"},
            prompt="which one?",
            seq=seq,
            since_ms=T0_MS + 5,
        ),
        recovery_attempts=1,
    )  # fmt: skip


def put_raw(store: SnapshotStore, run_id: str, document: bytes) -> None:
    """Store bytes as the run's snapshot, bypassing encoding: what a bad writer leaves."""
    store._put(run_id, make_state(run_id), document, None)


def edited_document(edit: Callable[[dict[str, Any]], None]) -> bytes:
    document = json.loads(snapshot_format.encode(make_state()))
    edit(document)
    return json.dumps(document, sort_keys=True, indent=2).encode()


# --- compare-and-set under a moved transcript ----------------------------------


def grown(state: RunState, *said: str) -> RunState:
    """``state`` two seqs on per message: the assistant says each of ``said`` in turn."""
    messages = tuple(Message(role="assistant", content=text) for text in said)
    return state.model_copy(
        update={"seq": state.seq + 2 * len(said), "transcript": state.transcript + messages}
    )


INVALID_IDS: list[object] = [
    "../x", "../../../x", "a/b", "..", ".", "", "x" * 65, "x\x00", "a.b", " run", "run\n",
    7, None, b"run-1",
]  # fmt: skip


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


# --- decoding refuses what this build cannot read -----------------------------


def _add_top_level_field(doc: dict[str, Any]) -> None:
    doc["colour"] = "red"


def _add_run_field(doc: dict[str, Any]) -> None:
    doc["run"]["mood"] = "cheerful"


def _drop_seq(doc: dict[str, Any]) -> None:
    del doc["run"]["seq"]


def _other_kind(doc: dict[str, Any]) -> None:
    doc["kind"] = "ratchet.memory"


def _no_kind(doc: dict[str, Any]) -> None:
    del doc["kind"]


def _future_version(doc: dict[str, Any]) -> None:
    doc["version"] = 3


REFUSALS = [
    pytest.param(edited_document(_add_top_level_field), SnapshotMalformed,
                 ["`colour`: unknown field"], id="unknown-field"),
    pytest.param(edited_document(_add_run_field), SnapshotMalformed,
                 ["`run.mood`: unknown field"], id="unknown-run-field"),
    pytest.param(edited_document(_drop_seq), SnapshotMalformed, ["`run.seq`"], id="missing-field"),
    pytest.param(b'{"kind": "ratchet.snapshot", "version": 1, "run": ', SnapshotMalformed,
                 ["not JSON"], id="truncated"),
    pytest.param(b"[1, 2]\n", SnapshotMalformed, ["not a JSON object"], id="not-an-object"),
    pytest.param(edited_document(_other_kind), SnapshotWrongKind,
                 ["`ratchet.memory` document", "`ratchet.snapshot`",
                  "point the snapshot store at ratchet's snapshot directory"], id="wrong-kind"),
    pytest.param(edited_document(_no_kind), SnapshotWrongKind,
                 ["`ratchet.snapshot`", "point the snapshot store"], id="no-kind"),
    pytest.param(edited_document(_future_version), SnapshotUnsupportedVersion,
                 ["version `3`", "reads `1`, `2`", "upgrade ratchet on this worker"],
                 id="future-version"),
]  # fmt: skip


# --- an unusable snapshot is moved aside, never deleted -------------------------


class SnapshotStoreContract:
    """Subclass it as ``Test…`` beside a ``snapshot_store`` fixture that yields a fresh,
    empty store; pytest runs every test below on it."""

    @pytest.fixture
    def another_snapshot_store(self) -> Iterator[OpenAnother | None]:
        """Override to offer a second handle on the same storage (None: the harness has none;
        a store of one process's memory is its own other worker)."""
        yield None

    @pytest.fixture
    def quarantined(self) -> Quarantined | None:
        """Override to show what the backend keeps in its quarantine (None: not offered)."""
        return None

    def test_appending_transcripts_is_claimed_whole_or_not_at_all(
        self, snapshot_store: SnapshotStore
    ) -> None:
        # The flag sends every save through _put_parts and every load through _read.
        assert APPENDS_TRANSCRIPT.half_claimed(snapshot_store) is None

    # --- save and load ------------------------------------------------------------

    def test_a_saved_snapshot_loads_back_equal(self, snapshot_store: SnapshotStore) -> None:
        state = rich_state()

        snapshot_store.save(state, expected_seq=None)

        assert snapshot_store.load("run-1") == state

    def test_the_stored_document_is_the_readable_encoding(
        self, snapshot_store: SnapshotStore
    ) -> None:
        state = rich_state()

        snapshot_store.save(state, expected_seq=None)

        document = snapshot_store.load_document("run-1")
        assert document == snapshot_format.encode(state)
        assert document is not None and document.endswith(b"}\n")
        assert json.loads(document)["kind"] == "ratchet.snapshot"

    def test_loading_a_run_without_a_snapshot_returns_none(
        self, snapshot_store: SnapshotStore
    ) -> None:
        snapshot_store.save(make_state("run-1"), expected_seq=None)

        assert snapshot_store.load("run-2") is None
        assert snapshot_store.load_document("run-2") is None

    # --- compare-and-set on seq ---------------------------------------------------

    def test_saves_chain_when_each_expects_the_previous_seq(
        self, snapshot_store: SnapshotStore
    ) -> None:
        snapshot_store.save(make_state(seq=1, content="one"), expected_seq=None)
        snapshot_store.save(make_state(seq=2, content="two"), expected_seq=1)
        snapshot_store.save(make_state(seq=5, content="five"), expected_seq=2)

        assert snapshot_store.load("run-1") == make_state(seq=5, content="five")

    def test_a_save_expecting_no_snapshot_is_stale_when_one_exists(
        self, snapshot_store: SnapshotStore
    ) -> None:
        snapshot_store.save(make_state(seq=1, content="first"), expected_seq=None)

        with pytest.raises(StaleWrite) as refused:
            snapshot_store.save(make_state(seq=2, content="second"), expected_seq=None)

        assert (refused.value.expected_seq, refused.value.found_seq) == (None, 1)
        assert snapshot_store.load("run-1") == make_state(seq=1, content="first")

    def test_a_save_with_a_stale_expected_seq_is_refused_and_leaves_the_snapshot_unchanged(
        self, snapshot_store: SnapshotStore
    ) -> None:
        # Given a run checkpointed at seq 1 and then advanced to seq 2 by a second worker
        snapshot_store.save(make_state(seq=1), expected_seq=None)
        snapshot_store.save(make_state(seq=2, content="newer"), expected_seq=1)
        before = snapshot_store.load_document("run-1")

        # When the first worker, a zombie, saves what it believes follows seq 1
        with pytest.raises(StaleWrite) as refused:
            snapshot_store.save(make_state(seq=2, content="zombie"), expected_seq=1)

        # Then the newer snapshot stands, byte for byte
        assert (refused.value.expected_seq, refused.value.found_seq) == (1, 2)
        assert "run-1" in str(refused.value)
        assert snapshot_store.load_document("run-1") == before

    def test_a_save_expecting_a_seq_when_none_is_stored_is_stale(
        self, snapshot_store: SnapshotStore
    ) -> None:
        with pytest.raises(StaleWrite) as refused:
            snapshot_store.save(make_state(seq=5), expected_seq=4)

        assert (refused.value.expected_seq, refused.value.found_seq) == (4, None)
        assert snapshot_store.load("run-1") is None
        assert snapshot_store.list() == []

    def test_the_compare_and_set_is_per_run(self, snapshot_store: SnapshotStore) -> None:
        snapshot_store.save(make_state("run-a", seq=3), expected_seq=None)

        snapshot_store.save(make_state("run-b", seq=1), expected_seq=None)
        snapshot_store.save(make_state("run-a", seq=4), expected_seq=3)

        assert [snapshot_store.load(r).seq for r in ("run-a", "run-b")] == [4, 1]  # type: ignore[union-attr]

    def test_concurrent_saves_expecting_the_same_seq_let_exactly_one_win(
        self, snapshot_store: SnapshotStore
    ) -> None:
        for round_ in range(10):
            run_id = f"race-{round_}"
            snapshot_store.save(make_state(run_id, seq=1), expected_seq=None)

            def save(writer: str, run_id: str = run_id) -> str:
                snapshot_store.save(make_state(run_id, seq=2, content=writer), expected_seq=1)
                return writer

            outcomes = race(lambda: save("w1"), lambda: save("w2"))

            winners = [o for o in outcomes if isinstance(o, str)]
            assert len(winners) == 1, outcomes
            assert [type(o) for o in outcomes if not isinstance(o, str)] == [StaleWrite]
            assert snapshot_store.load(run_id) == make_state(run_id, seq=2, content=winners[0])

    def test_a_save_after_another_worker_started_the_run_afresh_stores_exactly_its_state(
        self, snapshot_store: SnapshotStore, another_snapshot_store: OpenAnother | None
    ) -> None:
        # Given worker A checkpointed a run up to seq 3, and remembers its transcript
        a1 = make_state(seq=1)
        snapshot_store.save(a1, expected_seq=None)
        a3 = grown(a1, "looking it up")
        snapshot_store.save(a3, expected_seq=1)
        # And worker B deleted it and started a run of the same id afresh, also to seq 3
        other = another_snapshot_store() if another_snapshot_store else snapshot_store
        other.delete("run-1")
        b1 = make_state(seq=1, content="another question")
        other.save(b1, expected_seq=None)
        other.save(grown(b1, "something else"), expected_seq=1)

        # When A saves what follows its seq 3 (the seq matches: the compare-and-set lets it in)
        a5 = grown(a3, "found it")
        snapshot_store.save(a5, expected_seq=3)

        # Then the snapshot is exactly A's state: nothing of B's transcript spliced into it
        assert snapshot_store.load_document("run-1") == snapshot_format.encode(a5)
        assert other.load("run-1") == a5

    def test_a_save_whose_transcript_moved_under_it_twice_is_refused_and_keeps_the_other_writers(
        self,
        snapshot_store: SnapshotStore,
        another_snapshot_store: OpenAnother | None,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        require(APPENDS_TRANSCRIPT, snapshot_store)
        if another_snapshot_store is None:
            pytest.skip("the harness offers no `another_snapshot_store`: no second writer")
        a, other = snapshot_store, another_snapshot_store()
        full = grown(make_state(seq=1), "one", "two", "three", "four")
        # Each time A is about to write, B rewrites the run at the same seq 3 with another
        # transcript that is also a prefix of A's: A's plan is always one step behind.
        rewrites = [
            grown(make_state(seq=1), "one").model_copy(update={"seq": 3}),
            grown(make_state(seq=1), "one", "two", "three").model_copy(update={"seq": 3}),
        ]

        def rewrite() -> None:
            if rewrites:
                state = rewrites.pop(0)
                other.delete("run-1")
                other.save(state.model_copy(update={"seq": 1}), expected_seq=None)
                other.save(state, expected_seq=1)

        put_parts = a._put_parts

        def racing(run_id: str, parts: Parts, expected_seq: int | None) -> None:
            rewrite()
            put_parts(run_id, parts, expected_seq)

        monkeypatch.setattr(a, "_put_parts", racing)
        armed, rewrites[:] = list(rewrites), []
        a.save(make_state(seq=1), expected_seq=None)
        a.save(grown(make_state(seq=1), "one", "two").model_copy(update={"seq": 3}), expected_seq=1)
        rewrites[:] = armed

        # When A saves its seq 9, and the transcript moves under it on both tries
        with pytest.raises(StaleWrite) as refused:
            a.save(full, expected_seq=3)

        # Then the save is refused, not silently dropped, and B's snapshot stands whole
        assert refused.value.run_id == "run-1"
        last = grown(make_state(seq=1), "one", "two", "three").model_copy(update={"seq": 3})
        assert other.load_document("run-1") == snapshot_format.encode(last)

    # --- delete and list ----------------------------------------------------------

    def test_a_deleted_snapshot_is_gone_and_the_run_may_start_afresh(
        self, snapshot_store: SnapshotStore
    ) -> None:
        snapshot_store.save(make_state("run-1", seq=7), expected_seq=None)
        snapshot_store.save(make_state("run-2", seq=1), expected_seq=None)

        snapshot_store.delete("run-1")

        assert snapshot_store.load("run-1") is None
        assert snapshot_store.list() == ["run-2"]
        snapshot_store.save(make_state("run-1", seq=1), expected_seq=None)
        assert snapshot_store.load("run-1") == make_state("run-1", seq=1)

    def test_deleting_a_missing_snapshot_is_not_an_error(
        self, snapshot_store: SnapshotStore
    ) -> None:
        snapshot_store.save(make_state("run-2"), expected_seq=None)

        snapshot_store.delete("run-1")
        snapshot_store.delete("run-1")

        assert snapshot_store.list() == ["run-2"]

    def test_list_names_every_run_with_a_snapshot_sorted(
        self, snapshot_store: SnapshotStore
    ) -> None:
        assert snapshot_store.list() == []
        for run_id in ("run-c", "Run-Z", "run-a", "0-first", "run-b"):
            snapshot_store.save(make_state(run_id), expected_seq=None)
        snapshot_store.save(make_state("run-a", seq=2), expected_seq=1)
        snapshot_store.delete("run-b")

        assert snapshot_store.list() == ["0-first", "Run-Z", "run-a", "run-c"]

    @pytest.mark.parametrize("bad_id", INVALID_IDS, ids=repr)
    def test_an_invalid_run_id_is_refused_and_touches_nothing(
        self, snapshot_store: SnapshotStore, bad_id: object, tmp_path: Path
    ) -> None:
        snapshot_store.save(make_state("run-1"), expected_seq=None)
        before = tree(tmp_path)
        # model_copy does not validate: this is how a bad id from outside reaches a store.
        smuggled = make_state().model_copy(update={"run_id": bad_id})

        calls: list[Callable[[], object]] = [
            lambda: snapshot_store.save(smuggled, expected_seq=None),
            lambda: snapshot_store.save(smuggled, expected_seq=1),
            lambda: snapshot_store.load(bad_id),  # type: ignore[arg-type]
            lambda: snapshot_store.load_document(bad_id),  # type: ignore[arg-type]
            lambda: snapshot_store.delete(bad_id),  # type: ignore[arg-type]
        ]
        for call in calls:
            with pytest.raises(InvalidRunId) as refused:
                call()
            assert "is not a run id" in str(refused.value)

        assert tree(tmp_path) == before
        assert snapshot_store.list() == ["run-1"]
        assert snapshot_store.load("run-1") == make_state("run-1")

    def test_the_longest_valid_run_id_is_accepted(self, snapshot_store: SnapshotStore) -> None:
        run_id = "A-z_9" * 12 + "abcd"
        assert len(run_id) == 64

        snapshot_store.save(make_state(run_id), expected_seq=None)

        assert snapshot_store.list() == [run_id]
        assert snapshot_store.load(run_id) == make_state(run_id)

    # --- size ---------------------------------------------------------------------

    def test_a_snapshot_over_16_mib_is_refused_naming_run_size_and_limit(
        self, snapshot_store: SnapshotStore
    ) -> None:
        snapshot_store.save(make_state(seq=1), expected_seq=None)
        big = make_state(seq=2, content="x" * (16 * 1024 * 1024))
        size = len(snapshot_format.encode(big, max_bytes=2**40))

        with pytest.raises(SnapshotTooLarge) as refused:
            snapshot_store.save(big, expected_seq=1)

        message = str(refused.value)
        assert "run run-1" in message
        assert f"{size} bytes" in message
        assert f"{16 * 1024 * 1024}-byte limit" in message
        assert "lower max_turns or make tools return less" in message
        assert snapshot_store.load("run-1") == make_state(seq=1)

    def test_a_snapshot_just_under_16_mib_round_trips(self, snapshot_store: SnapshotStore) -> None:
        state = make_state(seq=1, content="é" * (8 * 1024 * 1024 - 1024))
        assert 16 * 1024 * 1024 - 4096 < len(snapshot_format.encode(state)) <= 16 * 1024 * 1024

        snapshot_store.save(state, expected_seq=None)

        assert snapshot_store.load("run-1") == state

    def test_a_document_of_exactly_the_limit_is_saved_and_one_byte_more_is_not(
        self, snapshot_store: SnapshotStore
    ) -> None:
        state = make_state(seq=1, content="x" * 1000)
        size = len(snapshot_format.encode(state))
        snapshot_store.max_bytes = size

        snapshot_store.save(state, expected_seq=None)
        longer = make_state(seq=2, content="x" * 1001)
        with pytest.raises(SnapshotTooLarge):
            snapshot_store.save(longer, expected_seq=1)

        assert snapshot_store.load("run-1") == state

    @pytest.mark.parametrize(("document", "error", "fragments"), REFUSALS)
    def test_loading_a_document_this_build_cannot_read_is_refused_saying_why(
        self,
        snapshot_store: SnapshotStore,
        document: bytes,
        error: type[Exception],
        fragments: list[str],
    ) -> None:
        put_raw(snapshot_store, "run-1", document)

        with pytest.raises(error) as refused:
            snapshot_store.load("run-1")

        message = str(refused.value)
        assert "snapshot of run run-1" in message
        for fragment in fragments:
            assert fragment in message
        # The document stays readable as it is, for the operator to inspect.
        assert snapshot_store.load_document("run-1") == document

    def test_the_refusal_survives_pickling_as_celery_would_carry_it(
        self, snapshot_store: SnapshotStore
    ) -> None:
        import pickle

        put_raw(snapshot_store, "run-1", edited_document(_future_version))

        with pytest.raises(SnapshotUnsupportedVersion) as refused:
            snapshot_store.load("run-1")

        assert str(pickle.loads(pickle.dumps(refused.value))) == str(refused.value)

    @pytest.mark.parametrize("document", [b"{truncated", b"", edited_document(_future_version)])
    def test_an_unusable_snapshot_moved_aside_is_kept_and_the_run_has_none(
        self, snapshot_store: SnapshotStore, document: bytes
    ) -> None:
        put_raw(snapshot_store, "run-1", document)
        snapshot_store.save(make_state("run-2"), None)

        where = snapshot_store.quarantine("run-1")

        assert where
        assert snapshot_store.load("run-1") is None
        assert snapshot_store.load_document("run-1") is None
        assert snapshot_store.list() == ["run-2"]
        # The run starts afresh: the next save expects no snapshot
        snapshot_store.save(make_state("run-1", seq=7), None)
        loaded = snapshot_store.load("run-1")
        assert loaded is not None and loaded.seq == 7
        assert snapshot_store.load("run-2") == make_state("run-2")

    def test_a_good_snapshot_moved_aside_twice_is_kept_twice(
        self, snapshot_store: SnapshotStore
    ) -> None:
        snapshot_store.save(make_state(seq=1), None)
        first = snapshot_store.quarantine("run-1")
        snapshot_store.save(make_state(seq=2), None)
        snapshot_store.save(make_state(seq=3, content="longer"), 2)
        second = snapshot_store.quarantine("run-1")
        assert first and second and first != second
        assert snapshot_store.load("run-1") is None

    def test_moving_aside_a_run_without_a_snapshot_returns_none(
        self, snapshot_store: SnapshotStore
    ) -> None:
        assert snapshot_store.quarantine("run-1") is None

    def test_every_document_moved_aside_is_kept(
        self, snapshot_store: SnapshotStore, quarantined: Quarantined | None
    ) -> None:
        if quarantined is None:
            pytest.skip("the harness offers no `quarantined`: the quarantine is not inspected")
        assert snapshot_store.quarantine("run-1") is None
        assert quarantined(snapshot_store, "run-1") == []
        put_raw(snapshot_store, "run-1", b"{truncated")
        assert snapshot_store.quarantine("run-1")
        assert len(quarantined(snapshot_store, "run-1")) == 1
        snapshot_store.save(make_state(seq=2), None)
        snapshot_store.save(make_state(seq=3, content="longer"), 2)
        assert snapshot_store.quarantine("run-1")
        assert len(quarantined(snapshot_store, "run-1")) == 2
        assert quarantined(snapshot_store, "run-2") == []

    def test_a_snapshot_holding_another_runs_state_is_refused_naming_that_run(
        self, snapshot_store: SnapshotStore
    ) -> None:
        put_raw(snapshot_store, "run-1", snapshot_format.encode(make_state("run-2")))

        with pytest.raises(SnapshotMalformed, match="holds the state of run 'run-2'") as refused:
            snapshot_store.load("run-1")

        assert "snapshot of run run-1" in str(refused.value)


class SnapshotTransactionContract:
    """The contract an appending snapshot store offers a run store's transaction
    (:meth:`~store.snapshots.SnapshotStore.plan_save`, ``planned_save_written``,
    ``forget_transcript``): subclass it beside :class:`SnapshotStoreContract` for a backend
    that sets ``appends_transcript``; on one that does not, its tests are skipped."""

    def test_a_planned_save_once_written_is_what_the_next_plan_appends_to_unread(
        self, snapshot_store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        require(APPENDS_TRANSCRIPT, snapshot_store)
        # Given a run saved at seq 1, and its save at seq 3 planned and written as a run
        # store's transaction writes it (the backend's own write of the parts stands in)
        first = make_state(seq=1)
        snapshot_store.save(first, expected_seq=None)
        third = grown(first, "one")
        parts = snapshot_store.plan_save(third, expected_seq=1)
        snapshot_store._put_parts("run-1", parts, 1)
        # When the store is told it was written
        snapshot_store.planned_save_written(third, parts)

        # Then the next plan appends only the new message to it, reading nothing stored
        def unread(run_id: str) -> None:
            raise AssertionError("the plan read the stored tip it was told of")

        monkeypatch.setattr(snapshot_store, "_read_tip", unread)
        fifth = grown(third, "two")
        after = snapshot_store.plan_save(fifth, expected_seq=3)
        assert after.base == parts.tip and len(after.fragments) == 1
        snapshot_store._put_parts("run-1", after, 3)
        snapshot_store.planned_save_written(fifth, after)
        assert snapshot_store.load_document("run-1") == snapshot_format.encode(fifth)

    def test_a_planned_save_forgotten_is_planned_again_from_what_is_stored(
        self, snapshot_store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        require(APPENDS_TRANSCRIPT, snapshot_store)
        # Given a run saved at seq 3, and a plan of seq 5 whose transaction was refused
        third = grown(make_state(seq=1), "one")
        snapshot_store.save(make_state(seq=1), expected_seq=None)
        snapshot_store.save(third, expected_seq=1)
        fifth = grown(third, "two")
        refused = snapshot_store.plan_save(fifth, expected_seq=3)
        # When the store is told to forget the run's transcript
        snapshot_store.forget_transcript("run-1")
        # Then a plan reads the stored tip, and appends to it as the refused plan did
        read_tip, reads = snapshot_store._read_tip, []

        def reading(run_id: str) -> Any:
            reads.append(run_id)
            return read_tip(run_id)

        monkeypatch.setattr(snapshot_store, "_read_tip", reading)
        again = snapshot_store.plan_save(fifth, expected_seq=3)
        assert reads == ["run-1"]
        assert again.base == refused.base and again.fragments == refused.fragments
        # and nothing stored changed
        assert snapshot_store.load("run-1") == third
