"""A real worker dies at every failpoint of every turn; the sweeper and another worker finish.

For each point in ``tasks.failpoints.POINTS`` and each turn 1–3 of a three-turn
refund agent (turn 1 calls the idempotent ``lookup_order``, turn 2 the
non-idempotent ``issue_refund``, turn 3 answers), a ``celery -A worker worker``
subprocess runs with ``RATCHET_FAILPOINT=<point>@<turn>`` and ``os._exit``s
there. The sweeper (called in-process, as beat would send it) enqueues a resume
and a second, healthy worker takes over.

The dying worker uses ``--pool solo``: the failpoint must end the whole worker,
as a lost machine would. (With prefork, ``os._exit`` in a pool child only kills
the child, and Celery redelivers the message — the broker's fast path, which
must not be what this proves.) It also consumes from a broker database of its
own, so the healthy worker cannot steal its turns before it dies: the only way
from the dead worker to the healthy one is the sweeper.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest
from celery import Celery

from runtime.models import Event, RunStatus
from store.runs import RunRecord
from tasks.context import Context
from tasks.failpoints import POINTS
from tasks.recovery import sweep_orphans
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent
from tests.redis_server import RedisServer, running_redis_server
from tests.workers import WorkerProcess, redis_context, worker_env
from worker.app import make_app

STORES_DB, DYING_BROKER_DB, HEALTHY_BROKER_DB = 0, 1, 2
LEASE_S = "1"

TURN_OF_THE_REFUND = 2
NON_IDEMPOTENT_IN_FLIGHT = {("tool.requested", 2), ("tool.completed", 2)}


@dataclass
class Rig:
    server: RedisServer
    directory: Path
    ledger: Path
    call_log: Path
    ctx: Context
    healthy: WorkerProcess
    dying_app: Celery
    healthy_app: Celery

    def env(self, broker_db: int, **extra: str) -> dict[str, str]:
        env = worker_env(
            f"{self.server.url}/{STORES_DB}", self.ledger, self.directory / "data", **extra
        )
        env.update(
            RATCHET_BROKER_URL=f"{self.server.url}/{broker_db}",
            RATCHET_LEASE_S=LEASE_S,
            RATCHET_SCRIPTED_CALL_LOG=str(self.call_log),
        )
        return env

    def worker(self, name: str, broker_db: int, **extra: str) -> WorkerProcess:
        return WorkerProcess(
            self.env(broker_db, **extra), self.directory / f"{name}.log", ("--pool", "solo")
        ).start()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    directory = tmp_path_factory.mktemp("crash")
    with running_redis_server(directory) as server:
        ledger, call_log = directory / "refunds.ledger", directory / "calls.log"
        partial = Rig(server, directory, ledger, call_log, None, None, None, None)  # type: ignore[arg-type]
        healthy = partial.worker("healthy", HEALTHY_BROKER_DB)
        rig = Rig(
            server,
            directory,
            ledger,
            call_log,
            redis_context(f"{server.url}/{STORES_DB}"),
            healthy,
            make_app(Settings(broker_url=f"{server.url}/{DYING_BROKER_DB}")),
            make_app(Settings(broker_url=f"{server.url}/{HEALTHY_BROKER_DB}")),
        )
        try:
            yield rig
        finally:
            healthy.kill()
            rig.ctx.close()


def refund_agent(directory: Path, amount: int) -> Path:
    return write_agent(
        directory,
        [
            turn("look", call("lookup_order", order_id="B2")),
            turn("refund", call("issue_refund", order_id="B2", amount_cents=amount)),
            turn("Refunded."),
        ],
    )


def outcome_events(events: list[Event]) -> list[tuple[str, object]]:
    """What a run did, without the bookkeeping of how it got there."""
    kept = ("model.responded", "tool.completed", "tool.failed", "run.completed")
    return [(e.type, e.data) for e in events if e.type in kept]


def duplicated_transitions(events: list[Event]) -> list[tuple[str, object]]:
    keys: Counter[tuple[str, object]] = Counter()
    for e in events:
        if e.type == "model.responded":
            keys[(e.type, len([x for x in events if x.type == e.type and x.seq <= e.seq]))] += 1
        elif e.type in ("tool.requested", "tool.completed", "tool.failed"):
            keys[(e.type, e.data["call_id"])] += 1
        elif e.type in ("run.completed", "run.parked"):
            keys[(e.type, None)] += 1
    return [key for key, n in keys.items() if n > 1]


class SweptRig(Protocol):
    """A rig whose healthy worker takes what the sweeper sends (this file's, and
    tests/crash/test_tracing.py's)."""

    ctx: Context
    healthy: WorkerProcess
    healthy_app: Celery


def settle(
    rig: SweptRig,
    run_id: str,
    dying: WorkerProcess,
    timeout_s: float = 30,
    parked: Callable[[RunRecord], object] | None = None,
) -> RunRecord:
    """Sweep (as beat would) until the run stops being live; the dying worker may finish it.
    ``parked``: what an operator does with a run that waits for reconciliation."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = rig.ctx.runs.get(run_id)
        assert record is not None
        if parked is not None and record.status == RunStatus.NEEDS_RECONCILIATION:
            parked(record)
        elif not record.status.is_live:
            return record
        elif dying.process is not None and dying.process.poll() is not None:
            sweep_orphans(
                rig.ctx,
                lambda run, seq: rig.healthy_app.send_task(
                    "ratchet.resume", (run, "sweeper", seq), queue="ratchet.turns"
                ),
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"run {run_id} still {record.status.value} after {timeout_s}s\n"
                f"dying worker:\n{dying.log()[-3000:]}\nhealthy worker:\n{rig.healthy.log()[-3000:]}"
            )
        time.sleep(0.1)


def model_calls_by_turn(call_log: Path, skip: int) -> Counter[int]:
    lines = call_log.read_text().splitlines()[skip:] if call_log.exists() else []
    return Counter(json.loads(line)["turn"] + 1 for line in lines)


# The child-starting points are a `run_child` call's: tests/crash/test_child_failpoints.py.
TURN_POINTS = [point for point in POINTS if not point.startswith("child.")]
CASES = [(point, at) for point in TURN_POINTS for at in (1, 2, 3)]


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("point", "at_turn"), CASES, ids=[f"{p}@{t}" for p, t in CASES])
def test_a_worker_dying_at_a_failpoint_loses_nothing_and_repeats_nothing(
    rig: Rig, tmp_path: Path, point: str, at_turn: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    amount = 1000 + CASES.index((point, at_turn))
    agent = refund_agent(tmp_path, amount)
    # The uninterrupted run, in-process, is what the crashed one must match.
    monkeypatch.setenv("RATCHET_EXAMPLE_LEDGER", str(tmp_path / "baseline.ledger"))
    baseline_ctx = memory_context()
    baseline_id = create_run(baseline_ctx, agent, "refund B2").run_id
    assert drive(baseline_ctx, baseline_id).outcome == "completed"
    baseline = outcome_events(baseline_ctx.runs.events(baseline_id))
    calls_before = len(rig.call_log.read_text().splitlines()) if rig.call_log.exists() else 0

    # Given a worker armed to die at the point, and a run it takes
    dying = rig.worker(
        f"dying-{point}@{at_turn}", DYING_BROKER_DB, RATCHET_FAILPOINT=f"{point}@{at_turn}"
    )
    try:
        run_id = create_run(rig.ctx, agent, "refund B2").run_id
        rig.dying_app.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
        # When it dies there, and the sweeper hands the run to the healthy worker
        record = settle(rig, run_id, dying)
        reached = not (
            at_turn == 3
            and point in ("tool.requested", "tool.completed", "turn.ended", "turn.enqueued")
        )
        # Past run.completed at turn 3 the run is finished a moment before the worker exits.
        exit_code = dying.wait(10) if reached else None
    finally:
        dying.kill()

    events = rig.ctx.runs.events(run_id)
    ledger = (
        [line for line in rig.ledger.read_text().splitlines() if line.endswith(f" {amount}")]
        if rig.ledger.exists()
        else []
    )
    # A turn saves its snapshot with its last checkpoint: the tool's outcome in turns 1 and
    # 2, the answer in turn 3. On one Redis that checkpoint is one write (events and
    # snapshot together), so a worker dying at snapshot.before_save loses the refund's
    # outcome (the refund ran: the run parks) and, in turn 3, the answer.
    combined = rig.ctx.runs.commits_with(rig.ctx.snapshots)
    before_last_write = combined and point == "snapshot.before_save"
    parks = (point, at_turn) in NON_IDEMPOTENT_IN_FLIGHT or (before_last_write and at_turn == 2)
    # Whether the model's answer was not yet committed.
    uncommitted = point == "model.response.received" or (before_last_write and at_turn == 3)
    # Turn 3 answers without tools and chains nothing: those three points are never reached.
    if reached:
        assert exit_code == 137, dying.log()[-2000:]
        assert f"failpoint {point} hit at turn {at_turn}" in dying.log()
        # At turn 3 the answer and run.completed are recorded together: past that, no resume.
        completed_before_dying = at_turn == 3 and not uncommitted
        if not parks and not completed_before_dying:
            resumed = [e.data["by"] for e in events if e.type == "run.resumed"]
            assert resumed == ["sweeper"], resumed
    # Then it is parked exactly when the refund was in flight, and completes otherwise
    if parks:
        assert record.status == RunStatus.NEEDS_RECONCILIATION, record.error
        assert outcome_events(events) == baseline[:3]
        assert ledger == ([] if point == "tool.requested" else [f"refund B2 {amount}"])
    else:
        assert record.status == RunStatus.COMPLETED, (record.error, [e.type for e in events])
        assert record.output == "Refunded."
        assert outcome_events(events) == baseline
        assert ledger == [f"refund B2 {amount}"]
    # And no checkpointed model answer was asked for again
    asked = model_calls_by_turn(rig.call_log, calls_before)
    for t in (1, 2, 3):
        expected = 2 if uncommitted and t == at_turn else 1
        if parks and t == 3:
            expected = 0
        assert asked[t] == expected, (t, asked)
    # And every transition happened once, in a gapless, increasing order
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert duplicated_transitions(events) == []
