"""Fleet-wide model rate limits and concurrency caps: the arithmetic, pure (clock passed in).

**Rates** are enforced with GCRA (the generic cell rate algorithm) in its virtual
scheduling form, one *theoretical arrival time* (TAT) per rate: a rate of ``R``
units per minute emits one unit every ``T = 60 000 / R`` ms and tolerates running
``tau = burst_s`` seconds ahead of that schedule. A call costing ``c`` units may
go at ``max(now, TAT - tau)``; going pushes the TAT to ``max(TAT, go) + c * T``.
A call costing more than the burst still goes (it leaves a debt the next calls
wait out), so a large prompt can never be refused forever, and the long-run
rate is exactly ``R``. Every limit key has two rates — requests and tokens — and
a call must fit both: it goes at the later of their two times.

**Reservations.** When the time to go is in the future but within a horizon, the
call *reserves* it (the TATs move now) and the turn is put back on the queue with
a countdown to exactly that time, so it need not ask again and calls leave at the
rate's spacing instead of a herd of retries. Past the horizon nothing is taken
and the turn is told when to ask again, placed by its position in the waiting
line (:func:`retry_after_ms`), so waiters come back spread out, in order.

**What was sent.** A reservation is a promise about a time, and a turn whose countdown
fires late (a stalled worker, a busy box) would otherwise go whenever it comes, together
with the calls scheduled after it: seconds-late reservations used to reach the provider
in a bunch it refused. So each rate keeps a second TAT, of the calls that actually went
(:func:`sent_after`). A call goes only when that TAT has room for it (:func:`room_at`): a
reservation come late waits for the room instead, and a new call is scheduled behind
both TATs. The schedule's TAT spaces the calls out; the sent TAT is what the provider sees.

**Priority.** Turns of runs already under way may reserve further ahead
(:data:`UNDER_WAY_HORIZON_MS`) than first turns of new runs
(:data:`NEW_RUN_HORIZON_MS`), and stand ahead of them in the waiting line: while
started runs want the capacity, new runs do not start.

**Tokens** are estimated before the call (:func:`estimate_tokens`: the prompt's
size and the completion's expected ``max_tokens``) and corrected from the
response's usage (:func:`corrected_tat`), which moves the token TAT back or on.

**Waiting.** A call the limits hold ends its turn (:class:`Wait`): a run short of a
concurrency place looks again every :data:`CAP_RECHECK_S` and never stalls
(:func:`cap_wait`); a run held by a rate or a 429 waits again on the queue until it would
have waited past its agent's ``max_wait_s`` in a row, and then stalls (:func:`rate_wait`).

The Redis store runs the same arithmetic in one Lua script (store/limits/redis.py);
tests hold the two to the same answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.errors import InvalidOption
from runtime.numbers import Finite, finite

UNDER_WAY_HORIZON_MS = 10_000
"""How far ahead a turn of a run under way may reserve its call."""
NEW_RUN_HORIZON_MS = 1_000
"""How far ahead a first turn of a new run may reserve its call."""
CHARS_PER_TOKEN = 4
"""The estimate's exchange rate: about four characters of English a token (OpenAI's rule)."""
KEY_PATTERN = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,200}$")
"""What a limit key or a concurrency key may be: it goes into store keys and command lines."""


class LimitsTable(BaseModel):
    """The agent file's ``[limits]`` table; every key optional.

    ::

        [limits]
        key = "openai-main"            # runs of agents naming one key share its limits
        requests_per_minute = 600
        tokens_per_minute = 90000
        max_runs = 20                  # runs of this agent in progress at once
        max_runs_per_key = 2           # ... per concurrency key a start names (a tenant)
        priority = 3                   # 0-4, higher first (a start may set its own)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str | None = Field(default=None, pattern=KEY_PATTERN.pattern)
    """The shared limit's name; default: provider, host, model and key variable."""
    requests_per_minute: int | None = Field(default=None, ge=1, le=10_000_000)
    tokens_per_minute: int | None = Field(default=None, ge=1, le=10_000_000_000)
    burst_s: Finite = Field(default=1.0, gt=0, le=60)
    """How far ahead of the rate's even spacing calls may run (seconds' worth of it)."""
    completion_tokens: int = Field(default=256, ge=0, le=1_000_000)
    """Tokens a completion is expected to cost when ``[provider] max_tokens`` is unset."""
    max_wait_s: Finite = Field(default=900.0, gt=0, le=7 * 86_400)
    """A run over its rate limit (or refused with 429) this long in a row is stalled."""
    max_runs: int | None = Field(default=None, ge=1, le=1_000_000)
    """At most this many runs of the agent in progress at once; the rest wait queued."""
    max_runs_per_key: int | None = Field(default=None, ge=1, le=1_000_000)
    """At most this many runs of one start-named concurrency key in progress at once."""
    priority: int = Field(default=2, ge=0, le=4)
    """Broker priority of the agent's runs, 0-4, higher first."""


