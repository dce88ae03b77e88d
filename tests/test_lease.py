"""One way to hold a run's lease (tasks/lease.py): every path takes a dead holder's lease
over, and a refusal says what really happened.

The dead holder is a real process killed with SIGKILL where it matters (the
operator's continue); elsewhere a process that beat once and stopped, as in
tests/test_liveness.py. The stores are the real memory and Redis backends.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.continuation import make_continuation
from runtime.errors import (
    HolderDied,
    LeaseHeld,
    RunBusy,
    RunMoving,
)
from runtime.models import Event, RunStatus
from store.runs import RunRecord
from store.runs.memory import MemoryRunStore
from store.snapshots.memory import MemorySnapshotStore
from tasks import lease
from tasks.context import Context
from tasks.control import apply_continuation, cancel, expire_suspended
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, drive, memory_context, turn, write_agent
from tests.test_liveness import dead_owner
from tests.workers import ROOT, redis_context

ASK = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]
SHORT = {"liveness_s": 0.4, "heartbeat_interval_s": 0.1, "lease_s": 30.0}

HOLDER = """
import sys, time
from tasks.persistence import new_owner
from tasks.liveness import claim
from tests.workers import redis_context

ctx = redis_context(sys.argv[1], lease_s=30, liveness_s=0.4, heartbeat_interval_s=0.1)
owner = new_owner()
assert claim(ctx, sys.argv[2], owner).taken
print(owner, flush=True)
time.sleep(600)
"""
"""A worker process that takes a run's lease (beating its liveness) and is then SIGKILLed."""


def suspended_run(ctx: Context, tmp_path: Path, extra: str = "") -> str:
    run_id = create_run(ctx, write_agent(tmp_path, ASK, extra=extra), "refund my order").run_id
    assert drive(ctx, run_id).outcome == "suspended"
    return run_id


@pytest.fixture
def sigkilled_holder(redis_url: str) -> Iterator[Callable[[str], str]]:
    """Start a process that holds ``run_id``'s lease, SIGKILL it; the owner id it held."""
    started: list[subprocess.Popen[str]] = []

    def hold_then_die(run_id: str) -> str:
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, redis_url, run_id],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        started.append(process)
        assert process.stdout is not None
        owner = process.stdout.readline().strip()
        assert owner, "the holder process did not take the lease"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        return owner

    yield hold_then_die
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.timeout(120)
def test_an_operators_answer_to_a_run_whose_lease_holder_was_sigkilled_is_applied_at_once(
    redis_url: str, tmp_path: Path, sigkilled_holder: Callable[[str], str]
) -> None:
    # Given a suspended run whose lease (30 s) a worker took just before it was SIGKILLed
    ctx = redis_context(redis_url, **SHORT)
    try:
        run_id = suspended_run(ctx, tmp_path)
        owner = sigkilled_holder(run_id)
        held = ctx.runs.lease(run_id)
        assert held is not None and held.owner == owner

        # When an operator answers it
        chained: list[tuple[str, int]] = []
        continuation = make_continuation(run_id, "c1", input="Order B2")
        outcome = apply_continuation(ctx, continuation, enqueue=lambda r, s: chained.append((r, s)))

        # Then the answer is applied and the next turn chained as soon as the dead
        # worker's liveness lapsed, long before its lease would have expired
        assert outcome == "continued"
        continued = [e for e in ctx.runs.events(run_id) if e.type == "run.continued"]
        assert len(continued) == 1 and chained == [(run_id, continued[0].seq)]
        assert continued[0].at_ms < held.expires_at_ms
        assert ctx.runs.lease(run_id) is None  # and let go of
    finally:
        ctx.close()


