"""Rate limits and concurrency caps: the pure arithmetic and the turn. The limit stores'
conformance suite (memory, SQLite, Redis's Lua script held to the same answers) is
store/conformance/limits.py, run by tests/contract/test_limit_store_contract.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.agent import Agent
from runtime.fsm import apply, rebuild
from runtime.limits import (
    RETRY_JITTER,
    Rate,
    Wait,
    broker_priority,
    corrected_tat,
    estimate_tokens,
    rates_of,
    retry_after_ms,
    schedule,
)
from runtime.models import Event, Message, RunState, RunStatus
from runtime.provider import ModelRequest
from store.limits.memory import MemoryLimitStore
from tasks.context import Context
from tasks.limits import admit, use_limit_store
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, drive, memory_context, turn, write_agent

PER_SECOND = Rate("requests", 60, burst_s=1.0)  # one a second, one second ahead at most


# --- the arithmetic -----------------------------------------------------------------


def test_gcra_lets_a_burst_go_then_spaces_calls_at_the_rate() -> None:
    tats: list[float | None] = [None]
    outcomes = []
    for _ in range(4):
        verdict = schedule(tats, [1], [PER_SECOND], now_ms=0, horizon_ms=0)
        outcomes.append((verdict.outcome, round(verdict.wait_ms)))
        if verdict.tats is not None:
            tats = list(verdict.tats)
    # Two at once (the second uses the one second of burst), then each a second later
    assert outcomes == [("go", 0), ("go", 0), ("denied", 1000), ("denied", 1000)]
    assert schedule(tats, [1], [PER_SECOND], now_ms=1000, horizon_ms=0).outcome == "go"


def test_a_call_within_the_horizon_reserves_its_time_and_one_beyond_takes_nothing() -> None:
    tats: list[float | None] = [3000.0]  # booked until 3 s: the next may go at 2 s
    reserved = schedule(tats, [1], [PER_SECOND], now_ms=0, horizon_ms=2500)
    assert reserved.outcome == "reserved" and reserved.wait_ms == 2000
    assert reserved.tats == (4000.0,)
    denied = schedule(tats, [1], [PER_SECOND], now_ms=0, horizon_ms=1000)
    assert denied.outcome == "denied" and denied.tats is None and denied.binding == "requests"


def test_a_call_must_fit_every_rate_and_the_slowest_binds() -> None:
    tokens = Rate("tokens", 600, burst_s=1.0)  # 10 tokens a second
    rates = [PER_SECOND, tokens]
    first = schedule([None, None], [1, 50], rates, now_ms=0, horizon_ms=60_000)
    assert first.outcome == "go" and first.tats is not None
    # 50 tokens took 5 s of the token rate: the next call waits on tokens, not requests
    second = schedule(list(first.tats), [1, 50], rates, now_ms=0, horizon_ms=60_000)
    assert second.outcome == "reserved" and second.binding == "tokens"
    assert second.wait_ms == pytest.approx(4000)


def test_a_429_blocks_until_its_retry_after_even_with_room_in_the_rates() -> None:
    verdict = schedule([None], [1], [PER_SECOND], 0, horizon_ms=0, blocked_until_ms=1500)
    assert verdict.outcome == "denied" and verdict.binding == "blocked"
    assert verdict.wait_ms == 1500


def test_the_token_estimate_is_corrected_both_ways_but_never_into_the_past() -> None:
    tokens = Rate("tokens", 60_000, burst_s=1.0)  # one token a millisecond
    assert corrected_tat(5000, 100, tokens, now_ms=1000) == 5100
    assert corrected_tat(5000, -1000, tokens, now_ms=1000) == 4000
    assert corrected_tat(5000, -9000, tokens, now_ms=1000) == 1000
    assert corrected_tat(500, -100, tokens, now_ms=1000) == 500
    assert corrected_tat(500, 100, tokens, now_ms=1000) == 1100


def test_waiters_come_back_in_line_order_one_spacing_apart() -> None:
    assert [retry_after_ms(5000, 1000, place, 100) for place in range(3)] == [4000, 4100, 4200]


def test_a_denied_call_comes_back_up_to_a_tenth_later_by_the_callers_draw() -> None:
    assert retry_after_ms(5000, 1000, 1, 100, draw=0.0) == 4100
    assert retry_after_ms(5000, 1000, 1, 100, draw=0.5) == pytest.approx(4100 * 1.05)
    assert retry_after_ms(5000, 1000, 1, 100, draw=0.999) < 4100 * (1 + RETRY_JITTER)


def test_the_estimate_grows_with_the_prompt_and_counts_the_expected_completion() -> None:
    short = estimate_tokens([Message(role="user", content="hi")], [], 0)
    long = estimate_tokens([Message(role="user", content="hi " * 400)], [], 0)
    assert long - short == pytest.approx(300, abs=5)
    assert estimate_tokens([Message(role="user", content="hi")], [], 256) == short + 256


def test_runs_under_way_outrank_new_runs_on_both_brokers_scales() -> None:
    redis_under_way = [broker_priority(p, True, reversed_scale=True) for p in range(5)]
    redis_new = [broker_priority(p, False, reversed_scale=True) for p in range(5)]
    # Redis serves 0 first: every run under way is below every new run, and a higher
    # run priority is a lower number
    assert (
        max(redis_under_way) < min(redis_new) and redis_under_way == sorted(redis_under_way)[::-1]
    )
    rabbit_under_way = [broker_priority(p, True, reversed_scale=False) for p in range(5)]
    rabbit_new = [broker_priority(p, False, reversed_scale=False) for p in range(5)]
    # RabbitMQ serves 9 first
    assert min(rabbit_under_way) > max(rabbit_new) and rabbit_new == sorted(rabbit_new)


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000.0

    def __call__(self) -> float:
        return self.ms


def limited(store: MemoryLimitStore | None = None) -> tuple[Context, MemoryLimitStore]:
    """A memory context whose limits ``store`` keeps (by default one on a still clock)."""
    ctx = memory_context()
    store = MemoryLimitStore(clock=Clock()) if store is None else store
    use_limit_store(ctx, store)
    return ctx, store


def first_request(ctx: Context, path: Path) -> tuple[Agent, RunState, ModelRequest]:
    """The agent at ``path``, a run of it just created, and its first model request."""
    from runtime.fsm import decide

    agent = ctx.agent(path)
    state = create_run(ctx, path, "hi")
    return agent, state, decide(state, agent, 0).request()  # type: ignore[union-attr]


def assert_waits_for_a_place(ctx: Context, run_id: str, limit: str) -> None:
    """The run's turn ends, to be chained later, waiting for a place under ``limit``."""
    done = advance(ctx, run_id, None)
    assert done.outcome == "next" and done.countdown_s > 0
    waited = ctx.runs.events(run_id)[-1]
    assert (waited.type, waited.data["reason"], waited.data["limit"]) == (
        "run.throttled",
        "concurrency",
        limit,
    )


