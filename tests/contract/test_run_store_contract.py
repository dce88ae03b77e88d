"""The RunStore contract, run on every backend (memory, sqlite, redis).

Time is the injected ``clock`` (see conftest): leases expire when a test moves
it, never because the machine was slow. The last section holds what only the
Redis backend can show.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from runtime.errors import InvalidRunId, LeaseLost, StaleWrite, StoreUnavailable
from runtime.models import Event, RunStatus, Usage
from store.runs import JournalEntry, Lease, RunRecord, RunStore
from store.runs.redis import LEASE_TTL_GRACE_MS, RedisRunStore
from tests.contract.conftest import T0_MS, FakeClock, race
from tests.redis_server import RedisServer

# Workaround, not a wish: store/retry.py passes tenacity's deprecated `initial=`,
# and pytest turns the warning into an error on every store call. Remove this
# line when retry.py uses `multiplier=`.

LEASE_S = 30
LEASE_MS = LEASE_S * 1000


def record(
    run_id: str,
    last_seq: int = 1,
    status: RunStatus = RunStatus.QUEUED,
    created_at_ms: int = T0_MS,
    due_at_ms: int | None = None,
    **fields: Any,
) -> RunRecord:
    return RunRecord(
        run_id=run_id,
        agent="echo",
        agent_file="agents/echo.toml",
        status=status,
        created_at_ms=created_at_ms,
        updated_at_ms=created_at_ms,
        last_seq=last_seq,
        input="say hello",
        due_at_ms=due_at_ms,
        **fields,
    )


def created(run_id: str, at_ms: int = T0_MS) -> Event:
    return Event(seq=1, type="run.created", at_ms=at_ms, data={"run_id": run_id, "input": "hi"})


def event(seq: int, type_: str = "model.requested", **data: Any) -> Event:
    return Event(seq=seq, type=type_, at_ms=T0_MS + seq, data=data)


def new_run(
    store: RunStore,
    run_id: str,
    created_at_ms: int = T0_MS,
    due_at_ms: int | None = T0_MS + 60_000,
    status: RunStatus = RunStatus.QUEUED,
) -> RunRecord:
    first = record(run_id, status=status, created_at_ms=created_at_ms, due_at_ms=due_at_ms)
    store.create(first, created(run_id, created_at_ms))
    return first


def unchanged(store: RunStore, run_id: str) -> tuple[RunRecord | None, list[Event]]:
    return store.get(run_id), store.events(run_id)


# --- records and events -------------------------------------------------------


def test_a_created_run_reads_back_with_its_first_event(run_store: RunStore) -> None:
    first = record(
        "run-1",
        usage=Usage(model_attempts=1, total_tokens=9),
        budgets={"max_turns": 3, "timeout_seconds": 60},
        due_at_ms=T0_MS + 5,
    )

    run_store.create(first, created("run-1"))

    assert run_store.get("run-1") == first
    assert run_store.events("run-1") == [created("run-1")]


def test_an_unknown_run_has_no_record_and_no_events(run_store: RunStore) -> None:
    new_run(run_store, "run-1")

    assert run_store.get("run-2") is None
    assert run_store.events("run-2") == []
    assert run_store.journal("run-2") == []


def test_creating_a_run_twice_is_a_stale_write_and_keeps_the_first(run_store: RunStore) -> None:
    first = new_run(run_store, "run-1")
    run_store.append(record("run-1", last_seq=2), [event(2)], owner=None)
    before = unchanged(run_store, "run-1")

    with pytest.raises(StaleWrite) as refused:
        run_store.create(record("run-1", created_at_ms=T0_MS + 1), created("run-1", T0_MS + 1))

    assert refused.value.found_seq == 2
    assert unchanged(run_store, "run-1") == before
    assert run_store.list() == [record("run-1", last_seq=2)]
    assert first.created_at_ms == T0_MS


def test_appended_events_follow_in_seq_order_and_replace_the_record(run_store: RunStore) -> None:
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


@pytest.mark.parametrize("first_seq", [1, 3, 5, 9], ids=lambda s: f"first-seq-{s}")
def test_an_append_that_does_not_follow_the_last_seq_is_stale_and_writes_nothing(
    run_store: RunStore, first_seq: int
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
    run_store: RunStore,
) -> None:
    new_run(run_store, "run-1")
    before = unchanged(run_store, "run-1")

    with pytest.raises(ValueError, match="events must be contiguous: 2 then 4"):
        run_store.append(record("run-1", last_seq=4), [event(2), event(4)], owner=None)
    with pytest.raises(ValueError, match="events must be contiguous: 3 then 3"):
        run_store.append(record("run-1", last_seq=3), [event(2), event(3), event(3)], owner=None)

    assert unchanged(run_store, "run-1") == before
    # The store still takes the next seq: nothing was half-written
    run_store.append(record("run-1", last_seq=2), [event(2)], owner=None)
    assert [e.seq for e in run_store.events("run-1")] == [1, 2]


@pytest.mark.parametrize("last_seq", [2, 4], ids=["behind", "ahead"])
def test_a_record_whose_last_seq_is_not_its_last_events_is_refused_and_writes_nothing(
    run_store: RunStore, last_seq: int
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
    run_store: RunStore,
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
    run_store: RunStore, theirs: list[Event]
) -> None:
    new_run(run_store, "run-1")
    mine = [event(2, worker="a"), event(3, "model.responded", worker="a")]
    run_store.append(record("run-1", last_seq=3), mine, owner=None)

    with pytest.raises(StaleWrite) as refused:
        run_store.append(record("run-1", last_seq=3), theirs, owner=None)

    assert (refused.value.expected_seq, refused.value.found_seq) == (1, 3)
    assert run_store.events("run-1") == [created("run-1"), *mine]


def test_a_batch_that_landed_before_the_log_moved_on_is_a_stale_write(
    run_store: RunStore,
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


def test_appending_to_an_unknown_run_is_a_stale_write(run_store: RunStore) -> None:
    with pytest.raises(StaleWrite) as refused:
        run_store.append(record("run-1", last_seq=2), [event(2)], owner=None)

    assert refused.value.found_seq is None
    assert unchanged(run_store, "run-1") == (None, [])
    assert run_store.list() == []


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


@pytest.mark.parametrize(
    "lose_lease",
    [_no_lease, _another_owners_lease, _expired_own_lease, _released_own_lease, _taken_over_lease],
    ids=lambda f: f.__name__.strip("_").replace("_", "-"),
)
def test_an_append_by_a_worker_without_the_lease_is_refused_and_writes_nothing(
    run_store: RunStore, clock: FakeClock, lose_lease: Any
) -> None:
    new_run(run_store, "run-1", due_at_ms=T0_MS + 10)
    lose_lease(run_store, clock)
    before = unchanged(run_store, "run-1")

    with pytest.raises(LeaseLost) as refused:
        run_store.append(
            record("run-1", last_seq=2, status=RunStatus.COMPLETED), [event(2)], owner="worker-a"
        )

    assert "run run-1" in str(refused.value) and "worker worker-a" in str(refused.value)
    assert unchanged(run_store, "run-1") == before
    assert run_store.list(RunStatus.COMPLETED) == []


def test_an_append_by_the_lease_holder_is_written(run_store: RunStore, clock: FakeClock) -> None:
    new_run(run_store, "run-1")
    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
    clock.advance(LEASE_MS - 1)

    run_store.append(record("run-1", last_seq=2), [event(2)], owner="worker-a")

    assert [e.seq for e in run_store.events("run-1")] == [1, 2]


def test_an_append_without_an_owner_is_not_fenced_by_the_lease(run_store: RunStore) -> None:
    # An operator's cancel does not hold the worker's lease; only the seq fences it.
    new_run(run_store, "run-1")
    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)

    cancelled = record("run-1", last_seq=2, status=RunStatus.CANCELLED)
    run_store.append(cancelled, [event(2, "run.cancelled")], owner=None)

    assert run_store.get("run-1") == cancelled


def test_events_after_a_seq_come_in_order_up_to_the_limit(run_store: RunStore) -> None:
    new_run(run_store, "run-1")
    more = [
        event(s, "tool.completed", call_id=f"c{s}", result={"n": [s, None]}) for s in (2, 3, 4, 5)
    ]
    run_store.append(record("run-1", last_seq=5), more, owner=None)

    assert run_store.events("run-1", after_seq=2) == more[1:]
    assert run_store.events("run-1", after_seq=2, limit=2) == more[1:3]
    assert run_store.events("run-1", after_seq=0, limit=1) == [created("run-1")]
    assert run_store.events("run-1", after_seq=5) == []
    assert run_store.events("run-1", after_seq=9) == []


def test_runs_are_listed_newest_first(run_store: RunStore) -> None:
    for run_id, created_at_ms in [("b", T0_MS + 2), ("c", T0_MS + 1), ("a", T0_MS + 3)]:
        new_run(run_store, run_id, created_at_ms=created_at_ms)

    assert [r.run_id for r in run_store.list()] == ["a", "b", "c"]
    assert [r.run_id for r in run_store.list(limit=2)] == ["a", "b"]


def test_runs_created_in_the_same_millisecond_list_by_id_descending(run_store: RunStore) -> None:
    for run_id in ("run-b", "run-c", "run-a"):
        new_run(run_store, run_id)

    assert [r.run_id for r in run_store.list()] == ["run-c", "run-b", "run-a"]


def test_listing_by_status_follows_each_runs_latest_record(run_store: RunStore) -> None:
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


def test_the_journal_follows_each_tool_call_from_request_to_outcome(run_store: RunStore) -> None:
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


def test_a_lease_is_exclusive_until_it_expires(run_store: RunStore, clock: FakeClock) -> None:
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


def test_the_holder_renews_its_lease(run_store: RunStore, clock: FakeClock) -> None:
    new_run(run_store, "run-1")
    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
    clock.advance(LEASE_MS - 1000)

    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)

    clock.advance(LEASE_MS - 1000)
    assert not run_store.acquire_lease("run-1", "worker-b", LEASE_S)
    assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=clock() + 1000)


def test_only_the_owner_releases_a_lease(run_store: RunStore) -> None:
    new_run(run_store, "run-1")
    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)

    run_store.release_lease("run-1", "worker-b")
    assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=T0_MS + LEASE_MS)

    run_store.release_lease("run-1", "worker-a")
    assert run_store.lease("run-1") is None
    assert run_store.acquire_lease("run-1", "worker-b", LEASE_S)
    run_store.release_lease("run-2", "worker-b")


def test_leases_of_different_runs_are_independent(run_store: RunStore) -> None:
    new_run(run_store, "run-1")
    new_run(run_store, "run-2")

    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
    assert run_store.acquire_lease("run-2", "worker-b", LEASE_S)

    assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=T0_MS + LEASE_MS)
    assert run_store.lease("run-2") == Lease(owner="worker-b", expires_at_ms=T0_MS + LEASE_MS)
    assert run_store.lease("run-3") is None


def test_renewing_leases_in_one_batch_extends_those_held_and_names_those_taken(
    run_store: RunStore, clock: FakeClock
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
        assert run_store.lease(run_id) == Lease(owner="worker-a", expires_at_ms=clock() + LEASE_MS)
    assert run_store.lease("run-3") == Lease(
        owner="worker-b", expires_at_ms=clock() - LEASE_MS // 2 + LEASE_MS
    )


def test_renewing_a_thousand_leases_renews_every_one(run_store: RunStore, clock: FakeClock) -> None:
    held = [(f"run-{i:04d}", f"worker-{i % 7}") for i in range(1500)]
    for run_id, owner in held:
        assert run_store.acquire_lease(run_id, owner, LEASE_S)
    clock.advance(LEASE_MS - 1)

    assert run_store.renew_leases(held, LEASE_S) == []

    clock.advance(LEASE_MS - 1)
    for run_id, owner in held[::97] + held[-1:]:
        assert run_store.lease(run_id) == Lease(owner=owner, expires_at_ms=clock() + 1)


def test_a_renewal_never_takes_back_a_released_lease(run_store: RunStore, clock: FakeClock) -> None:
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
    run_store: RunStore, clock: FakeClock
) -> None:
    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
    clock.advance(LEASE_MS)
    assert run_store.acquire_lease("run-1", "worker-b", LEASE_S)
    run_store.release_lease("run-1", "worker-b")

    assert run_store.renew_leases([("run-1", "worker-a")], LEASE_S) == ["run-1"]
    assert run_store.lease("run-1") is None


def test_renewing_no_leases_renews_nothing(run_store: RunStore) -> None:
    assert run_store.renew_leases([], LEASE_S) == []


def test_a_batch_with_an_invalid_run_id_renews_nothing(
    run_store: RunStore, clock: FakeClock
) -> None:
    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)
    clock.advance(LEASE_MS // 2)

    with pytest.raises(InvalidRunId):
        run_store.renew_leases([("run-1", "worker-a"), ("../etc", "worker-a")], LEASE_S)

    assert run_store.lease("run-1") == Lease(owner="worker-a", expires_at_ms=T0_MS + LEASE_MS)


# --- overdue runs -------------------------------------------------------------


def test_overdue_lists_live_runs_past_due_without_a_live_lease_most_overdue_first(
    run_store: RunStore, clock: FakeClock
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
    run_store: RunStore, clock: FakeClock
) -> None:
    new_run(run_store, "run-1", due_at_ms=T0_MS + LEASE_MS)
    new_run(run_store, "run-2", due_at_ms=T0_MS + LEASE_MS + 1)
    assert run_store.acquire_lease("run-1", "worker-a", LEASE_S)

    clock.advance(LEASE_MS - 1)
    assert run_store.overdue() == []

    clock.advance(1)
    assert run_store.overdue() == ["run-1"]


def test_overdue_fills_its_limit_past_runs_with_a_live_lease(
    run_store: RunStore, clock: FakeClock
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
    run_store: RunStore, clock: FakeClock
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


def test_a_run_that_moved_on_a_little_is_overdue_at_its_new_due_time_not_before(
    run_store: RunStore, clock: FakeClock
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
    if isinstance(run_store, RedisRunStore):
        # Redis kept its due index where the first due time put it (the later ones were
        # within append.lua's DUE_SLACK of it): one ZADD, not one for every transition.
        assert run_store._client.zscore(run_store._due, "run-1") == T0_MS + 1000


# --- retention ----------------------------------------------------------------


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


def test_purge_deletes_only_finished_runs_older_than_the_cutoff_and_counts_them(
    run_store: RunStore, clock: FakeClock
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
    run_store: RunStore,
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


def test_a_dead_lettered_run_that_is_resumed_is_no_longer_purged(run_store: RunStore) -> None:
    new_run(run_store, "revived")
    move_to(run_store, "revived", RunStatus.DEAD_LETTERED, T0_MS + 100)
    move_to(run_store, "revived", RunStatus.MODEL, T0_MS + 200, seq=3, due=T0_MS + 300)

    assert run_store.purge(T0_MS + 10_000) == 0
    assert run_store.get("revived") is not None and len(run_store.events("revived")) == 3


def test_a_purged_run_id_can_be_used_again(run_store: RunStore) -> None:
    new_run(run_store, "again")
    move_to(run_store, "again", RunStatus.FAILED, T0_MS + 100)
    assert run_store.purge(T0_MS + 10_000) == 1

    new_run(run_store, "again")

    assert run_store.events("again") == [created("again")]
    assert run_store.purge(T0_MS + 10_000) == 0


@pytest.mark.parametrize(("before_ms", "limit"), [(-1, 10), (10, 0), (1.5, 10), (True, 10)])
def test_purge_refuses_a_bad_cutoff_or_limit(
    run_store: RunStore, before_ms: Any, limit: int
) -> None:
    with pytest.raises(ValueError):
        run_store.purge(before_ms, limit)


# --- concurrency --------------------------------------------------------------


def test_two_workers_appending_the_same_seq_let_exactly_one_win(run_store: RunStore) -> None:
    for round_ in range(10):
        run_id = f"race-{round_}"
        new_run(run_store, run_id)

        def append(worker: str, run_id: str = run_id) -> str:
            latest = record(run_id, last_seq=2, status=RunStatus.MODEL)
            run_store.append(latest, [event(2, worker=worker)], owner=None)
            return worker

        outcomes = race(lambda: append("w1"), lambda: append("w2"))

        winners = [o for o in outcomes if isinstance(o, str)]
        assert len(winners) == 1, outcomes
        assert [type(o) for o in outcomes if not isinstance(o, str)] == [StaleWrite]
        assert run_store.events(run_id, after_seq=1) == [event(2, worker=winners[0])]


def test_two_workers_taking_the_same_lease_let_exactly_one_hold_it(run_store: RunStore) -> None:
    for round_ in range(10):
        run_id = f"race-{round_}"
        new_run(run_store, run_id)

        def acquire(worker: str, run_id: str = run_id) -> bool:
            return run_store.acquire_lease(run_id, worker, LEASE_S)

        taken = race(lambda: acquire("w1"), lambda: acquire("w2"))

        assert sorted(taken, key=repr) == [False, True]
        lease = run_store.lease(run_id)
        assert lease is not None and lease.owner == ("w1" if taken[0] is True else "w2")


# --- redis only ---------------------------------------------------------------


@pytest.fixture
def redis_run_store(redis_url: str, clock: FakeClock) -> Any:
    store = RedisRunStore.from_url(redis_url, clock=clock)
    client = redis.Redis.from_url(redis_url)
    yield store, client
    client.close()
    store.close()


def test_every_key_of_a_run_shares_one_cluster_slot_with_its_snapshot(
    redis_run_store: tuple[RedisRunStore, redis.Redis],
) -> None:
    from redis.crc import key_slot

    from store.snapshots.redis import RedisSnapshotStore

    store, client = redis_run_store
    new_run(store, "run-1")
    store.append(record("run-1", last_seq=2), [event(2)], owner=None)
    assert store.acquire_lease("run-1", "worker-a", LEASE_S)
    snapshot_key = RedisSnapshotStore(client)._key("run-1")

    keys = cast("list[bytes]", client.keys("*"))
    run_keys = [k for k in keys if b"run-1" in k and b":runs:" not in k]

    assert len(run_keys) == 3
    assert {key_slot(k) for k in run_keys} == {key_slot(snapshot_key.encode())}


def test_a_lease_key_expires_in_redis_a_grace_period_after_its_lease(
    redis_run_store: tuple[RedisRunStore, redis.Redis],
) -> None:
    store, client = redis_run_store
    new_run(store, "run-1")

    assert store.acquire_lease("run-1", "worker-a", LEASE_S)

    lease_keys = [k for k in cast("list[bytes]", client.keys("*")) if k.endswith(b":lease")]
    assert len(lease_keys) == 1
    ttl_ms = client.pttl(lease_keys[0])
    assert LEASE_MS < ttl_ms <= LEASE_MS + LEASE_TTL_GRACE_MS


def test_overdue_pages_past_many_runs_with_a_live_lease(
    redis_run_store: tuple[RedisRunStore, redis.Redis],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("store.runs.redis.OVERDUE_BATCH", 2)
    store, _ = redis_run_store
    for i in range(7):
        new_run(store, f"busy-{i}", due_at_ms=T0_MS + i)
        assert store.acquire_lease(f"busy-{i}", "worker-a", LEASE_S)
    for i in range(3):
        new_run(store, f"free-{i}", due_at_ms=T0_MS + 10 + i)
    clock.advance(100)

    assert store.overdue(limit=2) == ["free-0", "free-1"]
    assert store.overdue() == ["free-0", "free-1", "free-2"]


def test_an_append_to_a_dead_redis_raises_store_unavailable_and_works_after_restart(
    redis_server: RedisServer, redis_url: str, clock: FakeClock
) -> None:
    store = RedisRunStore.from_url(redis_url, clock=clock)
    try:
        new_run(store, "run-1")
        redis_server.kill()

        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as refused:
            store.append(record("run-1", last_seq=2), [event(2)], owner=None)

        assert time.monotonic() - started < 10
        assert f"run store {redis_url} is unavailable" in str(refused.value)
        # The server comes back empty (nothing is persisted in tests); the store reconnects.
        redis_server.restart()
        new_run(store, "run-1")
        assert store.events("run-1") == [created("run-1")]
    finally:
        store.close()


# --- sqlite only --------------------------------------------------------------


def test_a_sqlite_database_made_before_retention_gets_its_finished_runs_indexed(
    tmp_path: Path, clock: FakeClock
) -> None:
    from store.runs.sqlite import SqliteRunStore

    # Given a database written by a version without the finished_at_ms column
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.executescript(
            "CREATE TABLE runs (run_id TEXT PRIMARY KEY, status TEXT NOT NULL, "
            "last_seq INTEGER NOT NULL, created_at_ms INTEGER NOT NULL, due_at_ms INTEGER, "
            "record TEXT NOT NULL);"
        )
        for run_id, status in (("old-done", RunStatus.COMPLETED), ("old-live", RunStatus.MODEL)):
            row = record(run_id, status=status)
            conn.execute(
                "INSERT INTO runs VALUES (?, ?, 1, ?, NULL, ?)",
                (run_id, status.value, T0_MS, row.model_dump_json()),
            )
    conn.close()
    # When the store opens it, its finished run is purged like any other
    store = SqliteRunStore(path, clock=clock)
    try:
        assert store.purge(T0_MS + 1) == 1
        assert [r.run_id for r in store.list()] == ["old-live"]
    finally:
        store.close()


WRITER = """
import json, sys, time
from pathlib import Path
from runtime.errors import StaleWrite
from runtime.models import Event
from store import retry
from store.runs.sqlite import SqliteRunStore

