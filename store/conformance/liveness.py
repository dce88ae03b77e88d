"""The RunStore liveness contract: worker processes alive or dead, and their leases.

Each worker process renews a short liveness record; a lease owner id names its
process (``<process>/<attempt>``). A lease held by a dead process (its record
lapsed) may be taken at once; one held by a live process, or by an owner that
names no process or keeps no record, only when it expires. Time is the injected
``clock`` fixture. Also here: ``postpone``, the sweeper's move of a due run.
"""

from __future__ import annotations

import pytest

from runtime.errors import LeaseLost
from runtime.models import RunStatus
from store.conformance.records import event, new_run, record
from store.conformance.support import T0_MS, FakeClock, race
from store.runs import Claim, Lease, Orphan, RunStore

LEASE_S = 30
LEASE_MS = LEASE_S * 1000
ALIVE_S = 3
ALIVE_MS = ALIVE_S * 1000
A = "host-a:101:aaaa"
B = "host-b:202:bbbb"


def owner(process: str, attempt: str = "t1") -> str:
    return f"{process}/{attempt}"


class LivenessContract:
    """Subclass it as ``Test…`` beside a ``run_store`` fixture (as for
    :class:`~store.conformance.RunStoreContract`); every run store passes it."""

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    def test_a_liveness_beat_says_whether_the_process_was_still_alive(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        assert run_store.liveness(A) is None
        assert run_store.renew_liveness(A, ALIVE_S) is False  # first beat
        assert run_store.liveness(A) == T0_MS + ALIVE_MS
        clock.advance(ALIVE_MS - 1)
        assert run_store.renew_liveness(A, ALIVE_S) is True
        clock.advance(ALIVE_MS)
        assert run_store.renew_liveness(A, ALIVE_S) is False  # it had lapsed
        assert run_store.liveness(A) == clock() + ALIVE_MS

    def test_a_process_id_with_a_slash_is_refused(self, run_store: RunStore) -> None:
        with pytest.raises(ValueError, match="process id"):
            run_store.renew_liveness("host:1:t/x", ALIVE_S)

    def test_claiming_a_free_lease_takes_it_and_the_holder_renews_it(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        assert run_store.claim_lease("run-1", owner(A), LEASE_S) == Claim(True)
        clock.advance(1000)
        assert run_store.claim_lease("run-1", owner(A), LEASE_S) == Claim(True)
        assert run_store.lease("run-1") == Lease(owner=owner(A), expires_at_ms=clock() + LEASE_MS)

    def test_a_live_process_keeps_its_lease_until_it_really_expires(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # Given process A alive and holding run-1
        run_store.renew_liveness(A, ALIVE_S)
        assert run_store.claim_lease("run-1", owner(A), LEASE_S).taken
        # When B claims it while A keeps beating, through almost the whole lease
        for _ in range(LEASE_MS // 1000 - 1):
            clock.advance(1000)
            run_store.renew_liveness(A, ALIVE_S)
            claim = run_store.claim_lease("run-1", owner(B), LEASE_S)
            # Then B is refused, told who holds it and until when that process is alive
            assert claim == Claim(False, owner(A), clock() + ALIVE_MS)
        assert run_store.orphaned() == []
        # and takes it only once the lease itself expires
        clock.advance(1000)
        assert run_store.claim_lease("run-1", owner(B), LEASE_S) == Claim(True)

    def test_a_dead_process_loses_its_lease_at_once_and_cannot_write_after(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # Given process A holding run-1, then silent for longer than its liveness
        new_run(run_store, "run-1")
        run_store.renew_liveness(A, ALIVE_S)
        assert run_store.claim_lease("run-1", owner(A), LEASE_S).taken
        clock.advance(ALIVE_MS - 1)
        assert not run_store.claim_lease("run-1", owner(B), LEASE_S).taken
        clock.advance(1)

        # When B claims it, long before the lease would expire
        claim = run_store.claim_lease("run-1", owner(B), LEASE_S)

        # Then B takes it from A (compare-and-set on the dead owner), and A is fenced out
        assert claim == Claim(True, took_from=owner(A))
        assert run_store.lease("run-1") == Lease(owner=owner(B), expires_at_ms=clock() + LEASE_MS)
        with pytest.raises(LeaseLost):
            run_store.append(
                record("run-1", last_seq=2, status=RunStatus.MODEL), [event(2)], owner(A)
            )
        assert run_store.renew_leases([("run-1", owner(A))], LEASE_S) == ["run-1"]
        # and a zombie A that wakes and beats again does not get it back
        assert run_store.renew_liveness(A, ALIVE_S) is False
        assert run_store.claim_lease("run-1", owner(A, "t2"), LEASE_S) == Claim(
            False, owner(B), None
        )

    def test_an_owner_without_a_liveness_record_keeps_its_lease_until_it_expires(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # An owner id naming no process, and a process that never beat: nothing says they died.
        assert run_store.claim_lease("run-1", "worker-a", LEASE_S).taken
        assert run_store.claim_lease("run-2", owner(A), LEASE_S).taken
        clock.advance(LEASE_MS - 1)
        assert run_store.claim_lease("run-1", owner(B), LEASE_S) == Claim(False, "worker-a", None)
        assert run_store.claim_lease("run-2", owner(B), LEASE_S) == Claim(False, owner(A), None)
        assert run_store.orphaned() == []
        clock.advance(1)
        assert run_store.claim_lease("run-1", owner(B), LEASE_S) == Claim(True)
        assert run_store.claim_lease("run-2", owner(B), LEASE_S) == Claim(True)

    def test_two_claims_on_a_dead_owners_run_take_it_once(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        run_store.renew_liveness(A, ALIVE_S)
        assert run_store.claim_lease("run-1", owner(A), LEASE_S).taken
        clock.advance(ALIVE_MS)

        claims = race(*(lambda i=i: run_store.claim_lease("run-1", owner(B, f"t{i}"), LEASE_S)
                        for i in range(4)))  # fmt: skip

        taken = [c for c in claims if isinstance(c, Claim) and c.taken]
        assert len(taken) == 1 and taken[0].took_from == owner(A), claims
        assert all(isinstance(c, Claim) for c in claims), claims

    def test_orphaned_lists_only_unexpired_leases_of_dead_processes(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # Given A (about to die) holding three runs, one released and one expired by then,
        # and B (alive) holding one, and an old-style owner holding one
        run_store.renew_liveness(A, ALIVE_S)
        run_store.renew_liveness(B, ALIVE_S)
        for run_id in ("a-1", "a-2", "a-released"):
            assert run_store.claim_lease(run_id, owner(A, run_id), LEASE_S).taken
        assert run_store.claim_lease("a-expiring", owner(A, "x"), ALIVE_S / 2).taken
        run_store.release_lease("a-released", owner(A, "a-released"))
        assert run_store.claim_lease("b-1", owner(B), LEASE_S).taken
        assert run_store.claim_lease("old", "worker-a", LEASE_S).taken

        # When A stops beating and B goes on
        clock.advance(ALIVE_MS)
        run_store.renew_liveness(B, ALIVE_S)

        # Then exactly A's unexpired leases are orphaned, and respect the limit
        assert sorted(run_store.orphaned()) == [Orphan("a-1", owner(A, "a-1")),
                                                Orphan("a-2", owner(A, "a-2"))]  # fmt: skip
        assert len(run_store.orphaned(limit=1)) == 1
        with pytest.raises(ValueError):
            run_store.orphaned(limit=0)

    def test_a_lease_taken_with_its_record_in_one_call_is_found_once_its_process_dies(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # A turn's fast path (acquire_and_get) indexes the lease under its owner's process
        # as claim_lease does: else the sweeper would find the run only once the lease expired.
        run_store.renew_liveness(A, ALIVE_S)
        run_store.renew_liveness(B, ALIVE_S)
        assert run_store.acquire_and_get("run-1", owner(A), LEASE_S)[0]
        assert run_store.acquire_lease("run-2", owner(A, "t2"), LEASE_S)
        clock.advance(ALIVE_MS)
        run_store.renew_liveness(B, ALIVE_S)

        assert sorted(run_store.orphaned()) == [Orphan("run-1", owner(A)),
                                                Orphan("run-2", owner(A, "t2"))]  # fmt: skip
        assert run_store.claim_lease("run-1", owner(B), LEASE_S).took_from == owner(A)

    def test_a_dead_process_is_forgotten_once_its_runs_are_taken_over(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        run_store.renew_liveness(A, ALIVE_S)
        run_store.renew_liveness(B, ALIVE_S)
        assert run_store.claim_lease("run-1", owner(A), LEASE_S).taken
        clock.advance(ALIVE_MS)
        run_store.renew_liveness(B, ALIVE_S)
        assert run_store.orphaned() == [Orphan("run-1", owner(A))]
        assert run_store.liveness(A) is not None

        assert run_store.claim_lease("run-1", owner(B), LEASE_S).took_from == owner(A)

        assert run_store.orphaned() == []
        assert run_store.liveness(A) is None  # nothing refers to it any more
        assert run_store.liveness(B) == clock() + ALIVE_MS

    def test_the_sweep_cost_does_not_grow_with_runs_held_by_live_processes(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        # A contract on results, with a hint of cost: 2,000 leases of a live process and
        # 2,000 finished runs do not make the one dead process's run harder to find.
        run_store.renew_liveness(A, ALIVE_S)
        run_store.renew_liveness(B, ALIVE_S)
        for i in range(2000):
            assert run_store.claim_lease(f"b-{i:04d}", owner(B, str(i)), LEASE_S).taken
        assert run_store.claim_lease("a-1", owner(A), LEASE_S).taken
        clock.advance(ALIVE_MS)
        run_store.renew_liveness(B, ALIVE_S)
        assert run_store.orphaned(limit=5) == [Orphan("a-1", owner(A))]

    # --- postponing a due run (the sweeper, after it enqueued a resume) ----------

    def test_postponing_moves_an_overdue_run_out_of_the_overdue_list_until_then(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        new_run(run_store, "run-1", due_at_ms=T0_MS + 10)
        new_run(run_store, "run-2", due_at_ms=T0_MS + 20)
        clock.advance(100)
        assert sorted(run_store.overdue()) == ["run-1", "run-2"]

        assert run_store.postpone("run-1", 1, clock() + LEASE_MS) is True

        assert run_store.overdue() == ["run-2"]
        clock.advance(LEASE_MS)
        assert sorted(run_store.overdue()) == ["run-1", "run-2"]

    def test_postponing_a_run_that_moved_on_or_is_not_due_changes_nothing(
        self, run_store: RunStore, clock: FakeClock
    ) -> None:
        new_run(run_store, "moved", due_at_ms=T0_MS + 10)
        run_store.append(
            record("moved", last_seq=2, status=RunStatus.MODEL, due_at_ms=T0_MS + 10),
            [event(2)],
            owner=None,
        )
        new_run(run_store, "asking", due_at_ms=None, status=RunStatus.NEEDS_USER_INPUT)
        clock.advance(100)

        assert run_store.postpone("moved", 1, clock() + LEASE_MS) is False
        assert run_store.postpone("asking", 1, clock() + LEASE_MS) is False
        assert run_store.postpone("unknown", 1, clock() + LEASE_MS) is False
        assert run_store.overdue() == ["moved"]
