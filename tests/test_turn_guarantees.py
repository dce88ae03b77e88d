"""What a turn promises, each shown by breaking the situation it guards against.

- A zombie (a worker whose lease expired, or whose run an operator cancelled)
  has every write refused — events and snapshot — and the turn ends ``fenced``:
  the refusal never escapes the task.
- Every transition that is checkpointed is in the snapshot before the next step
  starts: the model's answer before any tool runs, a tool's outcome before the
  next model call.
- A tool that times out is tried again only if it is idempotent; any other is
  tried once and the run parked.
- The sweeper's resume of a run that is not live never touches it.

In-process on memory stores. The turn's failpoints (``tasks.failpoints``) are
the seam: a test puts an observer on the context (tasks/observers.py) to act at a
named point, where a crash test would end the process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.actions import TOOL_TIMEOUT_ATTEMPTS, Advanced
from runtime.models import RunStatus
from runtime.recovery import OPERATOR, SWEEPER
from store.runs.memory import MemoryRunStore
from store.runs.redis import RedisRunStore
from store.snapshots.memory import MemorySnapshotStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.context import Context
from tasks.control import cancel
from tasks.observers import Observer, Observers
from tasks.persistence import append_events, load
from tasks.recovery import resume
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.contract.conftest import FakeClock
from tests.helpers import call, drive, refunds, turn, write_agent
from tests.test_recovery import park_with_refund_in_flight, refund_agent

LEASE_S = 60
"""Long, so the heartbeat (every third of it) never renews a lease during a test."""


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ctx(clock: FakeClock) -> Context:
    return Context(Settings(lease_s=LEASE_S), MemorySnapshotStore(), MemoryRunStore(clock=clock))


class AtPoints(Observer):
    """Hands each named point a turn reaches, and its count of model calls, to ``act``."""

    def __init__(self, act: Callable[[str, int], None]) -> None:
        self.act = act

    def reached(self, point: str, model_calls: int) -> None:
        self.act(point, model_calls)


def at_point(ctx: Context, point: str, nth: int, act: Callable[[], object]) -> None:
    """Call ``act`` the ``nth`` time a turn of ``ctx`` passes failpoint ``point`` (1-based)."""
    seen = {"hits": 0}

    def hit(name: str, turn: int) -> None:
        if name == point:
            seen["hits"] += 1
            if seen["hits"] == nth:
                act()

    ctx.observers = Observers([AtPoints(hit)])


@pytest.fixture
def run_id(ctx: Context, tmp_path: Path, ledger: Path) -> str:
    """A run of two turns that each look an order up, created and not yet taken."""
    agent = write_agent(
        tmp_path,
        [
            turn("look", call("lookup_order", order_id="B2")),
            turn("look again", call("lookup_order", order_id="A1")),
            turn("Done."),
        ],
    )
    return create_run(ctx, agent, "look").run_id


# --- zombies: every write path refused ------------------------------------------

WRITE_PATHS = [
    # (failpoint, its nth hit) after which the zombie's next write is...
    ("model.response.received", 1),  # ...model.responded (events: the turn runs the lookup
    # next, so the answer's checkpoint is its events, and the snapshot waits for the turn's end)
    ("model.response.checkpointed", 1),  # ...the lookup's outcome (its tool.requested went
    # with the answer: the lookup may run again)
    ("tool.requested", 1),  # ...the tool's outcome, after it ran (events)
    ("tool.completed", 1),  # ...the tool's outcome (events)
    ("snapshot.before_save", 1),  # ...the snapshot of the tool's outcome: the turn's last
]
WRITE_PATH_IDS = [f"{p}#{n}" for p, n in WRITE_PATHS]


def take_over(ctx: Context, clock: FakeClock, run_id: str) -> int:
    """Worker B, after A's lease expired: takes the lease, records a resume, checkpoints."""
    clock.advance(LEASE_S * 1000 + 1)
    assert ctx.runs.acquire_lease(run_id, "worker-b", LEASE_S)
    other = Context(ctx.settings, ctx.snapshots, ctx.runs)
    loaded = load(other, run_id)
    state, snapshot_seq = loaded.state, loaded.snapshot_seq
    resumed = append_events(
        other, state, [("run.resumed", {"by": OPERATOR, "attempt": 1})], "worker-b"
    )
    other.snapshots.save(resumed, snapshot_seq)
    return resumed.seq