# --- the turn ------------------------------------------------------------------------


def test_a_turn_over_its_limit_records_run_throttled_and_counts_no_attempt(
    tmp_path: Path,
) -> None:
    # Given an agent limited to one call a second, and a clock that does not move
    clock = Clock()
    ctx, _ = limited(MemoryLimitStore(clock=clock))
    agent = write_agent(
        tmp_path,
        [turn("Looking.", call("lookup_order", order_id="B2")), turn("Done.")],
        extra='[limits]\nkey = "k"\nrequests_per_minute = 60\nburst_s = 0.001',
    )
    run = create_run(ctx, agent, "Where is B2?")

    # When the second call comes at once
    first = advance(ctx, run.run_id, None)
    second = advance(ctx, run.run_id, first.seq)

    # Then the turn ends to be chained after its reserved second; no attempt was counted
    assert second.outcome == "next" and second.countdown_s == pytest.approx(1.0, abs=0.01)
    events = ctx.runs.events(run.run_id)
    assert events[-1].type == "run.throttled" and events[-1].data["reason"] == "reserved"
    record = ctx.runs.get(run.run_id)
    assert record is not None and record.usage.model_attempts == 1
    # The sweeper leaves it alone until the countdown has run out
    assert record.due_at_ms is not None
    assert record.due_at_ms >= events[-1].data["until_ms"] + ctx.settings.lease_s * 1000

    # And once the second has passed, the chained turn goes and the run completes
    clock.ms += 1000
    assert drive(ctx, run.run_id).outcome == "completed"


