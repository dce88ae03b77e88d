"""Durable timers: the `wait` tool, the sweeper's look-ahead, and `ratchet.wake`, in-process.

The run store's clock is ours to move, so "two seconds later" takes no time;
the real-worker test with a SIGKILL is tests/crash/test_timers_on_real_workers.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime.continuation import make_continuation
from runtime.errors import RunRefused
from runtime.fsm import rebuild
from runtime.models import RunState, RunStatus
from runtime.timers import wake_at_ms
from store.conformance import FakeClock
from store.runs import RunRecord
from store.runs.memory import MemoryRunStore
from tasks.context import Context
from tasks.control import apply_continuation, cancel, expire_suspended
from tasks.recovery import sweep_orphans
from tasks.settings import Settings
from tasks.start import create_run
from tasks.timers import eta_horizon_s, wake
from tests.helpers import call, drive, memory_context, turn, write_agent

WAIT_2S = turn("Waiting for the courier.", call("wait", seconds=2, reason="courier scan"))


def clocked(clock: FakeClock, **settings: Any) -> Context:
    ctx = memory_context(**settings)
    ctx.runs = MemoryRunStore(clock=clock)
    return ctx


@pytest.fixture(autouse=True)
def scheduled(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The turn's fast-path wake-ups, kept here instead of published to a broker.

    In-process tests must not publish: a message sent before the session's
    worker fixture points the app at Redis would bind the app's producer to
    another transport for the rest of the session.
    """
    calls: list[tuple[str, int]] = []

    def schedule(ctx: Context, state: RunState) -> None:
        assert state.suspension is not None
        calls.append((state.run_id, wake_at_ms(state.suspension)))

    monkeypatch.setattr("tasks.turn.schedule_wake", schedule)
    return calls


def no_enqueue(run_id: str, seq: int) -> None:
    """The tests take the next turn themselves."""


def state_of(ctx: Context, run_id: str) -> RunState:
    state = rebuild(list(ctx.runs.events(run_id, after_seq=0)))
    assert state is not None
    return state