@dataclass(frozen=True)
class Rate:
    """``per_minute`` units a minute, running at most ``burst_s`` ahead of even spacing."""

    unit: Literal["requests", "tokens"]
    per_minute: float
    burst_s: float

    @property
    def interval_ms(self) -> float:
        return 60_000.0 / self.per_minute

    @property
    def tolerance_ms(self) -> float:
        return self.burst_s * 1000.0


Outcome = Literal["go", "reserved", "denied"]


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    """go now; reserved (go after ``wait_ms``, already counted); denied (ask again later)."""
    wait_ms: float
    """0 for go; until the reserved time; until the rate would have room (denied)."""
    tats: tuple[float, ...] | None
    """The rates' new TATs when the call goes or reserved; ``None`` when denied."""
    binding: str | None
    """The unit of the rate that made it wait (``requests``, ``tokens``, ``blocked``)."""


def schedule(
    tats: Sequence[float | None],
    costs: Sequence[float],
    rates: Sequence[Rate],
    now_ms: float,
    horizon_ms: float,
    blocked_until_ms: float = 0.0,
) -> Verdict:
    """When a call costing ``costs`` (one per rate) may go, given the rates' TATs.

    ``blocked_until_ms``: the provider answered 429 with ``Retry-After`` until then.
    """
    go_at, binding = now_ms, None
    if blocked_until_ms > go_at:
        go_at, binding = blocked_until_ms, "blocked"
    go_at, rate_binding = room_at(tats, rates, go_at)
    binding = rate_binding or binding
    wait_ms = go_at - now_ms
    if wait_ms > horizon_ms:
        return Verdict("denied", wait_ms, None, binding)
    new = sent_after(tats, costs, rates, go_at)
    return Verdict("go" if wait_ms <= 0 else "reserved", max(0.0, wait_ms), new, binding)


def room_at(
    sent: Sequence[float | None], rates: Sequence[Rate], now_ms: float
) -> tuple[float, str | None]:
    """When TATs ``sent`` leave room for one more call under every rate (not before
    ``now_ms``), and the rate that is short of it (None: room at ``now_ms``)."""
    at, binding = now_ms, None
    for tat, rate in zip(sent, rates, strict=True):
        if tat is not None and tat - rate.tolerance_ms > at:
            at, binding = tat - rate.tolerance_ms, rate.unit
    return at, binding


def sent_after(sent: Sequence[float | None], costs: Sequence[float], rates: Sequence[Rate],
               now_ms: float) -> tuple[float, ...]:  # fmt: skip
    """The TATs once a call costing ``costs`` goes (or is reserved) at ``now_ms``."""
    return tuple(
        max(tat if tat is not None else now_ms, now_ms) + cost * rate.interval_ms
        for tat, cost, rate in zip(sent, costs, rates, strict=True)
    )


def later(a: float | None, b: float | None) -> float | None:
    """The later of two TATs, either possibly absent."""
    if a is None or b is None:
        return b if a is None else a
    return max(a, b)


RETRY_JITTER = 0.1
"""A denied call asks again up to this fraction later, so equal waits do not come back at once."""


def retry_after_ms(
    wait_ms: float, horizon_ms: float, place: int, spacing_ms: float, draw: float = 0.0
) -> float:
    """When a denied call asks again: as its rate comes within its horizon, plus its place.

    ``place`` is its 0-based position in the waiting line, ``spacing_ms`` the time one
    call ahead of it takes (the slowest rate's share per call): waiters come back in
    the line's order, one spacing apart, instead of all at once. ``draw``, in [0, 1), is
    the caller's random draw (the core is given its randomness, as it is given the time):
    the wait grows by up to :data:`RETRY_JITTER` of itself.
    """
    return (max(1.0, wait_ms - horizon_ms) + place * spacing_ms) * (1 + draw * RETRY_JITTER)


def corrected_tat(tat: float, delta: float, rate: Rate, now_ms: float) -> float:
    """The TAT after a call turned out to cost ``delta`` units more (or, negative, fewer).

    A refund never moves the TAT before now: unused capacity in the past is gone.
    """
    if delta >= 0:
        return max(tat, now_ms) + delta * rate.interval_ms
    return max(now_ms, tat + delta * rate.interval_ms) if tat > now_ms else tat


def spacing_ms(costs: Sequence[float], rates: Sequence[Rate]) -> float:
    """How long one call of ``costs`` holds the slowest of ``rates``."""
    return max((c * r.interval_ms for c, r in zip(costs, rates, strict=True)), default=0.0)


def rates_of(requests_per_minute: float | None, tokens_per_minute: float | None,
             burst_s: float) -> tuple[Rate, ...]:  # fmt: skip
    """The rates a limit sets (either may be absent)."""
    rates = []
    if requests_per_minute:
        rates.append(Rate("requests", float(requests_per_minute), burst_s))
    if tokens_per_minute:
        rates.append(Rate("tokens", float(tokens_per_minute), burst_s))
    return tuple(rates)