@pytest.mark.parametrize(("point", "nth"), WRITE_PATHS, ids=WRITE_PATH_IDS)
def test_a_zombie_whose_run_was_taken_over_writes_nothing_and_its_turn_ends_fenced(
    ctx: Context, clock: FakeClock, point: str, nth: int, run_id: str
) -> None:
    taken: dict[str, int] = {}
    # Given worker A freezes at `point` past its lease, and worker B takes the run over
    at_point(ctx, point, nth, lambda: taken.update(seq=take_over(ctx, clock, run_id)))

    # When A wakes up and carries on with its turn
    done = advance(ctx, run_id, 1)

    # Then each of its writes is refused: the turn ends fenced, and B's run is as B left it
    assert "seq" in taken, f"the turn never reached {point} #{nth}"
    assert done.outcome == "fenced"
    events = ctx.runs.events(run_id)
    assert events[-1].seq == taken["seq"] and events[-1].type == "run.resumed"
    snapshot = ctx.snapshots.load(run_id)
    assert snapshot is not None and snapshot.seq == taken["seq"]
    lease = ctx.runs.lease(run_id)
    assert lease is not None and lease.owner == "worker-b"


# The last path is left out: a snapshot save is fenced by its seq, not by the lease, and
# after it the turn has no event left to write (it chains the next one, which finds the
# lease taken or the run moved on).
@pytest.mark.parametrize(("point", "nth"), WRITE_PATHS[:4], ids=WRITE_PATH_IDS[:4])
def test_a_zombie_that_lost_its_lease_before_anyone_wrote_appends_nothing(
    ctx: Context, clock: FakeClock, point: str, nth: int, run_id: str
) -> None:
    seen: dict[str, int] = {}

    def lose_lease() -> None:
        # Worker B has taken the lease but not written yet: only the lease fences A.
        clock.advance(LEASE_S * 1000 + 1)
        assert ctx.runs.acquire_lease(run_id, "worker-b", LEASE_S)
        seen["last_seq"] = ctx.runs.events(run_id)[-1].seq

    at_point(ctx, point, nth, lose_lease)

    done = advance(ctx, run_id, 1)

    assert "last_seq" in seen, f"the turn never reached {point} #{nth}"
    assert done.outcome == "fenced"
    assert ctx.runs.events(run_id)[-1].seq == seen["last_seq"]


LATE_CHECKPOINT = [
    # (where worker B is when A's checkpoint lands, the snapshot's seq just after it, how
    # A's turn ends)
    ("tool.requested", 6, "fenced"),  # in its first tool call: B saved at seq 6 as it took
    # over, and A's save is refused
    ("snapshot.before_save", 5, "next"),  # about to save as it takes over: A's lands first,
    # the last write of A's turn (the next turn it chains finds the run moved on)
]