def test_a_run_over_its_limit_longer_than_max_wait_s_is_stalled_saying_why(
    tmp_path: Path,
) -> None:
    ctx, store = limited()
    store.block("k", 3_600_000)  # the provider asked for an hour
    agent = write_agent(tmp_path, [turn("Done.")], extra='[limits]\nkey = "k"\nmax_wait_s = 60')
    run = create_run(ctx, agent, "Where is B2?")

    done = advance(ctx, run.run_id, None)

    assert done.outcome == "stalled"
    record = ctx.runs.get(run.run_id)
    assert record is not None and record.status == RunStatus.STALLED
    assert record.error is not None and "max_wait_s=60" in record.error
    assert "ratchet limits set k" in record.error and "runs resume" in record.error


def test_admit_reads_a_limit_changed_at_run_time(tmp_path: Path) -> None:
    ctx, store = limited()
    path = write_agent(tmp_path, [turn("Done.")], extra='[limits]\nkey = "k"')
    agent, state, request = first_request(ctx, path)
    assert not isinstance(admit(ctx, agent, state, request), Wait)  # no rates: goes
    store.set_override("k", {"requests_per_minute": 60, "burst_s": 0.001})
    ctx.limits().overrides.read_at = -1e9  # the cache's few seconds, passed
    admit(ctx, agent, state, request)
    assert isinstance(admit(ctx, agent, state, request), Wait)


def test_a_429_gives_its_attempt_back_in_the_fold() -> None:
    created = {
        "run_id": "r", "agent": "a", "agent_file": "/a.toml", "binding": "b", "input": "hi",
        "system": "", "budgets": {}, "created_at_ms": 0,
    }  # fmt: skip
    events = [
        Event(seq=1, type="run.created", at_ms=0, data=created),
        Event(seq=2, type="model.requested", at_ms=1, data={"turn": 1}),
        Event(
            seq=3,
            type="run.throttled",
            at_ms=2,
            data={"turn": 1, "reason": "429", "refused": True, "since_ms": 2},
        ),  # fmt: skip
    ]
    state = rebuild(events)
    assert state is not None
    assert state.usage.model_attempts == 0 and state.status == RunStatus.QUEUED
    assert state.throttled_since_ms == 2
    responded = Event(seq=4, type="model.requested", at_ms=3, data={"turn": 1})
    assert apply(state, responded).throttled_since_ms == 2


def test_rates_of_leaves_out_a_rate_not_set() -> None:
    assert [r.unit for r in rates_of(None, 1000, 1.0)] == ["tokens"]
    assert rates_of(None, None, 1.0) == ()


def test_a_start_may_set_its_priority_and_concurrency_key_and_bad_ones_are_refused(
    tmp_path: Path,
) -> None:
    from runtime.errors import InvalidInput

    ctx = memory_context()
    agent = write_agent(tmp_path, [turn("Done.")])
    state = create_run(ctx, agent, "hi", priority=4, concurrency_key="tenant-a")
    assert (state.priority, state.concurrency_key) == (4, "tenant-a")
    rebuilt = rebuild(ctx.runs.events(state.run_id))
    assert rebuilt is not None and (rebuilt.priority, rebuilt.concurrency_key) == (4, "tenant-a")
    # A run without them encodes as before: neither key in its first event
    plain = create_run(ctx, agent, "hi")
    assert "priority" not in ctx.runs.events(plain.run_id)[0].data
    for bad in ({"priority": 5}, {"priority": True}, {"concurrency_key": "a tenant"}):
        with pytest.raises(InvalidInput):
            create_run(ctx, agent, "hi", **bad)