@pytest.mark.timeout(60)
def test_the_expiry_sweep_expires_a_suspended_run_whose_holder_died(tmp_path: Path) -> None:
    # Given a suspended run past its max_suspended_s, whose lease a dead process holds
    ctx = memory_context(**SHORT)
    run_id = suspended_run(ctx, tmp_path, extra="max_suspended_s = 1")
    dead_owner(ctx, run_id)

    # When the expiry sweep looks at it two seconds from now, the lease not yet expired
    later = ctx.runs.clock() + 2000
    ctx.runs.clock = lambda: later
    expired = expire_suspended(ctx)

    # Then it takes the dead holder's lease and expires the run, instead of leaving it
    # to a later sweep that finds the lease expired
    assert expired == [run_id]
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.FAILED


@pytest.mark.timeout(60)
def test_a_control_path_that_takes_a_dead_holders_run_mid_turn_hands_it_to_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run whose worker died mid-turn (the run is live) holding its lease
    ctx = memory_context(**SHORT)
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund my order").run_id
    owner = dead_owner(ctx, run_id)
    resumes: list[tuple[str, int]] = []
    monkeypatch.setattr(lease, "urgent_sweeper_resume", lambda r, s: resumes.append((r, s)))
    before = ctx.runs.events(run_id)

    # When a control path (here a budget-style write under the lease) wants the lease
    with pytest.raises(HolderDied) as caught:
        with lease.holding(ctx, run_id, patience_s=5.0):
            raise AssertionError("a live run taken from a dead holder must be recovered first")

    # Then it does nothing to the run, lets the lease go, and enqueues a resume of it
    assert isinstance(caught.value, RunBusy)
    assert resumes == [(run_id, 1)]
    assert ctx.runs.lease(run_id) is None
    assert ctx.runs.events(run_id) == before
    message = str(caught.value)
    assert f"run {run_id} is busy" in message
    assert f"its lease holder {owner} died mid-turn (status queued)" in message
    assert "a resume enqueued" in message and "try again" in message
    assert str(copy.deepcopy(caught.value)) == message  # survives serialisation


@pytest.mark.timeout(60)
def test_a_lease_held_by_a_live_worker_is_refused_naming_the_holder_and_the_wait(
    tmp_path: Path,
) -> None:
    ctx = memory_context(**SHORT)
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund my order").run_id
    # Given a run held by a worker whose process keeps beating
    stop = threading.Event()

    def keep_beating() -> None:
        while not stop.is_set():
            ctx.runs.renew_liveness("busy-host:7:cafe", 0.4)
            time.sleep(0.05)

    beating = threading.Thread(target=keep_beating)
    beating.start()
    try:
        assert ctx.runs.claim_lease(run_id, "busy-host:7:cafe/t", 30).taken
        # When another path waits 0.2 s for the lease
        with pytest.raises(LeaseHeld) as caught:
            with lease.holding(ctx, run_id, patience_s=0.2):
                raise AssertionError("the lease is held")
    finally:
        stop.set()
        beating.join()
    # Then it is refused, saying who holds it, that it is alive, and how long it waited
    message = str(caught.value)
    assert message.startswith(f"run {run_id} is busy: worker busy-host:7:cafe/t held its lease")
    waited = re.search(r"through the ([0-9.]+)s this waited for it", message)
    assert waited is not None and float(waited[1]) >= 0.2, message  # (more on a busy box)
    assert "its process is alive, so it is advancing the run" in message
    assert "the lease expires in" in message
    assert f"`ratchet runs events {run_id} --follow`" in message
    assert caught.value.holder == "busy-host:7:cafe/t"
    assert str(copy.deepcopy(caught.value)) == message


def test_a_lease_whose_holder_keeps_no_liveness_record_says_only_its_expiry_ends_it(
    tmp_path: Path,
) -> None:
    ctx = memory_context(**SHORT)
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund my order").run_id
    assert ctx.runs.acquire_lease(run_id, "an-old-worker", 30)
    with pytest.raises(LeaseHeld) as caught:
        with lease.holding(ctx, run_id):
            raise AssertionError("the lease is held")
    message = str(caught.value)
    assert f"run {run_id} is busy: worker an-old-worker holds its lease (this did not" in message
    assert "keeps no liveness record, so only the lease's expiry ends it" in message