@pytest.mark.parametrize(("b_point", "landed_seq", "a_ends"), LATE_CHECKPOINT)
def test_a_zombies_late_checkpoint_never_fences_out_the_worker_that_took_the_run_over(
    ctx: Context, clock: FakeClock, b_point: str, landed_seq: int, a_ends: str, run_id: str
) -> None:
    # A snapshot save is fenced by its seq only (the snapshot store cannot see leases),
    # and a partitioned worker's save can reach the store long after it was sent: TCP
    # retransmits it once the link is back (measured: docs/testing.md, multi-host).
    a_paused, a_go, b_paused, b_go = (threading.Event() for _ in range(4))

    def hit(name: str, turn: int) -> None:
        who = threading.current_thread().name
        if who == "worker-a" and name == "snapshot.before_save" and not a_paused.is_set():
            a_paused.set()
            assert a_go.wait(10)
        elif who == "worker-b" and name == b_point and not b_paused.is_set():
            b_paused.set()
            assert b_go.wait(10)

    ctx.observers = Observers([AtPoints(hit)])
    outcomes: dict[str, str] = {}

    def worker(name: str, work: Callable[[Context], Advanced]) -> threading.Thread:
        own = Context(ctx.settings, ctx.snapshots, ctx.runs)
        own.observers = ctx.observers
        thread = threading.Thread(
            target=lambda: outcomes.update({name: work(own).outcome}), name=name
        )
        thread.start()
        return thread

    # Given worker A with its turn's events appended (the model's answer at seq 3, the
    # lookup it asks for at 4, its outcome at 5), the turn's snapshot not yet sent
    a = worker("worker-a", lambda own: advance(own, run_id, 1))
    assert a_paused.wait(10)
    # And worker B, after A's lease expired, resuming the run (run.resumed at seq 6)
    clock.advance(LEASE_S * 1000 + 1)
    b = worker("worker-b", lambda own: resume(own, run_id, SWEEPER))
    assert b_paused.wait(10)
    # When A's checkpoint reaches the store, and then B carries on
    a_go.set()
    a.join(10)
    landed = ctx.snapshots.load(run_id)
    b_go.set()
    b.join(10)

    # Then B's turn goes on to the next turn, its checkpoint the run's snapshot: a late
    # checkpoint that got in before B's first one is replaced
    assert landed is not None and landed.seq == landed_seq
    assert outcomes == {"worker-a": a_ends, "worker-b": "next"}
    record = ctx.runs.get(run_id)
    snapshot = ctx.snapshots.load(run_id)
    assert record is not None and snapshot is not None
    assert snapshot.seq == record.last_seq
    kinds = [e.type for e in ctx.runs.events(run_id)]
    assert kinds[2:6] == ["model.responded", "tool.requested", "tool.completed", "run.resumed"]
    assert drive(ctx, run_id).outcome == "completed"


CANCEL_PATHS = [WRITE_PATHS[i] for i in (0, 1, 4)]


@pytest.mark.parametrize(("point", "nth"), CANCEL_PATHS, ids=[f"{p}#{n}" for p, n in CANCEL_PATHS])
def test_an_operator_cancel_during_a_turn_ends_it_fenced_and_the_run_stays_cancelled(
    ctx: Context, point: str, nth: int, run_id: str
) -> None:
    # A cancel holds no lease: only the seq fences the turn in progress.
    at_point(ctx, point, nth, lambda: cancel(ctx, run_id, "customer hung up"))

    done = advance(ctx, run_id, 1)

    assert done.outcome == "fenced"
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.CANCELLED
    assert ctx.runs.events(run_id)[-1].type == "run.cancelled"
    # The zombie did not bring the cancelled run's snapshot back.
    assert ctx.snapshots.load(run_id) is None
    assert advance(ctx, run_id, None).outcome == "idle"


# --- checkpoints: each transition saved before the next step ----------------------


def test_each_turn_starts_from_a_snapshot_of_everything_before_it(
    ctx: Context, run_id: str
) -> None:
    behind: list[tuple[str, int, int]] = []

    def hit(name: str, turn: int) -> None:
        # A step starts: a model answer arrives, or a tool is about to run. Only the turn's
        # own events may be missing from the snapshot, each a checkpoint in the log:
        # model.requested, then the answer and the lookup's tool.requested that went with
        # it. The snapshot, the cache of their fold, is saved with the turn's last one.
        if name in ("model.response.received", "tool.requested"):
            snapshot = ctx.snapshots.load(run_id)
            last = ctx.runs.events(run_id)[-1].seq
            behind.append((name, turn, last - (snapshot.seq if snapshot else 0)))

    ctx.observers = Observers([AtPoints(hit)])

    assert drive(ctx, run_id).outcome == "completed"
    assert behind == [
        ("model.response.received", 1, 1),
        ("tool.requested", 1, 3),
        ("model.response.received", 2, 1),
        ("tool.requested", 2, 3),
        ("model.response.received", 3, 1),
    ]


