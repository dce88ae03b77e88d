"""The heartbeat thread: a thousand leases renewed in batches, on time, its lateness measured.

Real Redis run store; the leases are renewed by a real heartbeat thread (a fresh
one per test, so the session worker's turns are not mixed in).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

from store.runs.redis import RedisRunStore
from store.snapshots.memory import MemorySnapshotStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.threads import _Heartbeats


class CountingRunStore(RedisRunStore):
    """Counts the batch renewals the heartbeat makes (a subclass: the store itself is real)."""

    batches: list[int]

    def renew_leases(self, leases: Sequence[tuple[str, str]], lease_s: float) -> list[str]:
        self.batches.append(len(leases))
        return super().renew_leases(leases, lease_s)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def context(redis_url: str, lease_s: float) -> tuple[Context, CountingRunStore]:
    runs = CountingRunStore.from_url(redis_url)
    assert isinstance(runs, CountingRunStore)
    runs.batches = []
    return Context(Settings(lease_s=lease_s), MemorySnapshotStore(), runs), runs


@pytest.mark.timeout(120)
def test_a_thousand_leases_are_renewed_in_one_call_a_round_and_none_expires(
    redis_url: str,
) -> None:
    # Given 1,000 turns in flight, each holding a 3 s lease
    ctx, runs = context(redis_url, lease_s=3.0)
    held = [(f"run-{i:04d}", f"worker:{i % 5}:x") for i in range(1000)]
    for run_id, owner in held:
        assert runs.acquire_lease(run_id, owner, 3.0)
    beats = _Heartbeats()
    for run_id, owner in held:
        beats.add(ctx, run_id, owner)
    try:
        # When they last through several lease lengths
        started = time.monotonic()
        wait_until(lambda: time.monotonic() - started > 7.5, 30, "7.5 s of heartbeats")
        # Then every lease is still held by its turn, never expired,
        now_ms = runs.clock()
        for run_id, owner in held[::50] + held[-1:]:
            lease = runs.lease(run_id)
            assert lease is not None and lease.owner == owner and lease.expires_at_ms > now_ms
        assert beats.stats.lost == 0 and beats.stats.failed == 0
        # renewed in whole batches of 1,000 (one renew_leases call a round),
        assert runs.batches and set(runs.batches) == {1000}, runs.batches
        assert beats.stats.largest_batch == 1000
        assert beats.stats.renewed >= 2000
        # and the thread measured how late it ran
        assert beats.stats.rounds >= len(runs.batches)
        assert 0 <= beats.stats.max_late_s < 3.0 / 2
    finally:
        for key in held:
            beats.remove(key)
        runs.close()


@pytest.mark.timeout(120)
def test_a_heartbeat_kept_busy_records_its_lateness_and_keeps_the_lease(redis_url: str) -> None:
    # Given one turn holding a 12 s lease (a round every 2 s renews leases 4 s old)
    ctx, runs = context(redis_url, lease_s=12.0)
    assert runs.acquire_lease("run-busy", "worker:1:x", 12.0)
    beats = _Heartbeats()
    beats.add(ctx, "run-busy", "worker:1:x")
    try:
        wait_until(lambda: beats.stats.rounds >= 1, 30, "a first round")
        # When the process keeps the heartbeat from running for 4 s (it needs its lock)
        with beats._changed:
            time.sleep(4.0)
        # Then a round says it ran late (rounds are due every 2 s: one fell in the 4 s),
        wait_until(lambda: beats.stats.max_late_s >= 1.5, 30, "a round that ran late")
        # and the lease, renewed by it, was not lost
        wait_until(lambda: runs.batches != [], 30, "a renewal")
        assert beats.stats.lost == 0
        lease = runs.lease("run-busy")
        assert lease is not None and lease.owner == "worker:1:x"
    finally:
        beats.remove(("run-busy", "worker:1:x"))
        runs.close()


@pytest.mark.timeout(60)
def test_a_lease_the_turn_released_is_not_renewed_behind_its_back(redis_url: str) -> None:
    # Given a turn whose lease is due for renewal
    ctx, runs = context(redis_url, lease_s=1.2)
    assert runs.acquire_lease("run-done", "worker:1:x", 1.2)
    beats = _Heartbeats()
    key = beats.add(ctx, "run-done", "worker:1:x")
    wait_until(lambda: runs.batches != [], 30, "a renewal")
    # When the turn ends and releases its lease (the heartbeat may be mid-round)
    beats.remove(key)
    runs.release_lease("run-done", "worker:1:x")
    # Then the next turn takes the run at once, and no later round takes it back
    assert runs.acquire_lease("run-done", "worker:2:y", 1.2)
    rounds = beats.stats.rounds
    beats.add(ctx, "run-other", "worker:3:z")  # keeps the heartbeat going
    wait_until(lambda: beats.stats.rounds >= rounds + 2, 30, "two more rounds")
    lease = runs.lease("run-done")
    assert lease is None or lease.owner == "worker:2:y"
    beats.remove(("run-other", "worker:3:z"))
    runs.close()