class Racing(MemoryRunStore):
    """A run store where another writer appends to the run just before each of our writes."""

    def __init__(self) -> None:
        super().__init__()
        self.racing = False

    def _append(
        self, record: RunRecord, events: list[Event], owner: str | None, now_ms: int
    ) -> None:
        if self.racing and events and events[0].type == "run.cancelled":
            tail = self._events(record.run_id, 0, None)[-1]
            other = Event(seq=tail.seq + 1, type="model.requested", at_ms=now_ms, data={})
            stored = self._get(record.run_id)
            assert stored is not None
            update = {"last_seq": other.seq}
            super()._append(stored.model_copy(update=update), [other], None, now_ms)
        super()._append(record, events, owner, now_ms)


def test_a_cancel_that_keeps_losing_seq_races_says_so(tmp_path: Path) -> None:
    # Given a run another writer appends to just before every write of ours
    runs = Racing()
    ctx = Context(Settings(liveness_s=0.4, heartbeat_interval_s=0.1), MemorySnapshotStore(), runs)
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund my order").run_id
    runs.racing = True
    # When an operator cancels it
    with pytest.raises(RunMoving) as caught:
        cancel(ctx, run_id, "stop")
    # Then the refusal says the run kept moving (not that a lease was held), and what to do
    message = str(caught.value)
    assert message.startswith(f"run {run_id} is busy: this write lost 5 seq races in a row")
    assert "held its lease" not in message
    assert "try again in a moment" in message
    assert isinstance(caught.value, RunBusy) and caught.value.races == 5
    assert str(copy.deepcopy(caught.value)) == message
    # and the races were real: five other writes landed, and no cancel
    types = [e.type for e in runs.events(run_id)]
    assert types.count("model.requested") == 5 and "run.cancelled" not in types


@pytest.mark.timeout(60)
def test_a_redelivered_turn_waits_past_its_patience_for_a_holder_whose_liveness_lapses_later(
    tmp_path: Path,
) -> None:
    # Given a run held by a process whose liveness record (2 s) lapses well after a
    # turn's patience (0.5 s): it died, but nothing can tell yet
    ctx = memory_context(liveness_s=2.0, heartbeat_interval_s=0.1, lease_s=60.0)
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund my order").run_id
    ctx.runs.renew_liveness("dying-host:9:0ff", 2.0)
    assert ctx.runs.claim_lease(run_id, "dying-host:9:0ff/t", 60).taken

    # When a plain turn comes, it gives up after its patience: the holder may be alive
    assert advance(ctx, run_id, 1).outcome == "leased"
    # but a redelivered one waits on until the holder's liveness lapses, and takes over
    done = advance(ctx, run_id, 1, redelivered=True)
    assert done.outcome == "suspended"
    assert [e.type for e in ctx.runs.events(run_id)][1] == "run.resumed"


def parked_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Context, str, str]:
    """A run on memory stores (with :data:`SHORT`'s lease and liveness) that parked with a
    refund in flight: its context, id and open call."""
    from tests.test_recovery import park_with_refund_in_flight, refund_agent

    monkeypatch.setenv("RATCHET_EXAMPLE_LEDGER", str(tmp_path / "ledger"))
    ctx = memory_context(**SHORT)
    run_id, call_id = park_with_refund_in_flight(ctx, refund_agent(tmp_path))
    return ctx, run_id, call_id