@pytest.mark.parametrize("ends", ["next", "suspended", "parked"])
def test_a_turn_that_ends_leaves_the_snapshot_at_the_runs_last_event(
    ctx: Context, tmp_path: Path, ledger: Path, ends: str
) -> None:
    if ends == "parked":
        run_id, _ = park_with_refund_in_flight(ctx, refund_agent(tmp_path))
    else:
        script = [
            turn("look", call("lookup_order", order_id="B2")),
            turn("?", call("request_user_input", prompt="which?")),
        ]
        run_id = create_run(ctx, write_agent(tmp_path, script), "look").run_id
        done = advance(ctx, run_id, 1)
        if ends == "suspended":
            done = advance(ctx, run_id, done.seq)
        assert done.outcome == ends
    snapshot = ctx.snapshots.load(run_id)
    record = ctx.runs.get(run_id)
    assert snapshot is not None and record is not None
    assert snapshot.seq == record.last_seq


# --- a crash between the model's answer and the first tool call -------------------


class Crashed(BaseException):
    """The worker died here (a BaseException: nothing in the turn catches it)."""


class Saves(Observer):
    """Counts the snapshot saves a context's turns make."""

    def __init__(self) -> None:
        self.saves = 0

    def checkpointed(self, seconds: float, nbytes: int | None) -> None:
        self.saves += 1


@pytest.mark.parametrize("stores", ["memory", "redis"])
def test_a_turn_that_runs_a_tool_saves_the_snapshot_once_at_its_end(
    clock: FakeClock, tmp_path: Path, ledger: Path, request: pytest.FixtureRequest, stores: str
) -> None:
    # Every transition is checkpointed in the log (the answer with the lookup it asks for,
    # then the lookup's outcome); the snapshot, the cache of their fold, is written once a
    # turn: with its last checkpoint, the one that lets the lease go.
    if stores == "redis":
        url = request.getfixturevalue("redis_url")
        snapshots: Any = RedisSnapshotStore.from_url(url)
        runs: Any = RedisRunStore.from_url(url, clock=clock)
    else:
        snapshots, runs = MemorySnapshotStore(), MemoryRunStore(clock=clock)
    ctx = Context(Settings(lease_s=LEASE_S), snapshots, runs)
    script = [turn("look", call("lookup_order", order_id="B2")), turn("Done.")]
    run_id = create_run(ctx, write_agent(tmp_path, script), "look").run_id
    counted = Saves()
    ctx.observers = Observers([counted])

    done = advance(ctx, run_id, 1)

    assert done.outcome == "next"
    kinds = [e.type for e in ctx.runs.events(run_id)]
    assert kinds[1:] == ["model.requested", "model.responded", "tool.requested", "tool.completed"]
    assert counted.saves == 1
    snapshot = ctx.snapshots.load(run_id)
    assert snapshot is not None and snapshot.seq == done.seq == 5


ANSWERED_CALLS = [
    # (tool, its arguments, journaled as requested with the answer)
    ("examples.refunds:lookup_order", {"order_id": "B2"}, True),  # idempotent: runs again
    ("examples.refunds:issue_refund", {"order_id": "B2", "amount_cents": 5}, False),  # parks
    ("examples.refunds:send_refund", {"order_id": "B2", "amount_cents": 5}, False),  # probed
]