# No retries: a writer waits for the write lock (BEGIN IMMEDIATE and busy_timeout); a
# transaction that read first and found the lock taken would fail instead.
retry.ATTEMPTS = 1
path, name, target, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
store = SqliteRunStore(path)
while not go.exists():
    time.sleep(0.001)
won = stale = 0
while True:
    current = store.get("run-1")
    if current.last_seq >= target:
        break
    seq = current.last_seq + 1
    mine = current.model_copy(update={"last_seq": seq})
    try:
        store.append(mine, [Event(seq=seq, type="model.requested", at_ms=seq, data={"by": name})],
                     owner=None)
        won += 1
    except StaleWrite:
        stale += 1
print(json.dumps({"won": won, "stale": stale}))
"""


@pytest.mark.timeout(120)
def test_sqlite_writers_in_separate_processes_racing_on_one_file_each_seq_goes_to_exactly_one(
    tmp_path: Path, clock: FakeClock
) -> None:
    from store.runs.sqlite import SqliteRunStore

    # Given one database file and four worker processes with their own connections
    path, go, target = tmp_path / "runs.sqlite3", tmp_path / "go", 120
    store = SqliteRunStore(path, clock=clock)
    new_run(store, "run-1")
    root = Path(__file__).resolve().parents[2]
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), f"w{i}", str(target), str(go)],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    # When they all append the next seq as fast as they can
    go.touch()
    results = [w.communicate(timeout=100) for w in writers]

    # Then none saw the store fail, each seq was won by exactly one, and the log is whole
    for writer, (_, err) in zip(writers, results, strict=True):
        assert writer.returncode == 0, err[-2000:]
    tallies = [json.loads(out) for out, _ in results]
    assert sum(t["won"] for t in tallies) == target - 1
    events = store.events("run-1")
    assert [e.seq for e in events] == list(range(1, target + 1))
    assert {e.data["by"] for e in events[1:]} <= {f"w{i}" for i in range(4)}
    latest = store.get("run-1")
    assert latest is not None and latest.last_seq == target
    store.close()