@pytest.mark.timeout(60)
def test_an_operators_reconciliation_of_a_parked_run_whose_holder_died_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.recovery import reconcile

    # Given a parked run whose lease a process that died still holds
    ctx, run_id, call_id = parked_run(tmp_path, monkeypatch)
    dead_owner(ctx, run_id)

    # When an operator decides its open call
    chained: list[tuple[str, int]] = []
    state = reconcile(
        ctx,
        run_id,
        call_id,
        "fail",
        reason="the bank refused it",
        enqueue=lambda r, s: chained.append((r, s)),
    )

    # Then it is recorded and the run goes on (it was refused as "leased" before)
    assert ctx.runs.events(run_id)[-1].type == "tool.reconciled"
    assert chained == [(run_id, state.seq)]
    assert ctx.runs.lease(run_id) is None


@pytest.mark.timeout(60)
def test_an_operators_reconciliation_waits_for_the_worker_still_letting_go_of_the_parked_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.recovery import reconcile

    # Given a run that just parked, whose worker (alive) has not yet let its lease go:
    # the peer benchmark's operator saw needs_reconciliation and reconciled at once
    ctx, run_id, call_id = parked_run(tmp_path, monkeypatch)
    ctx.runs.renew_liveness("parking-host:7:abc", 60.0)
    assert ctx.runs.claim_lease(run_id, "parking-host:7:abc/t", 60).taken
    let_go = threading.Timer(0.3, ctx.runs.release_lease, (run_id, "parking-host:7:abc/t"))
    let_go.start()

    # When the operator decides the open call right away
    try:
        state = reconcile(ctx, run_id, call_id, "fail", reason="refused", enqueue=lambda r, s: None)
    finally:
        let_go.cancel()

    # Then it waited for the worker to let go and was recorded (it was refused as busy)
    assert ctx.runs.events(run_id)[-1].type == "tool.reconciled"
    assert state.status != RunStatus.NEEDS_RECONCILIATION


@pytest.mark.timeout(60)
def test_an_operators_resume_of_a_run_whose_holder_died_mid_turn_enqueues_one_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.api

    # Given a run whose worker died mid-turn (the run is live) holding its lease
    ctx = memory_context(**SHORT)
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund my order").run_id
    dead_owner(ctx, run_id)
    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(lease, "urgent_sweeper_resume", lambda r, s: sent.append(("sweeper", r)))
    monkeypatch.setattr(
        worker.api, "enqueue_resume", lambda **fields: sent.append((fields["by"], fields["run_id"]))
    )

    # When an operator resumes it
    status = worker.api.Ratchet(ctx).resume(run_id)

    # Then one resume is sent, the operator's (its answer is the one `resume --wait` reads),
    # not a sweeper's resume as well, which counts towards dead-lettering and races it
    assert sent == [("operator", run_id)], sent
    assert status == "queued"
    assert ctx.runs.lease(run_id) is None


@pytest.mark.timeout(60)
def test_an_operators_resume_right_after_a_turn_stalled_the_run_waits_for_it_to_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.api
    from tasks.persistence import append_events, load

    # Given a run a worker has just stalled and still holds, finishing its turn (the status
    # is visible before the lease goes: the turn's checkpoint and release come after)
    ctx = memory_context(**SHORT)
    run_id = create_run(ctx, write_agent(tmp_path, ASK), "refund my order").run_id
    owner = "stalling-host:7:abc/t"
    ctx.runs.renew_liveness("stalling-host:7:abc", 60.0)
    assert ctx.runs.claim_lease(run_id, owner, 60).taken
    state = load(ctx, run_id).state
    append_events(ctx, state, [("run.stalled", {"reason": "the provider gave up"})], owner)
    let_go = threading.Timer(0.2, ctx.runs.release_lease, (run_id, owner))
    let_go.start()
    sent: list[str] = []
    monkeypatch.setattr(
        worker.api, "enqueue_resume", lambda **fields: sent.append(fields["run_id"])
    )

    # When the operator resumes it at once
    try:
        status = worker.api.Ratchet(ctx).resume(run_id)
    finally:
        let_go.cancel()

    # Then the resume waited for the turn to let go and was sent (it was refused as busy)
    assert status == "stalled" and sent == [run_id]