@pytest.mark.parametrize("stores", ["memory", "redis"])
@pytest.mark.parametrize(
    ("tool", "arguments", "requested_with_answer"),
    ANSWERED_CALLS,
    ids=[tool.split(":")[1] for tool, _, _ in ANSWERED_CALLS],
)
def test_a_call_whose_tool_never_started_runs_after_a_crash_without_a_park_or_a_probe(
    clock: FakeClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ledger: Path,
    request: pytest.FixtureRequest,
    stores: str,
    tool: str,
    arguments: dict[str, object],
    requested_with_answer: bool,
) -> None:
    # A call journaled as requested with no outcome "may have run": a tool that may not
    # run again parks the run or asks its probe. So only calls that may run again are
    # journaled with the model's answer; the others when they start.
    if stores == "redis":
        url = request.getfixturevalue("redis_url")
        ctx = Context(
            Settings(lease_s=LEASE_S),
            RedisSnapshotStore.from_url(url),
            RedisRunStore.from_url(url, clock=clock),
        )
        assert ctx.runs.commits_with(ctx.snapshots)
    else:
        ctx = Context(Settings(lease_s=LEASE_S), MemorySnapshotStore(), MemoryRunStore(clock=clock))
    name = tool.split(":")[1]
    script = [turn("on it", call(name, **arguments)), turn("Done.")]
    run_id = create_run(ctx, write_agent(tmp_path, script, tools=[tool]), "refund B2").run_id

    # Given a worker that dies once the model's answer is checkpointed, before the tool starts
    def crash() -> None:
        raise Crashed

    at_point(ctx, "model.response.checkpointed", 1, crash)
    with pytest.raises(Crashed):
        advance(ctx, run_id, 1)
    kinds = [e.type for e in ctx.runs.events(run_id)]
    assert kinds[-1] == ("tool.requested" if requested_with_answer else "model.responded")
    assert not ledger.exists()
    ctx.observers = Observers()

    # When the sweeper resumes the run, once the dead worker's lease expired
    clock.advance(LEASE_S * 1000 + 1)
    if resume(ctx, run_id, SWEEPER).outcome == "next":
        drive(ctx, run_id)

    # Then the call runs once, as if nothing had happened: no park, no probe asked
    kinds = [e.type for e in ctx.runs.events(run_id)]
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.COMPLETED, kinds
    assert "run.parked" not in kinds and "tool.probed" not in kinds
    assert kinds.count("tool.requested") == 1 and kinds.count("tool.completed") == 1
    if name != "lookup_order":
        assert refunds(ledger) == ["refund B2 5"]
    ctx.close()


# --- tool timeouts: retried only if idempotent ------------------------------------


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls"
    monkeypatch.setenv("RATCHET_TEST_CALLS", str(path))
    return path


COUNTED = ["tests.slow_tools:counted_lookup", "tests.slow_tools:counted_charge"]