class Sweep:
    """The sweeper's two outputs: resumes of orphans, wake-ups of timers."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.resumed: list[str] = []
        self.woken: list[tuple[str, int]] = []

    def __call__(self) -> list[str]:
        return sweep_orphans(
            self.ctx,
            lambda run, seq: self.resumed.append(run),
            wake=lambda run, record: self.woken.append((run, wake_at_ms(record.suspension))),  # type: ignore[arg-type]
        )


def waiting_run(ctx: Context, tmp_path: Path, extra: str = "", **budgets: Any) -> str:
    agent = write_agent(
        tmp_path,
        [WAIT_2S, turn("Scanned.")],
        tools=["wait", "request_user_input"],
        extra=extra,
        budgets=budgets or None,
    )
    run_id = create_run(ctx, agent, "Track parcel P1", "parcel").run_id
    assert drive(ctx, run_id).outcome == "suspended"
    return run_id


def test_a_wait_suspends_the_run_and_the_sweeper_wakes_it_on_time(
    tmp_path: Path, scheduled: list[tuple[str, int]]
) -> None:
    clock = FakeClock(1_800_000_000_000)
    ctx = clocked(clock, sweep_interval_s=0.5)
    sweep = Sweep(ctx)
    # Given a run whose model asked to wait 2 s
    run_id = waiting_run(ctx, tmp_path)
    state = state_of(ctx, run_id)
    assert state.status == RunStatus.WAITING and state.suspension is not None
    wake_at = state.suspension.since_ms + 2000
    assert (
        state.suspension.prompt.startswith("wait until ")
        and "courier scan" in state.suspension.prompt
    )
    # When the sweeper looks before the last sweep interval of the wait: nothing
    clock.now_ms = wake_at - 600
    assert sweep() == [] and sweep.woken == []
    # One sweep before its time, it enqueues the wake-up for that time (and resumes nothing)
    clock.now_ms = wake_at - 500
    assert sweep() == [run_id]
    assert sweep.woken == [(run_id, wake_at)] and sweep.resumed == []
    # A wake that arrives early does nothing
    assert wake(ctx, run_id, state.seq, no_enqueue) == "early"
    assert state_of(ctx, run_id).status == RunStatus.WAITING
    # On time, it wakes the run, and the model reads how long it waited
    clock.now_ms = wake_at + 3
    assert wake(ctx, run_id, state.seq, no_enqueue) == "woken"
    woken = state_of(ctx, run_id)
    assert woken.status == RunStatus.MODEL
    result = json.loads(woken.transcript[-1].content)
    assert result["type"] == "wait_over" and result["waited_s"] == 2.003
    # and a second copy of the wake is stale
    assert wake(ctx, run_id, state.seq, no_enqueue) == "stale"
    assert drive(ctx, run_id).outcome == "completed"
    # The wait was suspended time: it did not run down the deadline
    assert state_of(ctx, run_id).suspended_ms == 2003


def test_a_timer_not_due_costs_the_sweep_no_read(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000_000)
    ctx = clocked(clock)
    # Given a thousand runs waiting a minute, and one orphan (its worker died at once)
    agent = write_agent(tmp_path, [turn("Wait.", call("wait", seconds=60))], tools=["wait"])
    for i in range(1000):
        create_run(ctx, agent, "wait", f"waiting-{i}")
        drive(ctx, f"waiting-{i}")
    orphan = create_run(ctx, agent, "x", "orphan").run_id
    clock.now_ms += 11_000  # past the orphan's lease and due time, long before any timer's
    reads: list[str] = []
    get = ctx.runs.get

    def counted(run_id: str) -> RunRecord | None:
        reads.append(run_id)
        return get(run_id)

    ctx.runs.get = counted  # type: ignore[method-assign]
    # When the sweeper looks, it reads the orphan's record only: the index kept the timers out
    sweep = Sweep(ctx)
    assert sweep() == [orphan] and reads == [orphan]


def test_a_wait_with_bad_arguments_is_an_error_the_model_reads(tmp_path: Path) -> None:
    ctx = memory_context()
    agent = write_agent(
        tmp_path,
        [
            turn("Wait.", call("wait", seconds=-5)),
            turn("Wait.", call("wait", until="tomorrow")),
            turn("Giving up."),
        ],
        tools=["wait"],
    )
    run_id = create_run(ctx, agent, "x", "bad-wait").run_id
    assert drive(ctx, run_id).outcome == "completed"
    failed = [e for e in ctx.runs.events(run_id, after_seq=0) if e.type == "tool.failed"]
    assert len(failed) == 2
    assert all("`wait` takes `seconds`" in e.data["error"] for e in failed)


def test_an_answer_ends_a_wait_only_when_the_agent_allows_it(tmp_path: Path) -> None:
    ctx = memory_context()
    run_id = waiting_run(ctx, tmp_path)
    seq = state_of(ctx, run_id).seq
    answer = make_continuation(run_id, "c-1", input="scanned already", suspension_seq=seq)
    with pytest.raises(RunRefused, match="does not take answers during a wait"):
        apply_continuation(ctx, answer, lambda r, s: None)
    assert state_of(ctx, run_id).status == RunStatus.WAITING

    allowing = memory_context()
    run_id = waiting_run(allowing, tmp_path / "b", extra="wake_on_input = true")
    seq = state_of(allowing, run_id).seq
    answer = make_continuation(run_id, "c-2", input="scanned already", suspension_seq=seq)
    assert apply_continuation(allowing, answer, lambda r, s: None) == "continued"
    woken = state_of(allowing, run_id)
    assert woken.status == RunStatus.MODEL
    assert json.loads(woken.transcript[-1].content)["input"] == "scanned already"


def test_a_cancel_ends_a_wait_and_max_suspended_s_does_not(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000_000)
    ctx = clocked(clock)
    run_id = waiting_run(ctx, tmp_path, extra="max_suspended_s = 1")
    clock.now_ms += 10_000
    assert expire_suspended(ctx) == []
    assert state_of(ctx, run_id).status == RunStatus.WAITING
    cancel(ctx, run_id, "parcel found")
    assert state_of(ctx, run_id).status == RunStatus.CANCELLED
    assert wake(ctx, run_id, state_of(ctx, run_id).seq, no_enqueue) == "stale"


def test_a_wake_up_is_an_eta_message_only_within_half_the_brokers_redelivery_horizon() -> None:
    redis_broker = Settings(broker_url="redis://127.0.0.1:6379/0", visibility_timeout_s=3600)
    rabbitmq = Settings(broker_url="amqp://guest@127.0.0.1//", amqp_consumer_timeout_s=1800)
    assert eta_horizon_s(redis_broker) == 1800
    assert eta_horizon_s(rabbitmq) == 900
    # filesystem:// gives nothing to another worker: any wait may be held
    assert eta_horizon_s(Settings(broker_url="filesystem://localhost//")) is None
