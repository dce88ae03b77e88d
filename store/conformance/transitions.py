"""``RunStore.commit``: a transition's events, snapshot and lease release, on a store pair.

A run store that ``commits_with`` the snapshot store (the capability
``combined_commit``: the Redis run store beside a Redis snapshot store on the same
server and prefix) writes the whole transition in one atomic call; any other pair
makes the separate calls each contract promises. Every fence holds on both paths: a
zombie's transition (lease lost, seq moved on) writes nothing anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime.errors import LeaseLost, SnapshotMalformed, StaleWrite
from runtime.models import Event, Message, RunState
from store.conformance.capabilities import COMBINED_COMMIT, ONE_CALL_LOAD
from store.conformance.snapshots import make_state, put_raw
from store.conformance.support import FakeClock
from store.runs import Checkpoint, Dropped, RunRecord, RunStore
from store.snapshots import SnapshotStore
from store.snapshots import format as snapshot_format

LEASE_S = 30

Pair = tuple[RunStore, SnapshotStore]
"""A run store and the snapshot store its transitions checkpoint to."""


def said(state: RunState, text: str) -> RunState:
    """``state`` one seq on, the assistant having said ``text``."""
    message = Message(role="assistant", content=text)
    return state.model_copy(
        update={"seq": state.seq + 1, "transcript": (*state.transcript, message)}
    )


def event(seq: int, text: str) -> Event:
    return Event(seq=seq, type="model.responded", at_ms=seq, data={"text": text})


def record_of(state: RunState) -> RunRecord:
    return RunRecord.from_state(state, state.created_at_ms + state.seq, None)


def started(runs: RunStore, snapshots: SnapshotStore, owner: str = "worker-a") -> RunState:
    """A run at seq 1 with its snapshot saved, its lease held by ``owner``."""
    state = make_state()
    runs.create(
        record_of(state), Event(seq=1, type="run.created", at_ms=1, data={"run_id": "run-1"})
    )
    snapshots.save(state, None)
    assert runs.acquire_lease("run-1", owner, LEASE_S)
    return state


def transition(
    runs: RunStore,
    snapshots: SnapshotStore,
    after: RunState,
    text: str,
    expected_seq: int | None,
    release: bool = False,
) -> None:
    """Worker A commits the one event that led to ``after`` (the assistant said ``text``)."""
    checkpoint = Checkpoint(snapshots, after, expected_seq)
    runs.commit(record_of(after), [event(after.seq, text)], "worker-a", checkpoint, release)


def written(
    runs: RunStore, snapshots: SnapshotStore
) -> tuple[RunRecord | None, list[Event], bytes | None]:
    """All a transition of run-1 writes: the record, the events, the snapshot's bytes."""
    return runs.get("run-1"), runs.events("run-1"), snapshots.load_document("run-1")


def combined(runs: RunStore, snapshots: SnapshotStore) -> bool:
    """Whether this pair takes the combined path; skips the calling test, saying why, if not."""
    if not COMBINED_COMMIT.offered_by(runs):
        pytest.skip(COMBINED_COMMIT.missing(runs))
    if not runs.commits_with(snapshots):
        pytest.skip(
            f"{type(runs).__name__} offers `combined_commit` but not with this "
            f"{type(snapshots).__name__}: commits_with() is False, so the calls are separate"
        )
    return True


def read_together(runs: RunStore, snapshots: SnapshotStore) -> bool:
    """Whether this pair reads the snapshot with the lease; skips the calling test, saying
    why, if not."""
    if not ONE_CALL_LOAD.offered_by(runs):
        pytest.skip(ONE_CALL_LOAD.missing(runs))
    if not runs.reads_with(snapshots):
        pytest.skip(
            f"{type(runs).__name__} offers `one_call_load` but not with this "
            f"{type(snapshots).__name__}: reads_with() is False, so the reads are separate"
        )
    return True


