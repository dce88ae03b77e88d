"""Recovery in-process: classification, the sweeper with an injected clock, resume,
dead-lettering, reconciliation, zombie fencing and bounded hangs."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from runtime.errors import BindingChanged, LeaseLost, RunRefused, StaleWrite
from runtime.fsm import rebuild
from runtime.models import RunStatus
from runtime.recovery import OPERATOR, SWEEPER
from store.conformance import FakeClock
from store.runs.memory import MemoryRunStore
from store.runs.redis import RedisRunStore
from tasks.context import Context
from tasks.held_run import HeldRun
from tasks.persistence import append_events, load, new_owner
from tasks.recovery import reconcile, resume, sweep_orphans
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, drive, memory_context, turn, write_agent
from worker.api import Ratchet
from worker.cli import main as cli

LEASE_MS = 10_000


def clocked_context(clock: FakeClock, **settings: Any) -> Context:
    ctx = memory_context(**settings)
    ctx.runs = MemoryRunStore(clock=clock)
    return ctx


def clocked_run(
    directory: Path, agent: Path | None = None, input: str = "refund"
) -> tuple[FakeClock, Context, str]:
    """A run of ``agent`` (:func:`refund_agent` by default) on memory stores whose run
    store keeps the time of the clock returned with it."""
    clock = FakeClock(1_000_000)
    ctx = clocked_context(clock)
    run_id = create_run(ctx, agent or refund_agent(directory), input).run_id
    return clock, ctx, run_id


def past_deadline(directory: Path, late_ms: int) -> tuple[Context, str]:
    """A run with a 5 s deadline, created and ``late_ms`` later on its clock."""
    agent = write_agent(directory, [turn("done")], budgets={"timeout_seconds": 5})
    clock, ctx, run_id = clocked_run(directory, agent, "x")
    clock.now_ms += late_ms
    return ctx, run_id


def assert_resume_refused(
    ctx: Context, run_id: str, match: str, error: type[Exception] = RunRefused
) -> None:
    """An operator's resume of the run is refused with ``error``, saying ``match``."""
    with pytest.raises(error, match=match):
        Ratchet(ctx).resume(run_id)


def refund_agent(directory: Path, amount: int = 2900) -> Path:
    return write_agent(
        directory,
        [
            turn("look", call("lookup_order", order_id="B2")),
            turn("refund", call("issue_refund", order_id="B2", amount_cents=amount)),
            turn("Refunded."),
        ],
    )


def ledger_lines(ledger: Path) -> list[str]:
    return ledger.read_text().splitlines() if ledger.exists() else []


def park_with_refund_in_flight(ctx: Context, agent: Path) -> tuple[str, str]:
    """A run whose worker died after journaling issue_refund as requested: parked."""
    run_id = create_run(ctx, agent, "refund B2").run_id
    assert advance(ctx, run_id, None).outcome == "next"
    loaded = load(ctx, run_id)
    state = loaded.state
    responded: dict[str, Any] = {
        "content": "refund",
        "tool_calls": [
            {
                "id": "call_2_1",
                "name": "issue_refund",
                "arguments": {"order_id": "B2", "amount_cents": 5},
            }
        ],
        "usage": None,
    }
    requested = {
        "call_id": "call_2_1",
        "name": "issue_refund",
        "arguments": responded["tool_calls"][0]["arguments"],
    }
    append_events(
        ctx,
        state,
        [
            ("model.requested", {"turn": 2}),
            ("model.responded", responded),
            ("tool.requested", requested),
        ],
        None,
    )
    assert advance(ctx, run_id, None).outcome == "parked"
    return run_id, "call_2_1"


# --- the sweeper ------------------------------------------------------------


def test_the_sweeper_finds_a_run_only_once_it_is_overdue_and_its_lease_expired(
    tmp_path: Path, ledger: Path
) -> None:
    clock, ctx, run_id = clocked_run(tmp_path)
    enqueued: list[tuple[str, int]] = []

    def enqueue(run: str, seq: int) -> None:
        enqueued.append((run, seq))

    # Given a worker took the run's lease and then vanished
    assert ctx.runs.acquire_lease(run_id, "dead-worker", 30)
    # When the sweeper looks before the run is due, or while the lease lives
    assert sweep_orphans(ctx, enqueue) == []
    clock.now_ms += LEASE_MS + 1
    assert sweep_orphans(ctx, enqueue) == []
    # Then nothing; once the lease expired too, it enqueues one resume at the seq it saw
    clock.now_ms += 30_000
    assert sweep_orphans(ctx, enqueue) == [run_id]
    assert enqueued == [(run_id, 1)]