def estimate_tokens(messages: Sequence[Any], tools: Sequence[Any], completion_tokens: int) -> int:
    """Tokens a call will cost: its prompt's size over CHARS_PER_TOKEN plus the completion's.

    Deliberately plain (no tokenizer): the response's usage corrects it within the same
    minute, so the estimate needs only the right size, not the exact count.
    """
    chars = 0
    for message in messages:
        dumped = message.model_dump(mode="json") if hasattr(message, "model_dump") else message
        chars += len(json.dumps(dumped, ensure_ascii=False))
    chars += sum(len(json.dumps(tool, ensure_ascii=False)) for tool in tools)
    return chars // CHARS_PER_TOKEN + 1 + completion_tokens


# --- a call held by a limit ---------------------------------------------------------

CAP_RECHECK_S = 30.0
"""A run waiting for a concurrency place looks again this often (if no place was handed)."""


@dataclass(frozen=True)
class Wait:
    """A model call held by a limit: the turn ends and goes back on the queue after
    ``countdown_s``, or, ``stalls``, the run stalls (its last event says why)."""

    countdown_s: float
    events: list[tuple[str, dict[str, Any]]]
    """To record first (none for a reserved turn that fired a little early)."""
    stalls: bool = False


def cap_wait(turn: int, cap_key: str, cap: int, ahead: int, now_ms: int) -> Wait:
    """A run with ``ahead`` runs before it for a place under ``cap_key``: it looks again after
    :data:`CAP_RECHECK_S` (sooner when a place is handed to it) and never stalls: a place
    is held by runs that are moving, so waiting for one always ends."""
    data = {
        "turn": turn,
        "reason": "concurrency",
        "limit": cap_key,
        "cap": cap,
        "ahead": ahead,
        "wait_s": CAP_RECHECK_S,
        "until_ms": now_ms + int(CAP_RECHECK_S * 1000),
    }
    return Wait(CAP_RECHECK_S, [("run.throttled", data)])


def rate_wait(run_id: str, turn: int, key: str, reason: str, wait_ms: float,
              binding: str | None, now_ms: int, since_ms: int | None, max_wait_s: float,
              refused: bool = False) -> Wait:  # fmt: skip
    """A call held ``wait_ms`` more by ``key``'s rates (``reason``: reserved, over_limit) or by
    a 429 (``refused``): it waits again on the queue, unless the run, throttled in a row since
    ``since_ms`` (None: from ``now_ms``), would then have waited past ``max_wait_s``; then it
    stalls, saying which limit held it and how to go on."""
    since = since_ms if since_ms is not None else now_ms
    data: dict[str, Any] = {
        "turn": turn,
        "reason": reason,
        "limit": key,
        "binding": binding,
        "wait_s": round(wait_ms / 1000, 3),
        "until_ms": now_ms + int(wait_ms),
        "since_ms": since,
    }
    if refused:
        data["refused"] = True
    events: list[tuple[str, dict[str, Any]]] = [("run.throttled", data)]
    if now_ms + wait_ms - since > max_wait_s * 1000:
        waited_s = (now_ms - since) / 1000
        why = "the provider's 429 (Retry-After)" if binding == "blocked" else f"its {binding} limit"
        stall = (
            f"model `{key}` is held by {why}: waited {waited_s:.0f} s and would wait "
            f"{wait_ms / 1000:.0f} s more, past the agent's max_wait_s={max_wait_s:g}; raise "
            f"the limit (`ratchet limits set {key} ...`) or wait for the provider, then "
            f"`ratchet runs resume {run_id}`"
        )
        events.append(("run.stalled", {"reason": stall}))
        return Wait(0.0, events, stalls=True)
    return Wait(wait_ms / 1000, events)


def check_key(value: object, what: str) -> str:
    """A limit or concurrency key as given, or InvalidOption saying what one may be."""
    if not isinstance(value, str) or not KEY_PATTERN.fullmatch(value):
        raise InvalidOption(
            f"{what} must be 1-200 letters, digits or `_ . : @ / + -` (e.g. `tenant-a`), "
            f"not {str(value)[:40]!r}"
        )
    return value


def broker_priority(run_priority: int, under_way: bool, reversed_scale: bool) -> int:
    """The broker's priority (0-9) of a turn: any run under way above any new run.

    A run's priority (0-4, higher first) orders runs within each class. ``reversed_scale``:
    Redis (kombu) serves 0 first, RabbitMQ serves 9 first.
    """
    level = max(0, min(4, run_priority)) + (5 if under_way else 0)
    return 9 - level if reversed_scale else level


def checked_run_time(values: dict[str, Any]) -> dict[str, Any]:
    """A limit's run-time values (``ratchet limits set``), each a finite number.

    InvalidRequest otherwise: a NaN burst once switched an embedded limit off and
    failed every check of a Redis one inside Lua.
    """
    for name, value in values.items():
        finite(f"the limit's {name}", value)
    return values