class TransitionContract:
    """Subclass it as ``Test…`` beside ``run_store`` and ``snapshot_store`` fixtures (or one
    ``stores`` fixture yielding the pair); pytest runs every test below on the pair."""

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def stores(
        self, run_store: RunStore, snapshot_store: SnapshotStore
    ) -> Iterator[tuple[RunStore, SnapshotStore]]:
        yield run_store, snapshot_store

    def test_a_run_store_commits_only_with_a_snapshot_store_that_appends_transcripts(
        self, stores: Pair
    ) -> None:
        # The combined path writes the snapshot as an appending store's parts (its head and
        # new messages); a store that keeps whole documents has none to offer it.
        runs, snapshots = stores
        assert not runs.commits_with(snapshots) or snapshots.appends_transcript

    def test_a_transition_writes_its_events_record_and_snapshot(self, stores: Pair) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        after = said(said(state, "one"), "two")
        events = [event(2, "one"), event(3, "two")]

        runs.commit(record_of(after), events, "worker-a", Checkpoint(snapshots, after, state.seq))

        assert runs.events("run-1")[1:] == events
        assert runs.get("run-1") == record_of(after)
        assert snapshots.load("run-1") == after
        assert snapshots.load_document("run-1") == snapshot_format.encode(after)
        # Without `release` the lease stays with its holder
        lease = runs.lease("run-1")
        assert lease is not None and lease.owner == "worker-a"

    def test_a_transition_that_releases_lets_the_lease_go_with_it(self, stores: Pair) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        after = said(state, "one")

        transition(runs, snapshots, after, "one", 1, release=True)

        assert runs.lease("run-1") is None
        assert runs.acquire_lease("run-1", "worker-b", LEASE_S)

    def test_a_finishing_transition_deletes_the_snapshot_and_lets_the_lease_go_with_it(
        self, stores: Pair
    ) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        after = said(state, "done")

        runs.commit(record_of(after), [event(2, "done")], "worker-a", Dropped(snapshots), True)

        assert runs.events("run-1")[-1] == event(2, "done")
        assert runs.get("run-1") == record_of(after)
        assert snapshots.load("run-1") is None and "run-1" not in snapshots.list()
        assert runs.lease("run-1") is None

    def test_a_zombies_finishing_transition_deletes_nothing(self, stores: Pair) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        runs.release_lease("run-1", "worker-a")
        assert runs.acquire_lease("run-1", "worker-b", LEASE_S)

        with pytest.raises(LeaseLost):
            runs.commit(
                record_of(said(state, "done")), [event(2, "done")], "worker-a",
                Dropped(snapshots), True,
            )  # fmt: skip

        assert snapshots.load("run-1") == state and runs.get("run-1") == record_of(state)
        lease = runs.lease("run-1")
        assert lease is not None and lease.owner == "worker-b"

    def test_transitions_chain_and_the_snapshot_grows_by_appends(self, stores: Pair) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        for i in range(2, 12):
            after = said(state, f"message {i}")
            checkpoint = Checkpoint(snapshots, after, state.seq)
            runs.commit(record_of(after), [event(i, f"message {i}")], "worker-a", checkpoint)
            state = after
        assert snapshots.load("run-1") == state
        assert [e.seq for e in runs.events("run-1")] == list(range(1, 12))

    def test_a_zombies_transition_after_a_takeover_writes_nothing(
        self, stores: Pair, clock: FakeClock
    ) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        # Given worker A's lease expired and worker B took the run
        clock.advance(LEASE_S * 1000 + 1)
        assert runs.acquire_lease("run-1", "worker-b", LEASE_S)
        before = written(runs, snapshots)

        # When A commits its transition, it is refused
        with pytest.raises(LeaseLost):
            transition(runs, snapshots, said(state, "zombie"), "zombie", 1, release=True)

        # Then nothing changed: events, record, snapshot, and B's lease
        assert written(runs, snapshots) == before
        lease = runs.lease("run-1")
        assert lease is not None and lease.owner == "worker-b"

    def test_a_transition_behind_the_log_is_stale_and_writes_nothing(self, stores: Pair) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        transition(runs, snapshots, said(state, "theirs"), "theirs", 1)
        before = written(runs, snapshots)

        with pytest.raises(StaleWrite):
            transition(runs, snapshots, said(state, "mine"), "mine", 1)

        assert written(runs, snapshots) == before

    def test_a_transition_retried_after_its_reply_was_lost_succeeds_once(
        self, stores: Pair
    ) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        after = said(state, "one")
        args = (record_of(after), [event(2, "one")], "worker-a")
        runs.commit(*args, Checkpoint(snapshots, after, 1))

        # The same transition sent again (what a retry of a lost reply does) is told it succeeded
        if runs.commits_with(snapshots):
            runs.commit(*args, Checkpoint(snapshots, after, 1))
        else:
            # Apart, the events' retry is found landed; the snapshot's own retry finds its document.
            runs.append(*args)
            snapshots.save(after, 1)

        assert runs.events("run-1")[1:] == [event(2, "one")]
        assert snapshots.load("run-1") == after

    # --- the combined path only ---------------------------------------------------

    def test_a_snapshot_behind_its_compare_and_set_refuses_the_whole_transition(
        self, stores: Pair
    ) -> None:
        runs, snapshots = stores
        combined(runs, snapshots)
        state = started(runs, snapshots)
        before = written(runs, snapshots)

        # A checkpoint that expects no snapshot, where one is stored: refused, and so are the events
        with pytest.raises(StaleWrite):
            transition(runs, snapshots, said(state, "one"), "one", None)

        assert written(runs, snapshots) == before

    # --- the lease, the record and the snapshot read together ---------------------

    def test_a_lease_taken_with_the_snapshot_loads_what_the_separate_reads_load(
        self, stores: Pair
    ) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        after = said(said(state, "one"), "two")
        transition(runs, snapshots, said(state, "one"), "one", 1)
        transition(runs, snapshots, after, "two", 2)
        # Read as by this process, which saved it (the fragments after its own tip), and as
        # by another one, which has seen none of them (the whole snapshot)
        for knows in (True, False):
            if not knows:
                snapshots.forget_transcript("run-1")
            taken, record, read = runs.acquire_and_read("run-1", "worker-a", LEASE_S, snapshots)
            assert taken and record == runs.get("run-1") == record_of(after)
            assert (read is not None) is runs.reads_with(snapshots)
            assert snapshots.load("run-1", read) == after
            assert snapshots.load("run-1") == after

    def test_a_snapshot_read_after_a_transcript_other_turns_grew_gets_their_messages(
        self, stores: Pair
    ) -> None:
        # The pool's other process saved the last two checkpoints: this one knows the
        # transcript of two turns ago and reads the head and the messages after it.
        runs, snapshots = stores
        state = started(runs, snapshots)
        one = said(state, "one")
        transition(runs, snapshots, one, "one", 1)
        known = snapshots._known("run-1")
        latest = said(said(one, "two"), "three")
        transition(runs, snapshots, said(one, "two"), "two", 2)
        transition(runs, snapshots, latest, "three", 3)
        if known is not None:
            snapshots._remember("run-1", known.seq, known.transcript, known.tip)

        taken, record, read = runs.acquire_and_read("run-1", "worker-a", LEASE_S, snapshots)

        assert taken and record == record_of(latest)
        assert snapshots.load("run-1", read) == latest

    def test_a_snapshot_read_with_the_lease_may_lag_the_log_as_a_separate_read_does(
        self, stores: Pair
    ) -> None:
        # The events are the truth and may run ahead of the snapshot (a turn that crashed
        # after appending): the record says where the log ends, the snapshot where it was.
        runs, snapshots = stores
        state = started(runs, snapshots)
        one = said(state, "one")
        transition(runs, snapshots, one, "one", 1)
        ahead = said(one, "two")
        runs.append(record_of(ahead), [event(3, "two")], "worker-a")

        taken, record, read = runs.acquire_and_read("run-1", "worker-a", LEASE_S, snapshots)

        assert taken and record is not None and record.last_seq == 3
        assert snapshots.load("run-1", read) == one

    def test_a_damaged_snapshot_read_with_the_lease_is_refused_as_a_separate_read_is(
        self, stores: Pair
    ) -> None:
        runs, snapshots = stores
        started(runs, snapshots)
        snapshots.delete("run-1")
        put_raw(snapshots, "run-1", b"{truncated")
        with pytest.raises(SnapshotMalformed) as apart:
            snapshots.load("run-1")

        taken, _, read = runs.acquire_and_read("run-1", "worker-a", LEASE_S, snapshots)

        assert taken
        with pytest.raises(SnapshotMalformed) as together:
            snapshots.load("run-1", read)
        assert str(together.value) == str(apart.value)

    def test_a_run_without_a_snapshot_reads_none_with_the_lease(self, stores: Pair) -> None:
        runs, snapshots = stores
        started(runs, snapshots)
        snapshots.delete("run-1")

        taken, record, read = runs.acquire_and_read("run-1", "worker-a", LEASE_S, snapshots)

        assert taken and record == runs.get("run-1")
        assert snapshots.load("run-1", read) is None

    def test_a_lease_another_owner_holds_reads_nothing(self, stores: Pair) -> None:
        runs, snapshots = stores
        started(runs, snapshots)

        assert runs.acquire_and_read("run-1", "worker-b", LEASE_S, snapshots) == (
            False,
            None,
            None,
        )
        lease = runs.lease("run-1")
        assert lease is not None and lease.owner == "worker-a"

    def test_a_caller_that_remembers_the_state_the_log_ends_at_is_read_no_snapshot(
        self, stores: Pair
    ) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        after = said(state, "one")
        transition(runs, snapshots, after, "one", 1)

        remembered = runs.acquire_and_read("run-1", "worker-a", LEASE_S, snapshots, after.seq)
        behind = runs.acquire_and_read("run-1", "worker-a", LEASE_S, snapshots, state.seq)

        assert remembered == (True, record_of(after), None)
        assert behind[:2] == (True, record_of(after))
        assert (behind[2] is not None) is runs.reads_with(snapshots)
        assert snapshots.load("run-1", behind[2]) == after

    def test_a_read_of_another_runs_snapshot_is_refused(self, stores: Pair) -> None:
        runs, snapshots = stores
        started(runs, snapshots)
        read_together(runs, snapshots)
        _, _, read = runs.acquire_and_read("run-1", "worker-a", LEASE_S, snapshots)

        with pytest.raises(ValueError, match="run-1"):
            snapshots.load("run-2", read)

    # --- the lease taken with the turn's first write (tasks/ahead.py) --------------

    def test_a_write_sent_with_the_lease_lands_when_the_run_has_the_record_remembered(
        self, stores: Pair
    ) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        one = said(state, "one")
        transition(runs, snapshots, one, "one", 1)
        runs.release_lease("run-1", "worker-a")
        two = said(one, "two")

        answer = runs.acquire_and_append(
            "run-1", "worker-b", LEASE_S, snapshots, record_of(one), record_of(two),
            [event(3, "two")],
        )  # fmt: skip

        assert answer == (True, record_of(two), None, True)
        assert runs.get("run-1") == record_of(two)
        assert [e.seq for e in runs.events("run-1")] == [1, 2, 3]
        lease = runs.lease("run-1")
        assert lease is not None and lease.owner == "worker-b"

    def test_a_write_sent_with_the_lease_is_dropped_by_each_fence_and_the_lease_still_read(
        self, stores: Pair
    ) -> None:
        runs, snapshots = stores
        state = started(runs, snapshots)
        one = said(state, "one")
        transition(runs, snapshots, one, "one", 1)
        two = said(one, "two")
        # Another run had this id: same seq, another record
        other = record_of(one).model_copy(
            update={"created_at_ms": record_of(one).created_at_ms - 1}
        )
        # The log moved on past the remembered seq: a journal planned on the state before
        late = said(state, "late")
        for was, record, events in (
            (other, record_of(two), [event(3, "two")]),
            (record_of(state), record_of(late), [event(2, "late")]),
        ):
            taken, found, read, appended = runs.acquire_and_append(
                "run-1", "worker-a", LEASE_S, snapshots, was, record, events
            )
            assert (taken, found, appended) == (True, record_of(one), False)
            assert snapshots.load("run-1", read) == one
            assert runs.get("run-1") == record_of(one) and len(runs.events("run-1")) == 2

        # Another owner holds the lease: nothing taken, nothing written
        assert runs.acquire_and_append(
            "run-1", "worker-b", LEASE_S, snapshots, record_of(one), record_of(two),
            [event(3, "two")],
        ) == (False, None, None, False)  # fmt: skip
        assert runs.get("run-1") == record_of(one) and len(runs.events("run-1")) == 2
        lease = runs.lease("run-1")
        assert lease is not None and lease.owner == "worker-a"