def test_the_sweeper_never_picks_suspended_parked_or_finished_runs(
    tmp_path: Path, ledger: Path
) -> None:
    clock = FakeClock(1_000_000)
    ctx = clocked_context(clock)
    asks = write_agent(tmp_path / "a", [turn("?", call("request_user_input", prompt="which?"))])
    done = write_agent(tmp_path / "d", [turn("done")])
    suspended = create_run(ctx, asks, "x").run_id
    finished = create_run(ctx, done, "x").run_id
    parked, _ = park_with_refund_in_flight(ctx, refund_agent(tmp_path / "r"))
    drive(ctx, suspended)
    drive(ctx, finished)
    clock.now_ms += 10 * LEASE_MS
    assert sweep_orphans(ctx, lambda run, seq: None) == []
    assert {r.status for r in ctx.runs.list()} == {
        RunStatus.NEEDS_USER_INPUT,
        RunStatus.COMPLETED,
        RunStatus.NEEDS_RECONCILIATION,
    }
    assert parked


def test_two_sweepers_at_once_enqueue_twice_and_the_run_is_resumed_once(
    tmp_path: Path, ledger: Path
) -> None:
    clock, ctx, run_id = clocked_run(tmp_path)
    clock.now_ms += LEASE_MS + 1
    enqueued: list[tuple[str, int]] = []
    lock = threading.Lock()

    def enqueue(run: str, seq: int) -> None:
        with lock:
            enqueued.append((run, seq))

    sweepers = [threading.Thread(target=sweep_orphans, args=(ctx, enqueue)) for _ in range(2)]
    for sweeper in sweepers:
        sweeper.start()
    for sweeper in sweepers:
        sweeper.join()
    # (once or twice: the first to enqueue postpones the run's due time, which the other
    # may or may not have read before)
    assert enqueued in ([(run_id, 1)], [(run_id, 1), (run_id, 1)])

    # When two resume messages for it are delivered
    outcomes = [resume(ctx, run, SWEEPER, seq).outcome for run, seq in [enqueued[0]] * 2]

    # Then the first resumes and takes a turn, the second finds the run moved on
    assert outcomes == ["next", "stale"]
    types = [e.type for e in ctx.runs.events(run_id)]
    assert types.count("run.resumed") == 1 and types.count("model.responded") == 1


