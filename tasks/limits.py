"""Before each model call: the fleet's rate limits and concurrency caps. Waiting costs no slot.

:func:`admit` asks the limit store (store/limits/) whether the run may call its
model now. If not, it says how long to wait and which events to record, and the
turn ends: ``run.throttled`` is appended, the lease released, and the same turn
put back on the queue with a countdown (:func:`tasks.turn.enqueue_next`). No model
attempt is counted and no worker slot sleeps. A 429 the provider answers anyway
(another client shares the key, or the limits are set too high) goes the same
way (:func:`refused`): the request ``model.requested`` counted is given back, the
whole fleet holds off for the ``Retry-After``, and the turn waits on the queue.
A run that waits on rates or 429s for longer than its agent's ``max_wait_s`` in
a row is stalled with a reason that says which limit and how to go on.

Concurrency caps (``max_runs`` for an agent, ``max_runs_per_key`` for a key the
start names) are places: a run takes one before its first model call and keeps
it until it stops being live (:func:`turn_ended`); the next run in the line is
handed the place and its turn enqueued at once. A waiting run holds nothing but
its place in line and a safety-net turn every :data:`runtime.limits.CAP_RECHECK_S`; it never
stalls on a cap.

A key with no rate in force costs no admission round trip (:func:`held_off`: a 429's
hold-off is read at most every :data:`OVERRIDES_TTL_S`, and while it lasts the store decides).

Limits come from the agent file's ``[limits]`` table and are overridden at run
time by ``ratchet limits set`` / ``ratchet limits cap`` (kept in the limit store,
read here through a cache of :data:`OVERRIDES_TTL_S`): changing a limit needs no
restart.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from runtime.agent import Agent
from runtime.errors import ProviderRateLimited
from runtime.limits import (
    NEW_RUN_HORIZON_MS,
    UNDER_WAY_HORIZON_MS,
    Rate,
    Wait,
    broker_priority,
    cap_wait,
    estimate_tokens,
    rate_wait,
    rates_of,
    retry_after_ms,
    spacing_ms,
)
from runtime.models import RunState
from runtime.numbers import is_finite
from runtime.provider import ModelRequest, ModelResponse
from store.limits import LimitStore
from tasks.context import Context, HeldOff, Limits, Overrides
from tasks.messages import chain_turn, sending_app
from tasks.queues import AMQP_SCHEMES, REDIS_SCHEMES, scheme_of

log = logging.getLogger("ratchet.limits")

OVERRIDES_TTL_S = 2.0
"""How long a worker keeps the run-time limits it read: a change reaches it within this."""
DEFAULT_RETRY_AFTER_S = 1.0
"""A 429 without Retry-After waits this long."""


def limit_store(ctx: Context) -> LimitStore:
    """The limit store beside ``ctx``'s run store (:meth:`Context.limits`)."""
    return ctx.limits().store


def use_limit_store(ctx: Context, store: LimitStore) -> None:
    """Give ``ctx`` this limit store (tests: one with a clock of their own)."""
    ctx.use_limit_store(store)


def overrides(limits: Limits) -> Overrides:
    """The run-time limits and caps, read again when older than OVERRIDES_TTL_S."""
    held = limits.overrides
    if time.monotonic() - held.read_at >= OVERRIDES_TTL_S:
        held.limits, held.caps = limits.store.overrides(), limits.store.cap_overrides()
        held.read_at = time.monotonic()
    return held


def held_off(limits: Limits, key: str) -> bool:
    """Does a 429 hold ``key`` off now? Read from the store again when older than
    OVERRIDES_TTL_S (a 429 this process saw counts at once: :func:`refused`). The first
    read of a key also lists it for ``ratchet limits``."""
    seen = limits.held_off
    now = time.monotonic()
    held = seen.get(key)
    if held is None or now - held.read_at >= OVERRIDES_TTL_S:
        if held is None:
            limits.store.note_key(key)
        held = seen[key] = HeldOff(now, now + limits.store.held_off_s(key))
    return held.until > now


def limit_key(agent: Agent) -> str | None:
    """The name of the agent's shared limit: ``[limits] key``, else the provider's default."""
    if agent.spec.limits.key:
        return agent.spec.limits.key
    default = getattr(agent.provider, "limit_key", None)
    return str(default()) if callable(default) else None


