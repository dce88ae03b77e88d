"""The heartbeat thread: a thousand leases renewed in batches, on time, its lateness measured.

Real Redis run store; the leases are renewed by a real heartbeat thread (a fresh
one per test, so the session worker's turns are not mixed in).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from runtime.models import Event, RunStatus
from store.runs.redis import RedisRunStore
from store.snapshots.memory import MemorySnapshotStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.context import Context
from tasks.observers import Observer, Observers
from tasks.settings import Settings
from tasks.start import create_run
from tasks.threads import _Heartbeats, heartbeats
from tests.helpers import call, drive, turn, write_agent


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


class RenewalsSeen(RedisRunStore):
    """Notes every run a heartbeat round asks to renew (a subclass: the store is real)."""

    renewing: list[str]

    def renew_leases(self, leases: Sequence[tuple[str, str]], lease_s: float) -> list[str]:
        self.renewing.extend(run_id for run_id, _ in leases)
        return super().renew_leases(leases, lease_s)


@pytest.mark.timeout(60)
def test_a_lease_the_turn_let_go_with_its_last_checkpoint_is_not_counted_lost(
    redis_url: str, tmp_path: Path, ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a run whose turns hold a 0.6 s lease (a heartbeat round every 0.1 s), and
    # whose checkpoints that let the lease go are held, before the turn tells its heartbeat
    # it is done, until a round has asked to renew that lease and has ended
    runs = RenewalsSeen.from_url(redis_url)
    assert isinstance(runs, RenewalsSeen)
    renewing: list[str] = []
    runs.renewing = renewing
    ctx = Context(Settings(lease_s=0.6), RedisSnapshotStore.from_url(redis_url), runs)
    assert runs.commits_with(ctx.snapshots)
    agent = write_agent(tmp_path, [turn("look", call("lookup_order", order_id="A1")), turn("ok")])
    run_id = create_run(ctx, agent, "look A1").run_id
    released, lost = 0, heartbeats().stats.lost

    class RoundAfterRelease(Observer):
        def committed(
            self, before: RunStatus, after: RunStatus, events: Sequence[Event], state: object
        ) -> None:
            nonlocal released
            if runs.lease(run_id) is None:
                released += 1
                renewing.clear()
                wait_until(lambda: run_id in renewing, 30, "a round after the release")
                # (and until that round has dealt with what the store answered: a round
                # that counts it lost forgets the lease, and no round follows it)
                beats, rounds = heartbeats().stats, heartbeats().stats.rounds
                wait_until(lambda: beats.rounds > rounds or beats.lost > lost, 30, "its end")

    ctx.observers = Observers([RoundAfterRelease()])
    # When the run is driven to its end
    with caplog.at_level(logging.WARNING, logger="tasks"):
        assert drive(ctx, run_id).outcome == "completed"
    # Then both of its turns' leases were let go under a round's feet (the tool turn's
    # release and the finished run's), and neither was counted or logged as lost
    assert released == 2
    assert heartbeats().stats.lost == lost
    assert "lease lost" not in caplog.text
    runs.close()