def test_a_run_recovered_too_often_without_progress_is_dead_lettered_with_its_history(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context(max_recovery_attempts=3)
    run_id = create_run(ctx, refund_agent(tmp_path), "refund").run_id
    # Given three sweeper recoveries, each followed by a worker dying before any progress
    for attempt in (1, 2, 3):
        loaded = load(ctx, run_id)
        append_events(
            ctx,
            loaded.state,
            [
                ("run.resumed", {"by": SWEEPER, "attempt": attempt}),
                ("model.requested", {"turn": 1}),
            ],
            None,
        )
    record = ctx.runs.get(run_id)
    assert record is not None

    # When the sweeper resumes it a fourth time
    done = resume(ctx, run_id, SWEEPER, record.last_seq)

    # Then it is dead-lettered instead, with every attempt in the event
    assert done.outcome == "dead_lettered"
    last = ctx.runs.events(run_id)[-1]
    assert last.type == "run.dead_lettered"
    assert [a["attempt"] for a in last.data["attempts"]] == [1, 2, 3]
    assert "RATCHET_MAX_RECOVERY_ATTEMPTS=3" in last.data["reason"]
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.DEAD_LETTERED
    assert ctx.runs.overdue() == []
    # And an operator who fixed the cause can still resume it; it completes
    assert resume(ctx, run_id, OPERATOR).outcome == "next"
    assert drive(ctx, run_id).outcome == "completed"


def test_progress_resets_the_recovery_count_so_a_backlogged_run_is_never_dead_lettered(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context(max_recovery_attempts=2)
    run_id = create_run(ctx, refund_agent(tmp_path), "refund").run_id
    # Each round: the sweeper resumes the run (its turn sat in a queue) and it progresses
    for _ in range(4):
        record = ctx.runs.get(run_id)
        assert record is not None
        done = resume(ctx, run_id, SWEEPER, record.last_seq)
        if done.outcome != "next":
            break
    assert done.outcome == "completed"
    assert "run.dead_lettered" not in [e.type for e in ctx.runs.events(run_id)]


def test_a_sweeper_resume_queued_behind_the_runs_own_turn_is_a_no_op(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    run_id = create_run(ctx, refund_agent(tmp_path), "refund").run_id
    # The sweeper saw seq 1; the chained turn ran first
    assert advance(ctx, run_id, 1).outcome == "next"
    before = ctx.runs.events(run_id)
    assert resume(ctx, run_id, SWEEPER, 1).outcome == "stale"
    assert ctx.runs.events(run_id) == before


# --- resume: classification and refusals -----------------------------------


def test_resume_refuses_a_completed_run_and_says_nothing_is_left(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    run_id = create_run(ctx, write_agent(tmp_path, [turn("done")]), "x").run_id
    drive(ctx, run_id)
    assert_resume_refused(ctx, run_id, "is completed: there is nothing to resume")


def test_resume_refuses_a_suspended_run_and_points_to_continue(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    agent = write_agent(tmp_path, [turn("?", call("request_user_input", prompt="which?"))])
    run_id = create_run(ctx, agent, "x").run_id
    drive(ctx, run_id)
    assert_resume_refused(ctx, run_id, f"ratchet runs continue {run_id}")


def test_resume_refuses_a_parked_run_and_names_the_call_to_reconcile(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    run_id, call_id = park_with_refund_in_flight(ctx, refund_agent(tmp_path))
    assert_resume_refused(ctx, run_id, f"ratchet runs reconcile {run_id} {call_id}")


def test_resume_refuses_a_changed_agent_and_says_what_changed(tmp_path: Path, ledger: Path) -> None:
    ctx = memory_context()
    agent = refund_agent(tmp_path)
    run_id = create_run(ctx, agent, "x").run_id
    agent.write_text(agent.read_text().replace("You are a test agent.", "Be someone else."))
    assert_resume_refused(ctx, run_id, "changed: system", BindingChanged)


def test_resume_refuses_a_run_past_its_deadline_as_restart_required(
    tmp_path: Path, ledger: Path
) -> None:
    ctx, run_id = past_deadline(tmp_path, 6_000)
    assert_resume_refused(ctx, run_id, "budget `timeout_seconds` exhausted")


def test_resume_refuses_a_run_whose_checkpoint_and_events_are_both_gone(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    run_id = create_run(ctx, write_agent(tmp_path, [turn("done")]), "x").run_id
    ctx.snapshots.delete(run_id)
    assert isinstance(ctx.runs, MemoryRunStore)
    ctx.runs._logs[run_id] = []  # the event log lost, as by a wiped table
    assert_resume_refused(ctx, run_id, "no snapshot and its events cannot rebuild one")


def test_a_sweeper_that_cannot_resume_a_live_run_dead_letters_it_instead_of_looping(
    tmp_path: Path, ledger: Path
) -> None:
    ctx, run_id = past_deadline(tmp_path, 20_000)
    assert resume(ctx, run_id, SWEEPER, 1).outcome == "dead_lettered"
    record = ctx.runs.get(run_id)
    assert record is not None and record.error is not None
    assert "the sweeper cannot resume it" in record.error and "timeout_seconds" in record.error


def test_a_stale_snapshot_is_healed_on_resume_and_the_run_continues(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    run_id = create_run(ctx, refund_agent(tmp_path), "refund").run_id
    assert advance(ctx, run_id, None).outcome == "next"
    # The snapshot falls behind the events (a crash between append and save)
    loaded = load(ctx, run_id)
    append_events(ctx, loaded.state, [("model.requested", {"turn": 2})], None)
    assert resume(ctx, run_id, OPERATOR).outcome == "next"
    assert drive(ctx, run_id).outcome == "completed"
    assert ledger_lines(ledger) == ["refund B2 2900"]


# --- zombies ----------------------------------------------------------------


def test_a_worker_whose_lease_expired_cannot_write_after_another_took_over(
    tmp_path: Path, ledger: Path
) -> None:
    clock, ctx, run_id = clocked_run(tmp_path)
    # Given worker A opened the run and then froze past its lease
    owner = new_owner()
    assert ctx.runs.acquire_lease(run_id, owner, 10)
    zombie = HeldRun.open(ctx, run_id, owner)
    assert zombie is not None
    clock.now_ms += 11_000
    # And worker B took the run over and finished it
    assert drive(ctx, run_id).outcome == "completed"
    events = ctx.runs.events(run_id)
    # When A wakes up and writes
    with pytest.raises((LeaseLost, StaleWrite)):
        zombie.record([("model.requested", {"turn": 1})])
    # Then the write is refused and the finished run is untouched
    assert ctx.runs.events(run_id) == events


def test_a_zombie_turn_stops_and_logs_why_instead_of_writing(
    tmp_path: Path, ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock, ctx, run_id = clocked_run(tmp_path)
    original = ctx.runs.append

    def late_append(record, events, owner):  # type: ignore[no-untyped-def]
        # Another worker took the lease while this one was away.
        clock.now_ms += 60_000
        ctx.runs.acquire_lease(run_id, "worker-b", 120)
        return original(record, events, owner)

    ctx.runs.append = late_append  # type: ignore[method-assign]
    done = advance(ctx, run_id, 1)
    assert done.outcome == "fenced"
    assert "no longer holds the run's lease" in caplog.text
    assert [e.type for e in ctx.runs.events(run_id)] == ["run.created"]


# --- reconciliation ---------------------------------------------------------


def test_runs_show_prints_the_open_call_of_a_parked_run(tmp_path: Path, ledger: Path) -> None:
    ctx = memory_context()
    run_id, call_id = park_with_refund_in_flight(ctx, refund_agent(tmp_path))
    from tasks.context import set_context

    set_context(ctx)
    try:
        shown = CliRunner().invoke(cli, ["runs", "show", run_id])
    finally:
        set_context(None)
    assert shown.exit_code == 0, shown.output
    assert "needs_reconciliation" in shown.output
    assert f"open call  {call_id}  issue_refund(" in shown.output
    assert '"amount_cents": 5' in shown.output and "outcome unknown" in shown.output


def test_reconcile_refuses_a_run_that_is_not_parked_or_a_call_that_is_not_open(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    live = create_run(ctx, refund_agent(tmp_path / "a"), "x").run_id
    with pytest.raises(RunRefused, match="only a run parked as needs_reconciliation"):
        reconcile(ctx, live, "call_1_1", "retry", enqueue=lambda *m: None)
    parked, call_id = park_with_refund_in_flight(ctx, refund_agent(tmp_path / "b"))
    with pytest.raises(RunRefused, match=f"the open call is {call_id}"):
        reconcile(ctx, parked, "call_9_9", "retry", enqueue=lambda *m: None)
    with pytest.raises(ValueError, match="--fail needs a reason"):
        reconcile(ctx, parked, call_id, "fail", reason=" ")


@pytest.mark.parametrize(
    ("decision", "kwargs", "ledger_after", "model_reads"),
    [
        ("result", {"result": {"refunded_cents": 5}}, [], '{"refunded_cents": 5}'),
        ("retry", {}, ["refund B2 5"], '"status": "refunded"'),
        ("fail", {"reason": "the bank refused it"}, [], "the bank refused it"),
    ],
)
def test_a_reconciled_call_lets_the_parked_run_go_on(
    tmp_path: Path,
    ledger: Path,
    decision: str,
    kwargs: dict[str, Any],
    ledger_after: list[str],
    model_reads: str,
) -> None:
    ctx = memory_context()
    run_id, call_id = park_with_refund_in_flight(ctx, refund_agent(tmp_path))
    chained: list[tuple[str, int]] = []
    state = reconcile(
        ctx, run_id, call_id, decision, **kwargs, enqueue=lambda *m: chained.append(m)
    )
    assert chained == [(run_id, state.seq)]
    assert drive(ctx, run_id).outcome == "completed"
    assert ledger_lines(ledger) == ledger_after
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.COMPLETED
    loaded_events = ctx.runs.events(run_id)
    answered = [e for e in loaded_events if e.data.get("call_id") == call_id]
    assert [e.type for e in answered][1:3] == ["run.parked", "tool.reconciled"]
    assert answered[2].data["decision"] == decision
    # What the model read as the call's result is in the run's transcript.
    final = rebuild(loaded_events)
    assert final is not None
    answer = [m for m in final.transcript if m.tool_call_id == call_id]
    assert len(answer) == 1 and model_reads in answer[0].content


# --- bounded hangs -------------------------------------------------------------


def test_a_model_call_that_hangs_is_abandoned_counted_and_the_run_fails_on_max_turns(
    tmp_path: Path, ledger: Path
) -> None:
    script = [{"content": "late", "sleep_s": 1.0}]
    agent = write_agent(tmp_path, script, budgets={"max_turns": 2}, extra="model_timeout_s = 0.1")
    ctx = memory_context()
    run_id = create_run(ctx, agent, "x").run_id
    started = time.monotonic()
    assert drive(ctx, run_id).outcome == "failed"
    assert time.monotonic() - started < 1.0
    events = ctx.runs.events(run_id)
    assert [e.type for e in events] == [
        "run.created",
        "model.requested",
        "model.failed",
        "model.requested",
        "model.failed",
        "run.failed",
    ]
    assert "did not return within 0.1 s" in events[2].data["error"]
    assert "max_turns" in events[-1].data["reason"]


def test_a_hung_non_idempotent_tool_parks_the_run_and_a_hung_idempotent_one_fails_the_call(
    tmp_path: Path, ledger: Path
) -> None:
    tools = ["tests.slow_tools:slow_lookup", "tests.slow_tools:slow_charge"]
    extra = "tool_timeout_s = 0.05"
    lookup = write_agent(
        tmp_path / "l",
        [turn("x", call("slow_lookup", sleep_s=0.5)), turn("gave up")],
        tools=tools,
        extra=extra,
    )
    charge = write_agent(
        tmp_path / "c",
        [turn("x", call("slow_charge", sleep_s=0.5)), turn("done")],
        tools=tools,
        extra=extra,
    )
    ctx = memory_context()
    looked = create_run(ctx, lookup, "x").run_id
    charged = create_run(ctx, charge, "x").run_id

    assert drive(ctx, looked).outcome == "completed"
    failed = [e for e in ctx.runs.events(looked) if e.type == "tool.failed"]
    assert len(failed) == 1 and "did not return within 0.05 s, 3 times" in failed[0].data["error"]

    assert drive(ctx, charged).outcome == "parked"
    record = ctx.runs.get(charged)
    assert record is not None and record.status == RunStatus.NEEDS_RECONCILIATION
    assert record.error is not None and "did not return within 0.05 s" in record.error


def test_a_turn_time_limit_not_below_the_visibility_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="must be below RATCHET_VISIBILITY_TIMEOUT_S"):
        Settings(turn_time_limit_s=3600, visibility_timeout_s=3600)


# --- cost ---------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_sweep_costs_the_same_with_ten_thousand_suspended_runs_present(
    tmp_path: Path, ledger: Path
) -> None:
    # Cost counted, not timed: the commands Redis ran and the reads the keys touched
    # (a timed comparison failed under load; bench/timers.py times the same thing), on a
    # server of the test's own so that no other client's commands are counted.
    from tests.redis_server import running_redis_server

    (tmp_path / "redis").mkdir()
    with running_redis_server(tmp_path / "redis") as private:
        sweep_costs_the_same(tmp_path, f"{private.url}/0")


def sweep_costs_the_same(tmp_path: Path, redis_url: str) -> None:
    from tests.workers import redis_context

    ctx = redis_context(redis_url)
    agent = refund_agent(tmp_path)
    for i in range(10):
        create_run(ctx, agent, "x", run_id=f"orphan-{i}")
    # A minute later, every one of them is overdue; each sweep a lease later again (a
    # sweep postpones the runs it enqueued by a lease).
    later = [60_000]
    ctx.runs.clock = lambda: int(time.time() * 1000) + later[0]
    server = redis.Redis.from_url(redis_url)

    def sweep_cost() -> tuple[int, int]:
        later[0] += int(ctx.settings.lease_s * 1000) + 1
        before = server.info("stats")
        assert len(sweep_orphans(ctx, lambda run, seq: None)) == 10
        after = server.info("stats")
        # the INFO call itself is one command; keyspace hits and misses count key reads
        commands = after["total_commands_processed"] - before["total_commands_processed"] - 1
        reads = sum(after[k] - before[k] for k in ("keyspace_hits", "keyspace_misses"))
        return commands, reads

    sweep_cost()  # the first sweep also loads the store's Lua scripts into the server
    without = sweep_cost()
    add_suspended_runs(ctx.runs, 10_000)  # type: ignore[arg-type]
    with_many = sweep_cost()
    assert with_many == without, (without, with_many)
    server.close()


def add_suspended_runs(runs: RedisRunStore, count: int) -> None:
    """Suspended runs, written through the store API (a create, then a suspension)."""
    from runtime.models import Event
    from store.runs import RunRecord

    for i in range(count):
        run_id = f"suspended-{i}"
        record = RunRecord(
            run_id=run_id,
            agent="a",
            agent_file="a.toml",
            status=RunStatus.NEEDS_USER_INPUT,
            created_at_ms=i,
            updated_at_ms=i,
            last_seq=1,
            input="x",
        )
        runs.create(record, Event(seq=1, type="run.created", at_ms=i, data={}))