def rates(limits: Limits, agent: Agent) -> tuple[str | None, tuple[Rate, ...]]:
    """The agent's limit key and its rates as they are now (run-time values win)."""
    key = limit_key(agent)
    if key is None:
        return None, ()
    table = agent.spec.limits
    # A value that is not a finite number (set before they were refused) is ignored.
    now = {k: v for k, v in overrides(limits).limits.get(key, {}).items() if is_finite(v)}
    rpm = now.get("requests_per_minute", table.requests_per_minute)
    tpm = now.get("tokens_per_minute", table.tokens_per_minute)
    return key, rates_of(rpm, tpm, float(now.get("burst_s", table.burst_s)))


def caps(limits: Limits, agent: Agent, state: RunState) -> list[tuple[str, int]]:
    """The concurrency caps the run is under: (cap key, places)."""
    table, now = agent.spec.limits, overrides(limits).caps
    found = []
    agent_key = f"agent:{agent.name}"
    agent_cap = now.get(agent_key, table.max_runs)
    if agent_cap:
        found.append((agent_key, int(agent_cap)))
    if state.concurrency_key is not None:
        key = f"key:{state.concurrency_key}"
        key_cap = now.get(key, table.max_runs_per_key)
        if key_cap:
            found.append((key, int(key_cap)))
    return found


# --- before the call -----------------------------------------------------------------


@dataclass(frozen=True)
class Go:
    """The call may go; ``key`` and ``estimate`` settle its token cost afterwards."""

    key: str | None = None
    tokens: Rate | None = None
    estimate: int = 0


def admit(ctx: Context, agent: Agent, state: RunState, request: ModelRequest) -> Go | Wait:
    """May ``state``'s next model call go now? Never sleeps."""
    limiter = ctx.limits()
    store = limiter.store
    turn = request.model_call + 1
    for cap_key, cap in caps(limiter, agent, state):
        waiting = _take_place(ctx, store, state, cap_key, cap)
        if waiting is not None:
            return _cap_wait(ctx, turn, cap_key, cap, waiting)
    key, limits = rates(limiter, agent)
    free = _free(limiter, key, limits)
    if free is not None:
        return free
    assert key is not None
    completion = getattr(agent.provider, "max_tokens", None) or agent.spec.limits.completion_tokens
    estimate = estimate_tokens(request.messages, request.tools, completion)
    costs = [1.0 if r.unit == "requests" else float(estimate) for r in limits]
    under_way = state.usage.model_turns > 0
    horizon = UNDER_WAY_HORIZON_MS if under_way else NEW_RUN_HORIZON_MS
    started = time.perf_counter()
    admission = store.admit(key, state.run_id, state.seq, state.seq + 1, limits, costs,
                            horizon, under_way)  # fmt: skip
    verdict = admission.verdict
    if ctx.observers:
        ctx.observers.limit_checked(time.perf_counter() - started, verdict.outcome)
    tokens = next((r for r in limits if r.unit == "tokens"), None)
    if verdict.outcome == "go":
        return Go(key, tokens, estimate)
    if verdict.binding == "early":
        return Wait(verdict.wait_ms / 1000, [])
    wait_ms = verdict.wait_ms
    if verdict.outcome == "denied":
        spacing = spacing_ms(costs, limits)
        wait_ms = retry_after_ms(wait_ms, horizon, admission.place, spacing, random.random())
    reason = "reserved" if verdict.outcome == "reserved" else "over_limit"
    return _rate_wait(ctx, agent, state, turn, key, reason, wait_ms, verdict.binding)


def unlimited(ctx: Context, agent: Agent, state: RunState) -> Go | None:
    """The Go :func:`admit` gives ``state``'s next model call without asking the limit store
    (no cap, no rate in force); None when admitting it takes the store."""
    limiter = ctx.limits()
    if caps(limiter, agent, state):
        return None
    return _free(limiter, *rates(limiter, agent))


def _free(limiter: Limits, key: str | None, limits: tuple[Rate, ...]) -> Go | None:
    if key is None:
        return Go()  # a provider without a key (scripted): nothing is shared
    if not limits and not held_off(limiter, key):
        # No rate in force: nothing to schedule, so no round trip (a 429's hold-off is
        # read at most every OVERRIDES_TTL_S, and while it lasts the store decides).
        return Go(key)
    return None


def _take_place(
    ctx: Context, store: LimitStore, state: RunState, cap_key: str, cap: int
) -> int | None:
    """None once the run holds a place under ``cap_key``; else how many wait ahead of it."""
    place = store.acquire(cap_key, state.run_id, cap)
    if place.held:
        return None
    # Places of runs that stopped without letting go (a cancel, a crash) are taken back.
    freed = False
    for holder in place.holders:
        record = ctx.runs.get(holder) if holder != state.run_id else None
        if holder != state.run_id and (record is None or not record.status.is_live):
            _hand_on(ctx, store.release(cap_key, holder, cap), cap_key, cap)
            freed = True
    if freed:
        place = store.acquire(cap_key, state.run_id, cap)
        if place.held:
            return None
    return place.place


