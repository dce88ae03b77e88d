"""The RunStore contract: records, the event log, the journal, leases, due runs, retention.

Time is the injected ``clock`` fixture (a :class:`~store.conformance.FakeClock`, which
the ``run_store`` fixture must hand to the store): leases expire when a test moves it,
never because the machine was slow. Every run store passes all of it; the liveness
part of the contract is :class:`~store.conformance.LivenessContract`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runtime.errors import InvalidRunId, LeaseLost, StaleWrite
from runtime.models import Event, RunStatus, Usage
from store.conformance.capabilities import COMBINED_COMMIT, ONE_CALL_LOAD
from store.conformance.due import DueRunsAndRetention
from store.conformance.records import (
    LEASE_MS,
    LEASE_S,
    created,
    event,
    new_run,
    record,
    unchanged,
)
from store.conformance.support import T0_MS, FakeClock, race
from store.runs import JournalEntry, Lease, RunStore


def _no_lease(store: RunStore, clock: FakeClock) -> None:
    pass


def _another_owners_lease(store: RunStore, clock: FakeClock) -> None:
    assert store.acquire_lease("run-1", "worker-b", LEASE_S)


def _expired_own_lease(store: RunStore, clock: FakeClock) -> None:
    assert store.acquire_lease("run-1", "worker-a", LEASE_S)
    clock.advance(LEASE_MS)


def _released_own_lease(store: RunStore, clock: FakeClock) -> None:
    assert store.acquire_lease("run-1", "worker-a", LEASE_S)
    store.release_lease("run-1", "worker-a")


def _taken_over_lease(store: RunStore, clock: FakeClock) -> None:
    assert store.acquire_lease("run-1", "worker-a", LEASE_S)
    clock.advance(LEASE_MS + 1)
    assert store.acquire_lease("run-1", "worker-b", LEASE_S)


def new_runs(store: RunStore, n: int) -> Iterator[str]:
    """``n`` runs created one after the other, each as the caller gets to it."""
    for i in range(n):
        run_id = f"race-{i}"
        new_run(store, run_id)
        yield run_id


class RunStoreContract(DueRunsAndRetention):
    """Subclass it as ``Test…`` beside a ``run_store`` fixture that yields a fresh, empty
    store reading time from the ``clock`` fixture; pytest runs every test below on it."""

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    def test_the_combined_commit_is_claimed_whole_or_not_at_all(self, run_store: RunStore) -> None:
        # commits_with without _commit fails every combined transition; _commit without
        # commits_with is never called.
        assert COMBINED_COMMIT.half_claimed(run_store) is None

    def test_the_one_call_load_is_claimed_whole_or_not_at_all(self, run_store: RunStore) -> None:
        # reads_with without _acquire_and_read fails every turn's claim; _acquire_and_read
        # without reads_with is never called.
        assert ONE_CALL_LOAD.half_claimed(run_store) is None

    # --- records and events -------------------------------------------------------

    def test_a_created_run_reads_back_with_its_first_event(self, run_store: RunStore) -> None:
        first = record(
            "run-1",
            usage=Usage(model_attempts=1, total_tokens=9),
            budgets={"max_turns": 3, "timeout_seconds": 60},
            due_at_ms=T0_MS + 5,
        )

        run_store.create(first, created("run-1"))

        assert run_store.get("run-1") == first
        assert run_store.events("run-1") == [created("run-1")]

    def test_an_unknown_run_has_no_record_and_no_events(self, run_store: RunStore) -> None:
        new_run(run_store, "run-1")

        assert run_store.get("run-2") is None
        assert run_store.events("run-2") == []
        assert run_store.journal("run-2") == []

    def test_creating_a_run_twice_is_a_stale_write_and_keeps_the_first(
        self, run_store: RunStore
    ) -> None:
        first = new_run(run_store, "run-1")
        run_store.append(record("run-1", last_seq=2), [event(2)], owner=None)
        before = unchanged(run_store, "run-1")

        with pytest.raises(StaleWrite) as refused:
            run_store.create(record("run-1", created_at_ms=T0_MS + 1), created("run-1", T0_MS + 1))

        assert refused.value.found_seq == 2
        assert unchanged(run_store, "run-1") == before
        assert run_store.list() == [record("run-1", last_seq=2)]
        assert first.created_at_ms == T0_MS

    def test_appended_events_follow_in_seq_order_and_replace_the_record(
        self, run_store: RunStore
    ) -> None:
        new_run(run_store, "run-1")

        run_store.append(
            record("run-1", last_seq=3, status=RunStatus.MODEL),
            [event(2), event(3, "model.responded", content="hé ☃")],
            owner=None,
        )
        latest = record("run-1", last_seq=4, status=RunStatus.TOOLS, output=None)
        run_store.append(latest, [event(4, "tool.requested", call_id="c1", name="t")], owner=None)

        assert run_store.get("run-1") == latest
        assert [e.seq for e in run_store.events("run-1")] == [1, 2, 3, 4]
        assert run_store.events("run-1")[2] == event(3, "model.responded", content="hé ☃")  # fmt: skip

    def test_a_replicated_append_with_no_replicas_required_appends_and_fences_as_append(
        self, run_store: RunStore
    ) -> None:
        new_run(run_store, "run-1")
        latest = record("run-1", last_seq=2, status=RunStatus.TOOLS)
        requested = event(2, "tool.requested", call_id="c1", name="charge")

        run_store.append_replicated(latest, [requested], owner=None)

        assert run_store.get("run-1") == latest
        assert run_store.events("run-1")[1:] == [requested]
        other = event(2, "tool.requested", call_id="c2", name="charge")
        with pytest.raises(StaleWrite):
            run_store.append_replicated(latest, [other], owner=None)

    @pytest.mark.parametrize("first_seq", [1, 3, 5, 9], ids=lambda s: f"first-seq-{s}")
    def test_an_append_that_does_not_follow_the_last_seq_is_stale_and_writes_nothing(
        self, run_store: RunStore, first_seq: int
    ) -> None:
        new_run(run_store, "run-1")
        run_store.append(record("run-1", last_seq=3), [event(2), event(3)], owner=None)
        before = unchanged(run_store, "run-1")

        with pytest.raises(StaleWrite) as refused:
            run_store.append(
                record("run-1", last_seq=first_seq + 1, status=RunStatus.FAILED, due_at_ms=None),
                [event(first_seq), event(first_seq + 1)],
                owner=None,
            )

        assert (refused.value.expected_seq, refused.value.found_seq) == (first_seq - 1, 3)
        assert unchanged(run_store, "run-1") == before
        assert run_store.list(RunStatus.FAILED) == []

    def test_a_batch_with_a_gap_in_its_seqs_is_refused_and_writes_nothing(
        self, run_store: RunStore
    ) -> None:
        new_run(run_store, "run-1")
        before = unchanged(run_store, "run-1")

        with pytest.raises(ValueError, match="events must be contiguous: 2 then 4"):
            run_store.append(record("run-1", last_seq=4), [event(2), event(4)], owner=None)
        with pytest.raises(ValueError, match="events must be contiguous: 3 then 3"):
            run_store.append(
                record("run-1", last_seq=3), [event(2), event(3), event(3)], owner=None
            )

        assert unchanged(run_store, "run-1") == before
        # The store still takes the next seq: nothing was half-written
        run_store.append(record("run-1", last_seq=2), [event(2)], owner=None)
        assert [e.seq for e in run_store.events("run-1")] == [1, 2]

    @pytest.mark.parametrize("last_seq", [2, 4], ids=["behind", "ahead"])
    def test_a_record_whose_last_seq_is_not_its_last_events_is_refused_and_writes_nothing(
        self, run_store: RunStore, last_seq: int
    ) -> None:
        # A record that disagrees with its events would fence the next append wrongly.
        new_run(run_store, "run-1")
        before = unchanged(run_store, "run-1")

        with pytest.raises(ValueError, match="last_seq must be the last event's seq"):
            run_store.append(record("run-1", last_seq=last_seq), [event(2), event(3)], owner=None)

        assert unchanged(run_store, "run-1") == before
        run_store.append(record("run-1", last_seq=3), [event(2), event(3)], owner=None)
        assert run_store.get("run-1") == record("run-1", last_seq=3)

    def test_an_append_retried_after_its_reply_was_lost_finds_its_own_events_and_succeeds(
        self, run_store: RunStore
    ) -> None:
        # Given a batch that landed, whose reply the worker never saw
        new_run(run_store, "run-1")
        mine = [event(2, worker="a"), event(3, "model.responded", worker="a")]
        run_store.append(record("run-1", last_seq=3), mine, owner=None)

        # When the worker sends it again (what a retry does), it is told it succeeded
        run_store.append(record("run-1", last_seq=3), mine, owner=None)

        # And the events are stored once
        assert run_store.events("run-1") == [created("run-1"), *mine]

    @pytest.mark.parametrize(
        "theirs",
        [
            [event(2, worker="b"), event(3, "model.responded", worker="a")],
            [event(2, worker="a"), event(3, "model.responded", worker="b")],
        ],
        ids=["first-differs", "last-differs"],
    )
    def test_a_different_batch_at_the_same_seqs_is_a_stale_write_not_a_lost_reply(
        self, run_store: RunStore, theirs: list[Event]
    ) -> None:
        new_run(run_store, "run-1")
        mine = [event(2, worker="a"), event(3, "model.responded", worker="a")]
        run_store.append(record("run-1", last_seq=3), mine, owner=None)

        with pytest.raises(StaleWrite) as refused:
            run_store.append(record("run-1", last_seq=3), theirs, owner=None)

        assert (refused.value.expected_seq, refused.value.found_seq) == (1, 3)
        assert run_store.events("run-1") == [created("run-1"), *mine]

    def test_a_batch_that_landed_before_the_log_moved_on_is_a_stale_write(
        self, run_store: RunStore
    ) -> None:
        # Our seqs 2-3 landed, then another worker appended 4: we are behind, not done.
        new_run(run_store, "run-1")
        mine = [event(2), event(3)]
        run_store.append(record("run-1", last_seq=3), mine, owner=None)
        run_store.append(record("run-1", last_seq=4), [event(4, worker="b")], owner=None)

        with pytest.raises(StaleWrite) as refused:
            run_store.append(record("run-1", last_seq=3), mine, owner=None)

        assert refused.value.found_seq == 4
        assert [e.seq for e in run_store.events("run-1")] == [1, 2, 3, 4]

    def test_appending_to_an_unknown_run_is_a_stale_write(self, run_store: RunStore) -> None:
        with pytest.raises(StaleWrite) as refused:
            run_store.append(record("run-1", last_seq=2), [event(2)], owner=None)

        assert refused.value.found_seq is None
        assert unchanged(run_store, "run-1") == (None, [])
        assert run_store.list() == []

    @pytest.mark.parametrize(
        "lose_lease",
        [
            _no_lease,
            _another_owners_lease,
            _expired_own_lease,
            _released_own_lease,
            _taken_over_lease,
        ],
        ids=lambda f: f.__name__.strip("_").replace("_", "-"),
    )
    def test_an_append_by_a_worker_without_the_lease_is_refused_and_writes_nothing(
        self, run_store: RunStore, clock: FakeClock, lose_lease: Any
    ) -> None:
        new_run(run_store, "run-1", due_at_ms=T0_MS + 10)
        lose_lease(run_store, clock)
        before = unchanged(run_store, "run-1")

        with pytest.raises(LeaseLost) as refused:
            run_store.append(
                record("run-1", last_seq=2, status=RunStatus.COMPLETED),
                [event(2)],
                owner="worker-a",
            )

        assert "run run-1" in str(refused.value) and "worker worker-a" in str(refused.value)
        assert unchanged(run_store, "run-1") == before
        assert run_store.list(RunStatus.COMPLETED) == []

    def test_an_append_by_the_lease_holder_is_written(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        new_run(run_store, "run-1")
        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
        clock.advance(LEASE_MS - 1)

        run_store.append(record("run-1", last_seq=2), [event(2)], owner="worker-a")

        assert [e.seq for e in run_store.events("run-1")] == [1, 2]

    def test_an_append_without_an_owner_is_not_fenced_by_the_lease(
        self, run_store: RunStore
    ) -> None:
        # An operator's cancel does not hold the worker's lease; only the seq fences it.
        new_run(run_store, "run-1")
        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)

        cancelled = record("run-1", last_seq=2, status=RunStatus.CANCELLED)
        run_store.append(cancelled, [event(2, "run.cancelled")], owner=None)

        assert run_store.get("run-1") == cancelled

    def test_events_after_a_seq_come_in_order_up_to_the_limit(self, run_store: RunStore) -> None:
        new_run(run_store, "run-1")
        more = [
            event(s, "tool.completed", call_id=f"c{s}", result={"n": [s, None]})
            for s in (2, 3, 4, 5)
        ]
        run_store.append(record("run-1", last_seq=5), more, owner=None)

        assert run_store.events("run-1", after_seq=2) == more[1:]
        assert run_store.events("run-1", after_seq=2, limit=2) == more[1:3]
        assert run_store.events("run-1", after_seq=0, limit=1) == [created("run-1")]
        assert run_store.events("run-1", after_seq=5) == []
        assert run_store.events("run-1", after_seq=9) == []

    def test_runs_are_listed_newest_first(self, run_store: RunStore) -> None:
        for run_id, created_at_ms in [("b", T0_MS + 2), ("c", T0_MS + 1), ("a", T0_MS + 3)]:
            new_run(run_store, run_id, created_at_ms=created_at_ms)

        assert [r.run_id for r in run_store.list()] == ["a", "b", "c"]
        assert [r.run_id for r in run_store.list(limit=2)] == ["a", "b"]

    def test_runs_created_in_the_same_millisecond_list_by_id_descending(
        self, run_store: RunStore
    ) -> None:
        for run_id in ("run-b", "run-c", "run-a"):
            new_run(run_store, run_id)

        assert [r.run_id for r in run_store.list()] == ["run-c", "run-b", "run-a"]

    def test_listing_by_status_follows_each_runs_latest_record(self, run_store: RunStore) -> None:
        new_run(run_store, "run-a", created_at_ms=T0_MS + 1)
        new_run(run_store, "run-b", created_at_ms=T0_MS + 2)
        new_run(run_store, "run-c", created_at_ms=T0_MS + 3)

        waiting = record(
            "run-b", last_seq=2, status=RunStatus.NEEDS_USER_INPUT, created_at_ms=T0_MS + 2
        )
        run_store.append(waiting, [event(2, "run.suspended")], owner=None)

        assert [r.run_id for r in run_store.list(RunStatus.QUEUED)] == ["run-c", "run-a"]
        assert run_store.list(RunStatus.NEEDS_USER_INPUT) == [waiting]
        assert [r.run_id for r in run_store.list(RunStatus.QUEUED, limit=1)] == ["run-c"]
        assert run_store.list(RunStatus.COMPLETED) == []
        assert [r.run_id for r in run_store.list()] == ["run-c", "run-b", "run-a"]

    def test_the_journal_follows_each_tool_call_from_request_to_outcome(
        self, run_store: RunStore
    ) -> None:
        new_run(run_store, "run-1")
        run_store.append(
            record("run-1", last_seq=6, status=RunStatus.TOOLS),
            [
                event(2, "tool.requested", call_id="c1", name="search", arguments={"q": "ratchet"}),
                event(3, "tool.completed", call_id="c1", name="search", result={"hits": 2}),
                event(4, "tool.requested", call_id="c2", name="charge", arguments={"cents": 500}),
                event(5, "tool.failed", call_id="c2", name="charge", error="card declined"),
                event(6, "tool.requested", call_id="c3", name="email"),
            ],
            owner=None,
        )

        assert run_store.journal("run-1") == [
            JournalEntry(call_id="c1", tool="search", arguments={"q": "ratchet"}, status="completed",
                         requested_seq=2, requested_at_ms=T0_MS + 2, result={"hits": 2}),
            JournalEntry(call_id="c2", tool="charge", arguments={"cents": 500}, status="failed",
                         requested_seq=4, requested_at_ms=T0_MS + 4, error="card declined"),
            JournalEntry(call_id="c3", tool="email", status="requested",
                         requested_seq=6, requested_at_ms=T0_MS + 6),
        ]  # fmt: skip

    # --- leases -------------------------------------------------------------------

    def test_a_lease_is_exclusive_until_it_expires(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        new_run(run_store, "run-1")

        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
        assert not run_store.acquire_lease("run-1", "worker-b", LEASE_S)
        assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=T0_MS + LEASE_MS)

        clock.advance(LEASE_MS - 1)
        assert not run_store.acquire_lease("run-1", "worker-b", LEASE_S)

        clock.advance(1)
        assert run_store.lease("run-1") is None
        assert run_store.acquire_lease("run-1", "worker-b", LEASE_S)
        assert not run_store.acquire_lease("run-1", "worker-a", LEASE_S)
        assert run_store.lease("run-1") == Lease(owner="worker-b", expires_at_ms=clock() + LEASE_MS)

    def test_the_holder_renews_its_lease(self, run_store: RunStore, clock: FakeClock) -> None:
        new_run(run_store, "run-1")
        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
        clock.advance(LEASE_MS - 1000)

        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)

        clock.advance(LEASE_MS - 1000)
        assert not run_store.acquire_lease("run-1", "worker-b", LEASE_S)
        assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=clock() + 1000)

    def test_only_the_owner_releases_a_lease(self, run_store: RunStore) -> None:
        new_run(run_store, "run-1")
        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)

        run_store.release_lease("run-1", "worker-b")
        assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=T0_MS + LEASE_MS)

        run_store.release_lease("run-1", "worker-a")
        assert run_store.lease("run-1") is None
        assert run_store.acquire_lease("run-1", "worker-b", LEASE_S)
        run_store.release_lease("run-2", "worker-b")

    def test_leases_of_different_runs_are_independent(self, run_store: RunStore) -> None:
        new_run(run_store, "run-1")
        new_run(run_store, "run-2")

        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
        assert run_store.acquire_lease("run-2", "worker-b", LEASE_S)

        assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=T0_MS + LEASE_MS)
        assert run_store.lease("run-2") == Lease(owner="worker-b", expires_at_ms=T0_MS + LEASE_MS)
        assert run_store.lease("run-3") is None

    def test_renewing_leases_in_one_batch_extends_those_held_and_names_those_taken(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # Given worker-a's leases on three runs, one of them since taken over by worker-b,
        # and a fourth run whose lease worker-a let lapse unclaimed
        for run_id in ("run-1", "run-2", "run-3", "run-4"):
            assert run_store.acquire_lease(run_id, "worker-a", LEASE_S)
        clock.advance(LEASE_MS)
        assert run_store.acquire_lease("run-3", "worker-b", LEASE_S)
        clock.advance(LEASE_MS // 2)

        # When worker-a's heartbeat renews all four at once
        lost = run_store.renew_leases(
            [
                ("run-1", "worker-a"),
                ("run-2", "worker-a"),
                ("run-3", "worker-a"),
                ("run-4", "worker-a"),
            ],
            LEASE_S,
        )

        # Then only the taken one is lost; the others run a full lease from now
        assert lost == ["run-3"]
        for run_id in ("run-1", "run-2", "run-4"):
            assert run_store.lease(run_id) == Lease(
                owner="worker-a", expires_at_ms=clock() + LEASE_MS
            )
        assert run_store.lease("run-3") == Lease(
            owner="worker-b", expires_at_ms=clock() - LEASE_MS // 2 + LEASE_MS
        )

    def test_renewing_a_thousand_leases_renews_every_one(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        held = [(f"run-{i:04d}", f"worker-{i % 7}") for i in range(1500)]
        for run_id, owner in held:
            assert run_store.acquire_lease(run_id, owner, LEASE_S)
        clock.advance(LEASE_MS - 1)

        assert run_store.renew_leases(held, LEASE_S) == []

        clock.advance(LEASE_MS - 1)
        for run_id, owner in held[::97] + held[-1:]:
            assert run_store.lease(run_id) == Lease(owner=owner, expires_at_ms=clock() + 1)

    def test_a_renewal_never_takes_back_a_released_lease(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # Given a turn that released its lease while its heartbeat's renewal was on the way
        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
        run_store.release_lease("run-1", "worker-a")

        # When the renewal lands
        lost = run_store.renew_leases([("run-1", "worker-a")], LEASE_S)

        # Then the run stays free for the next turn, and the old turn hears its lease is gone
        assert lost == ["run-1"]
        assert run_store.lease("run-1") is None
        assert run_store.acquire_lease("run-1", "worker-b", LEASE_S)

    def test_a_lease_taken_over_and_released_since_is_lost_to_its_first_owner(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
        clock.advance(LEASE_MS)
        assert run_store.acquire_lease("run-1", "worker-b", LEASE_S)
        run_store.release_lease("run-1", "worker-b")

        assert run_store.renew_leases([("run-1", "worker-a")], LEASE_S) == ["run-1"]
        assert run_store.lease("run-1") is None

    def test_renewing_no_leases_renews_nothing(self, run_store: RunStore) -> None:
        assert run_store.renew_leases([], LEASE_S) == []

    def test_a_batch_with_an_invalid_run_id_renews_nothing(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
        clock.advance(LEASE_MS // 2)

        with pytest.raises(InvalidRunId):
            run_store.renew_leases([("run-1", "worker-a"), ("../etc", "worker-a")], LEASE_S)

        assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=T0_MS + LEASE_MS)

    # --- concurrency --------------------------------------------------------------

    def test_two_workers_appending_the_same_seq_let_exactly_one_win(
        self, run_store: RunStore
    ) -> None:
        for run_id in new_runs(run_store, 10):

            def append(worker: str, run_id: str = run_id) -> str:
                latest = record(run_id, last_seq=2, status=RunStatus.MODEL)
                run_store.append(latest, [event(2, worker=worker)], owner=None)
                return worker

            outcomes = race(lambda: append("w1"), lambda: append("w2"))

            winners = [o for o in outcomes if isinstance(o, str)]
            assert len(winners) == 1, outcomes
            assert [type(o) for o in outcomes if not isinstance(o, str)] == [StaleWrite]
            assert run_store.events(run_id, after_seq=1) == [event(2, worker=winners[0])]

    def test_two_workers_taking_the_same_lease_let_exactly_one_hold_it(
        self, run_store: RunStore
    ) -> None:
        for run_id in new_runs(run_store, 10):

            def acquire(worker: str, run_id: str = run_id) -> bool:
                return run_store.acquire_lease(run_id, worker, LEASE_S)

            taken = race(lambda: acquire("w1"), lambda: acquire("w2"))

            assert sorted(taken, key=repr) == [False, True]
            lease = run_store.lease(run_id)
            assert lease is not None and lease.owner == ("w1" if taken[0] is True else "w2")