def test_a_concurrency_key_puts_the_run_under_the_agents_cap_per_key(tmp_path: Path) -> None:
    ctx, store = limited(MemoryLimitStore())
    agent = write_agent(tmp_path, [turn("Done.")], extra="[limits]\nmax_runs_per_key = 1")
    first = create_run(ctx, agent, "hi", concurrency_key="tenant-a")
    second = create_run(ctx, agent, "hi", concurrency_key="tenant-a")
    other = create_run(ctx, agent, "hi", concurrency_key="tenant-b")
    assert store.acquire("key:tenant-a", first.run_id, 1).held  # first holds tenant-a's place
    assert_waits_for_a_place(ctx, second.run_id, "key:tenant-a")
    assert advance(ctx, other.run_id, None).outcome == "completed"  # another tenant goes


def test_a_run_whose_key_has_no_rate_costs_no_admission_but_its_key_is_listed(
    tmp_path: Path,
) -> None:
    # Given an agent naming a limit key but setting no rate
    ctx, store = limited()
    path = write_agent(
        tmp_path,
        [turn("Looking.", call("lookup_order", order_id="B2")), turn("Done.")],
        extra='[limits]\nkey = "k"',
    )
    run = create_run(ctx, path, "Where is B2?")

    # When it runs to the end
    assert drive(ctx, run.run_id).outcome == "completed"

    # Then no call went through admission (it counts every call it lets go), yet
    # `ratchet limits` lists the key, ready for `ratchet limits set k ...`
    assert store.use("k").requests_this_minute == 0
    assert store.known()[0] == ["k"]


def test_a_429_holds_a_key_without_rates_off_here_at_once_and_elsewhere_within_the_cache(
    tmp_path: Path,
) -> None:
    import tasks.limits
    from runtime.errors import ProviderRateLimited

    ctx, store = limited()
    path = write_agent(tmp_path, [turn("Done.")], extra='[limits]\nkey = "k"')
    agent, state, request = first_request(ctx, path)
    go = admit(ctx, agent, state, request)
    assert not isinstance(go, Wait)

    # Another process's 429 (kept in the store) is seen once the cache's seconds passed
    store.block("k", 30_000)
    ctx.limits().held_off["k"].read_at = -1e9
    held = admit(ctx, agent, state, request)
    assert isinstance(held, Wait) and held.events[0][1]["binding"] == "blocked"

    # A 429 this process saw holds the key off for its next call at once, cache or not
    other = MemoryLimitStore(clock=Clock())
    use_limit_store(ctx, other)
    assert not isinstance(admit(ctx, agent, state, request), Wait)
    tasks.limits.refused(ctx, agent, state, go, 1, ProviderRateLimited("429", retry_after_s=30))
    held = admit(ctx, agent, state, request)
    assert isinstance(held, Wait) and held.events[0][1]["binding"] == "blocked"


def test_a_cap_set_at_run_time_holds_an_agent_whose_file_sets_none(tmp_path: Path) -> None:
    # Given an agent whose file sets no cap and no rate: its turns pay for no limit
    ctx, store = limited(MemoryLimitStore())
    agent = write_agent(tmp_path, [turn("Done.")])
    name = ctx.agent(agent).name
    first = create_run(ctx, agent, "hi")
    second = create_run(ctx, agent, "hi")
    assert advance(ctx, create_run(ctx, agent, "hi").run_id, None).outcome == "completed"

    # When an operator caps the agent at one run (`ratchet limits cap agent:NAME 1`) and
    # the worker's cache of run-time limits has had its seconds, with the first run in
    # progress (holding the only place)
    store.set_cap_override(f"agent:{name}", 1)
    ctx.limits().overrides.read_at = -1e9
    assert store.acquire(f"agent:{name}", first.run_id, 1).held

    # Then the second run waits for the place instead of calling its model
    assert_waits_for_a_place(ctx, second.run_id, f"agent:{name}")