def _cap_wait(ctx: Context, turn: int, cap_key: str, cap: int, ahead: int) -> Wait:
    wait = cap_wait(turn, cap_key, cap, ahead, ctx.runs.clock())
    if ctx.observers:
        ctx.observers.throttled("concurrency")
    return wait


def _rate_wait(ctx: Context, agent: Agent, state: RunState, turn: int, key: str, reason: str,
               wait_ms: float, binding: str | None, refused: bool = False) -> Wait:  # fmt: skip
    now = ctx.runs.clock()
    if ctx.observers:
        ctx.observers.throttled(reason)
    return rate_wait(state.run_id, turn, key, reason, wait_ms, binding, now,
                     state.throttled_since_ms, agent.spec.limits.max_wait_s, refused)  # fmt: skip


# --- after the call ------------------------------------------------------------------


def settle(ctx: Context, go: Go, response: ModelResponse) -> None:
    """Correct the token estimate from the response's usage (kept when it reports none)."""
    if go.key is None or go.tokens is None or response.usage is None:
        return
    actual = response.usage.input_tokens + response.usage.output_tokens
    if actual != go.estimate:
        limit_store(ctx).settle(go.key, actual - go.estimate, go.tokens)


def refused(
    ctx: Context, agent: Agent, state: RunState, go: Go, turn: int, exc: ProviderRateLimited
) -> Wait:
    """The provider answered 429: hold the whole key off for Retry-After, wait on the queue."""
    wait_s = exc.retry_after_s if exc.retry_after_s is not None else DEFAULT_RETRY_AFTER_S
    key = go.key or limit_key(agent) or agent.spec.model
    limiter = ctx.limits()
    limiter.store.block(key, wait_s * 1000)
    now = time.monotonic()
    limiter.held_off[key] = HeldOff(now, now + wait_s)
    log.info("run %s: %s; waiting %.2f s on the queue", state.run_id, exc, wait_s)
    return _rate_wait(ctx, agent, state, turn, key, "429", wait_s * 1000, "blocked", refused=True)


# --- around the turn -----------------------------------------------------------------


def turn_priority(ctx: Context, agent: Agent, state: RunState) -> int | None:
    """The broker priority of the run's next turn; None on a broker without priorities."""
    run_priority = state.priority if state.priority is not None else agent.spec.limits.priority
    return _on_broker(ctx, run_priority, under_way=state.usage.model_attempts > 0)


def first_turn_priority(ctx: Context, agent: Agent, run_priority: int | None) -> int | None:
    """The broker priority of a new run's first turn (the start's priority, else the agent's)."""
    chosen = run_priority if run_priority is not None else agent.spec.limits.priority
    return _on_broker(ctx, chosen, under_way=False)


def _on_broker(ctx: Context, run_priority: int, under_way: bool) -> int | None:
    # Without RATCHET_BROKER_URL the broker is the sending app's: a team's app names its own
    # (tasks.install), and the turn goes where that app sends it.
    broker = ctx.settings.broker_url or sending_app().conf.broker_url
    scheme = scheme_of(str(broker or ctx.settings.resolved_broker_url))
    if scheme not in REDIS_SCHEMES + AMQP_SCHEMES:
        return None
    return broker_priority(run_priority, under_way, reversed_scale=scheme in REDIS_SCHEMES)


def turn_ended(ctx: Context, agent: Agent, state: RunState) -> None:
    """A run that is no longer live lets go of its concurrency places (handed on in order)."""
    if state.status.is_live:
        return
    limiter = ctx.limits()
    store = limiter.store
    for cap_key, cap in caps(limiter, agent, state):
        _hand_on(ctx, store.release(cap_key, state.run_id, cap), cap_key, cap)


def _hand_on(ctx: Context, handed: list[str], cap_key: str, cap: int) -> None:
    """Enqueue the turns of runs just handed a place; a run gone meanwhile passes it on."""
    store = limit_store(ctx)
    while handed:
        run_id = handed.pop(0)
        record = ctx.runs.get(run_id)
        if record is None or not record.status.is_live:
            handed.extend(store.release(cap_key, run_id, cap))
            continue
        log.info("run %s: handed a place under %s; its turn is queued", run_id, cap_key)
        chain_turn(run_id, record.last_seq)
