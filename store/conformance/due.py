"""The RunStore contract, its second half: due runs (``overdue``) and retention (``purge``).

Part of :class:`~store.conformance.RunStoreContract`; not a class to subclass alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.models import RunStatus
from store.conformance.records import LEASE_MS, LEASE_S, created, event, new_run, record, unchanged
from store.conformance.support import T0_MS, FakeClock
from store.runs import RunStore


def move_to(
    store: RunStore,
    run_id: str,
    status: RunStatus,
    at_ms: int,
    seq: int = 2,
    due: int | None = None,
) -> None:
    """Append one event that takes the run to ``status``, recorded as updated at ``at_ms``."""
    latest = record(run_id, last_seq=seq, status=status, due_at_ms=due).model_copy(
        update={"updated_at_ms": at_ms}
    )
    store.append(latest, [event(seq, f"to.{status.value}")], owner=None)


FINISHED = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD_LETTERED)
KEPT = (
    RunStatus.MODEL,
    RunStatus.NEEDS_USER_INPUT,
    RunStatus.AWAITING_APPROVAL,
    RunStatus.NEEDS_RECONCILIATION,
    RunStatus.STALLED,
)


class DueRunsAndRetention:
    """Overdue runs and the purge of finished ones; every run store passes them."""

    # --- overdue runs -------------------------------------------------------------

    def test_overdue_lists_live_runs_past_due_without_a_live_lease_most_overdue_first(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # Given runs in every situation the sweeper meets
        new_run(run_store, "late", due_at_ms=T0_MS + 100)
        new_run(run_store, "later", due_at_ms=T0_MS + 50)
        new_run(run_store, "not-yet", due_at_ms=T0_MS + 10_000)
        new_run(run_store, "leased", due_at_ms=T0_MS + 10)
        new_run(run_store, "lease-lapsed", due_at_ms=T0_MS + 20)
        new_run(run_store, "waiting", due_at_ms=None, status=RunStatus.NEEDS_USER_INPUT)
        new_run(run_store, "done", due_at_ms=None, status=RunStatus.COMPLETED)
        new_run(run_store, "parked", due_at_ms=None, status=RunStatus.NEEDS_RECONCILIATION)
        assert run_store.acquire_lease("lease-lapsed", "worker-a", 0.5)
        clock.advance(1000)
        assert run_store.acquire_lease("leased", "worker-b", LEASE_S)

        # Then only the free, past-due, live ones are returned, most overdue first
        assert run_store.overdue() == ["lease-lapsed", "later", "late"]
        assert run_store.overdue(limit=2) == ["lease-lapsed", "later"]

    def test_a_run_due_exactly_now_is_overdue_and_a_lease_ending_now_has_expired(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        new_run(run_store, "run-1", due_at_ms=T0_MS + LEASE_MS)
        new_run(run_store, "run-2", due_at_ms=T0_MS + LEASE_MS + 1)
        assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)

        clock.advance(LEASE_MS - 1)
        assert run_store.overdue() == []

        clock.advance(1)
        assert run_store.overdue() == ["run-1"]

    def test_overdue_fills_its_limit_past_runs_with_a_live_lease(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        for i in range(5):
            new_run(run_store, f"busy-{i}", due_at_ms=T0_MS + i)
        for i in range(3):
            new_run(run_store, f"free-{i}", due_at_ms=T0_MS + 10 + i)
        clock.advance(100)
        for i in range(5):
            assert run_store.acquire_lease(f"busy-{i}", "worker-a", LEASE_S)

        assert run_store.overdue(limit=2) == ["free-0", "free-1"]

    def test_a_run_leaves_the_overdue_list_when_it_suspends_finishes_or_moves_on(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        for run_id in ("suspends", "finishes", "moves-on", "stays"):
            new_run(run_store, run_id, due_at_ms=T0_MS + 10)
        clock.advance(100)
        # Equally overdue: the contract does not order ties, so compare as a set.
        assert sorted(run_store.overdue()) == ["finishes", "moves-on", "stays", "suspends"]

        run_store.append(
            record("suspends", last_seq=2, status=RunStatus.BLOCKED, due_at_ms=None),
            [event(2, "run.suspended")],
            owner=None,
        )
        run_store.append(
            record("finishes", last_seq=2, status=RunStatus.COMPLETED, due_at_ms=None),
            [event(2, "run.completed")],
            owner=None,
        )
        run_store.append(record("moves-on", last_seq=2, status=RunStatus.MODEL, due_at_ms=T0_MS + 500),
                         [event(2)], owner=None)  # fmt: skip

        assert run_store.overdue() == ["stays"]

    def test_a_run_waiting_for_a_person_is_overdue_when_it_expires_and_leaves_when_it_ends(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # Given runs suspended on a person: two under a max_suspended_s (due when they
        # expire, runtime.recovery.sweep_due_ms), one without (never due)
        for run_id in ("expires", "answered", "patient"):
            new_run(run_store, run_id, due_at_ms=T0_MS + 10)
        for run_id, due in (("expires", T0_MS + 2_001), ("answered", T0_MS + 2_001),
                            ("patient", None)):  # fmt: skip
            run_store.append(
                record(run_id, last_seq=2, status=RunStatus.NEEDS_USER_INPUT, due_at_ms=due),
                [event(2, "run.suspended")],
                owner=None,
            )
        # Then none is overdue before it expires, both are at the instant they do
        clock.advance(2_000)
        assert run_store.overdue() == []
        clock.advance(1)
        assert sorted(run_store.overdue()) == ["answered", "expires"]
        # And a run leaves the index once it has expired or been answered
        run_store.append(
            record("expires", last_seq=3, status=RunStatus.FAILED, due_at_ms=None),
            [event(3, "run.expired")],
            owner=None,
        )
        run_store.append(
            record("answered", last_seq=3, status=RunStatus.MODEL, due_at_ms=T0_MS + 60_000),
            [event(3, "run.continued")],
            owner=None,
        )
        clock.advance(10_000)
        assert run_store.overdue() == []

    def test_a_run_that_moved_on_a_little_is_overdue_at_its_new_due_time_not_before(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        new_run(run_store, "run-1", due_at_ms=T0_MS + 1000)
        new_run(run_store, "other", due_at_ms=T0_MS + 5000)
        # A due time that moves earlier counts at once.
        run_store.append(
            record("other", last_seq=2, status=RunStatus.MODEL, due_at_ms=T0_MS + 900),
            [event(2)],
            owner=None,
        )
        # Four quick transitions, each one due 100 ms later than the one before.
        for seq in range(2, 6):
            due = T0_MS + 1000 + 100 * (seq - 1)
            run_store.append(
                record("run-1", last_seq=seq, status=RunStatus.MODEL, due_at_ms=due),
                [event(seq)],
                owner=None,
            )
        clock.advance(1000)
        assert run_store.overdue() == ["other"]
        clock.advance(399)
        assert run_store.overdue() == ["other"]
        clock.advance(1)
        assert sorted(run_store.overdue()) == ["other", "run-1"]

    def test_purge_deletes_only_finished_runs_older_than_the_cutoff_and_counts_them(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # Given old finished runs, old runs that are live, suspended or parked, and new finished ones
        for status in FINISHED:
            new_run(run_store, f"old-{status.value}", due_at_ms=T0_MS + 10)
            move_to(run_store, f"old-{status.value}", status, T0_MS + 1_000)
            new_run(run_store, f"new-{status.value}", due_at_ms=T0_MS + 10)
            move_to(run_store, f"new-{status.value}", status, T0_MS + 9_000)
        for status in KEPT:
            new_run(run_store, f"kept-{status.value}", due_at_ms=T0_MS + 10)
            due = T0_MS + 10 if status.is_live else None
            move_to(run_store, f"kept-{status.value}", status, T0_MS + 1_000, due=due)
        run_store.acquire_lease("old-completed", "worker-a", LEASE_S)
        clock.advance(100_000)
        kept_before = {s: unchanged(run_store, f"kept-{s.value}") for s in KEPT}
        # When finished runs last updated before T0 + 5 s are purged
        assert run_store.purge(before_ms=T0_MS + 5_000) == len(FINISHED)
        # Then the old finished runs are gone: record, events, lease and every index
        for status in FINISHED:
            assert run_store.get(f"old-{status.value}") is None
            assert run_store.events(f"old-{status.value}") == []
            assert [r.run_id for r in run_store.list(status)] == [f"new-{status.value}"]
        assert run_store.lease("old-completed") is None
        listed = {r.run_id for r in run_store.list(limit=100)}
        assert listed == {f"new-{s.value}" for s in FINISHED} | {f"kept-{s.value}" for s in KEPT}
        assert run_store.overdue() == ["kept-model"]
        # And everything else is untouched
        for status in KEPT:
            assert unchanged(run_store, f"kept-{status.value}") == kept_before[status]
        assert all(run_store.get(f"new-{s.value}") is not None for s in FINISHED)
        # And a second purge with the same cutoff finds nothing more
        assert run_store.purge(before_ms=T0_MS + 5_000) == 0

    def test_purge_takes_the_oldest_first_up_to_its_limit_and_tells_forget(
        self, run_store: RunStore
    ) -> None:
        for i in range(5):
            new_run(run_store, f"done-{i}")
            move_to(run_store, f"done-{i}", RunStatus.COMPLETED, T0_MS + 100 * (5 - i))
        forgotten: list[str] = []

        assert run_store.purge(T0_MS + 10_000, limit=2, forget=forgotten.append) == 2

        assert sorted(forgotten) == ["done-3", "done-4"]
        assert {r.run_id for r in run_store.list()} == {"done-0", "done-1", "done-2"}
        # A run finished exactly at the cutoff is not before it
        assert run_store.purge(T0_MS + 300, limit=10) == 0
        assert run_store.purge(T0_MS + 301, limit=10) == 1

    def test_a_dead_lettered_run_that_is_resumed_is_no_longer_purged(
        self, run_store: RunStore
    ) -> None:
        new_run(run_store, "revived")
        move_to(run_store, "revived", RunStatus.DEAD_LETTERED, T0_MS + 100)
        move_to(run_store, "revived", RunStatus.MODEL, T0_MS + 200, seq=3, due=T0_MS + 300)

        assert run_store.purge(T0_MS + 10_000) == 0
        assert run_store.get("revived") is not None and len(run_store.events("revived")) == 3

    def test_a_purged_run_id_can_be_used_again(self, run_store: RunStore) -> None:
        new_run(run_store, "again")
        move_to(run_store, "again", RunStatus.FAILED, T0_MS + 100)
        assert run_store.purge(T0_MS + 10_000) == 1

        new_run(run_store, "again")

        assert run_store.events("again") == [created("again")]
        assert run_store.purge(T0_MS + 10_000) == 0

    @pytest.mark.parametrize(("before_ms", "limit"), [(-1, 10), (10, 0), (1.5, 10), (True, 10)])
    def test_purge_refuses_a_bad_cutoff_or_limit(
        self, run_store: RunStore, before_ms: Any, limit: int
    ) -> None:
        with pytest.raises(ValueError):
            run_store.purge(before_ms, limit)