def tries(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def timeouts(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "did not return within" in r.getMessage()]


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """``caplog``, catching the turn's warnings (a tool's timeout is one)."""
    caplog.set_level(logging.WARNING, "ratchet.turn")
    return caplog


def timed_run(
    ctx: Context,
    directory: Path,
    tool_call: dict[str, Any],
    answer: str,
    timeout_s: float,
    input: str = "look",
    tools: list[str] = COUNTED,
) -> str:
    """A run of an agent that makes ``tool_call`` under ``tool_timeout_s``, then answers."""
    agent = write_agent(
        directory,
        [turn("x", tool_call), turn(answer)],
        tools=tools,
        extra=f"tool_timeout_s = {timeout_s}",
    )
    return create_run(ctx, agent, input).run_id


def test_a_non_idempotent_tool_that_times_out_is_tried_once_and_the_run_parked(
    ctx: Context, tmp_path: Path, calls: Path, logged: pytest.LogCaptureFixture
) -> None:
    run_id = timed_run(
        ctx, tmp_path, call("counted_charge", sleep_s=1.0), "done", 0.2, input="charge"
    )

    assert drive(ctx, run_id).outcome == "parked"

    assert timeouts(logged) == [
        f"run {run_id}: tool counted_charge did not return within 0.2 s and was abandoned "
        "(attempt 1 of 1)"
    ]
    # The abandoned call may still be running; it started once at most, never again.
    assert tries(calls) in ([], ["charge"])
    journal = ctx.runs.journal(run_id)
    assert [(j.tool, j.status) for j in journal] == [("counted_charge", "requested")]
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.NEEDS_RECONCILIATION


def test_an_idempotent_tool_that_times_out_is_tried_again_and_its_call_fails_after_the_last(
    ctx: Context, tmp_path: Path, calls: Path, logged: pytest.LogCaptureFixture
) -> None:
    run_id = timed_run(ctx, tmp_path, call("counted_lookup", sleep_s=1.0), "gave up", 0.1)

    assert drive(ctx, run_id).outcome == "completed"

    n = TOOL_TIMEOUT_ATTEMPTS
    assert [m.rsplit("(", 1)[1] for m in timeouts(logged)] == [
        f"attempt {i} of {n})" for i in range(1, n + 1)
    ]
    journal = ctx.runs.journal(run_id)
    assert [(j.tool, j.status) for j in journal] == [("counted_lookup", "failed")]
    assert journal[0].error == f"`counted_lookup` did not return within 0.1 s, {n} times"


def test_an_idempotent_tool_that_answers_on_a_later_try_completes_its_call(
    ctx: Context, tmp_path: Path, calls: Path, logged: pytest.LogCaptureFixture
) -> None:
    run_id = timed_run(
        ctx, tmp_path, call("counted_lookup", sleep_s=2.0, fast_after=2), "found", 0.5
    )

    assert drive(ctx, run_id).outcome == "completed"

    assert len(timeouts(logged)) == 1
    journal = ctx.runs.journal(run_id)
    assert [(j.tool, j.status, j.result) for j in journal] == [
        ("counted_lookup", "completed", {"found": True})
    ]


def test_a_late_finish_of_an_abandoned_try_is_not_taken_for_the_retrys(
    ctx: Context, tmp_path: Path, calls: Path
) -> None:
    # Given an idempotent tool whose first try finishes after its timeout, while the
    # second (started when the first was abandoned) is still running, and the third is quick
    tool_call = call("lookup_by_try", first_s=0.8, second_s=3.0)
    tools = ["tests.slow_tools:lookup_by_try"]
    run_id = timed_run(ctx, tmp_path, tool_call, "found", 0.5, tools=tools)

    assert drive(ctx, run_id).outcome == "completed"

    # Then the outcome recorded is the third try's: the first's late answer was dropped,
    # and the second, abandoned in its turn, was not waited for
    journal = ctx.runs.journal(run_id)
    assert [(j.tool, j.status, j.result) for j in journal] == [
        ("lookup_by_try", "completed", {"try": 3})
    ]


# --- the sweeper's resume of a run that is not live -------------------------------


@pytest.mark.parametrize("status", ["completed", "suspended", "parked", "cancelled"])
@pytest.mark.parametrize("seen_seq", ["none", "current"])
def test_a_sweeper_resume_of_a_run_that_is_not_live_changes_nothing(
    ctx: Context, tmp_path: Path, ledger: Path, status: str, seen_seq: str
) -> None:
    # Given a run that finished, waits for a person, or was cancelled
    if status == "parked":
        run_id, _ = park_with_refund_in_flight(ctx, refund_agent(tmp_path))
    else:
        script = [turn("done")]
        if status == "suspended":
            script = [turn("?", call("request_user_input", prompt="which?"))]
        run_id = create_run(ctx, write_agent(tmp_path, script), "x").run_id
        if status == "cancelled":
            cancel(ctx, run_id)
        else:
            drive(ctx, run_id)
    before = ctx.runs.events(run_id)
    record = ctx.runs.get(run_id)
    assert record is not None and not record.status.is_live

    # When a sweeper's resume reaches it, with or without the seq the sweep saw
    seq = record.last_seq if seen_seq == "current" else None
    done = resume(ctx, run_id, SWEEPER, seq)

    # Then it is refused, and the run is exactly as it was: never dead-lettered
    assert done.outcome == "refused"
    assert ctx.runs.events(run_id) == before
    assert ctx.runs.get(run_id) == record
    assert ctx.runs.lease(run_id) is None
