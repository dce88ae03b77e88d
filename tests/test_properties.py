"""Property-based tests (Hypothesis) of the rules with many inputs.

- the rate limiter's schedule, on every limit store, against a small reference model
  (a leaky bucket, written apart from runtime/limits.py's GCRA) with random arrival
  patterns and idle spells: the stores agree with it, so with each other;
- a run resumed from its snapshot at any point of any golden log folds the rest of the
  log to the state the whole log folds to;
- the snapshot codec: a state round-trips, a mutated document is refused (or, where
  the change is one the schema allows, decodes to a state that round-trips);
- ``decide`` never returns an action a budget forbids.

Profiles (tests/conftest.py): ``fast`` in the suite, ``bench`` (``RATCHET_HYPOTHESIS=bench``)
with twenty times the examples, for a nightly run or before a change to these rules.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.actions import CallModel, RunTool
from runtime.agent import Agent
from runtime.errors import SnapshotError
from runtime.fsm import apply, decide, rebuild
from runtime.limits import Rate
from runtime.models import RunState, RunStatus, ToolCall
from runtime_io.agent_files import load_agent
from store.limits import LimitStore
from store.limits.memory import MemoryLimitStore
from store.limits.redis import RedisLimitStore
from store.limits.sqlite import SqliteLimitStore
from store.snapshots import format as snapshot_format
from tests.conftest import examples
from tests.helpers import call, turn, write_agent
from tests.test_golden_event_logs import LOGS, read_log

GOLDEN = {path.stem: read_log(path) for path in LOGS}


# --- the limiter: every store against one reference model --------------------------


@dataclass
class Bucket:
    """The reference: per rate, the work booked ahead of now (ms), draining as time
    passes. A call may start once what is booked ahead of it is within the burst."""

    interval_ms: tuple[float, ...]
    burst_ms: float
    horizon_ms: float
    ahead_ms: tuple[float, ...] = ()
    at_ms: float | None = None

    def wait_ms(self, now_ms: float) -> float:
        """How long a call arriving at ``now_ms`` waits; drains the buckets to then."""
        if self.at_ms is not None:
            passed = now_ms - self.at_ms
            self.ahead_ms = tuple(max(0.0, a - passed) for a in self.ahead_ms)
        self.at_ms = now_ms
        if not self.ahead_ms:
            self.ahead_ms = tuple(0.0 for _ in self.interval_ms)
        return max(0.0, max(a - self.burst_ms for a in self.ahead_ms))

    def book(self, wait_ms: float, costs: tuple[float, ...]) -> None:
        """A call let go (now, or reserved ``wait_ms`` on) takes its share of each rate."""
        self.ahead_ms = tuple(
            max(a, wait_ms) + c * i
            for a, c, i in zip(self.ahead_ms, costs, self.interval_ms, strict=True)
        )


REQUESTS = Rate("requests", 3000, burst_s=0.04)  # one each 20 ms, two at once
TOKENS = Rate("tokens", 60_000, burst_s=0.04)  # one token a millisecond
HORIZON_MS = 30.0
EPSILON_MS = 0.05
"""A decision this close to the edge may go either way (Redis keeps a TAT to the µs)."""

arrivals = st.lists(
    st.tuples(
        st.one_of(
            st.floats(0, 40),  # calls close together
            st.floats(150, 400),  # an idle spell: the buckets drain, and must not over-fill
        ),
        st.integers(1, 40),  # the call's tokens
    ),
    min_size=2,
    max_size=10,
)


def drive_limiter(store: LimitStore, pattern: list[tuple[float, int]], pause: object) -> None:
    """Admit calls arriving as ``pattern`` says (gap before each, its tokens); each
    answer must be the reference's for the time the store decided at."""
    key = f"k-{uuid.uuid4().hex[:8]}"
    model = Bucket((REQUESTS.interval_ms, TOKENS.interval_ms), 40.0, HORIZON_MS)
    for i, (gap_ms, tokens) in enumerate(pattern):
        pause(gap_ms)  # type: ignore[operator]
        costs = (1.0, float(tokens))
        got = store.admit(key, f"run-{i}", 1, 2, [REQUESTS, TOKENS], list(costs), HORIZON_MS,
                          True)  # fmt: skip
        verdict = got.verdict
        wait = model.wait_ms(got.now_ms)
        edge = min(abs(wait - HORIZON_MS), abs(wait)) < EPSILON_MS * (i + 1)
        expected = "denied" if wait > HORIZON_MS else ("go" if wait <= 0 else "reserved")
        if not edge:
            assert verdict.outcome == expected, (i, pattern, wait, verdict)
            if expected == "reserved":
                assert verdict.wait_ms == pytest.approx(wait, abs=EPSILON_MS * (i + 1))
        if verdict.outcome != "denied":  # the reference follows the store at an edge
            model.book(wait if not edge else verdict.wait_ms, costs)


class FakeClock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000.0

    def __call__(self) -> float:
        return self.now_ms

    def advance(self, ms: float) -> None:
        self.now_ms += ms


@pytest.fixture
def sqlite_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ratchet-limits-") as directory:
        yield Path(directory)


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@settings(max_examples=examples(40),
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(pattern=arrivals)
def test_a_local_limit_store_schedules_as_the_reference_model_does(
    backend: str, sqlite_path: Path, pattern: list[tuple[float, int]]
) -> None:
    # The clock injected: idle spells cost nothing, so many patterns run
    clock = FakeClock()
    store: LimitStore = (
        MemoryLimitStore(clock)
        if backend == "memory"
        else SqliteLimitStore(sqlite_path / f"{uuid.uuid4().hex}.sqlite3", clock)
    )
    drive_limiter(store, pattern, clock.advance)


@settings(max_examples=examples(4),
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(pattern=arrivals)
def test_the_redis_limit_store_schedules_as_the_reference_model_does(
    redis_url: str, pattern: list[tuple[float, int]]
) -> None:
    # On the Redis server's clock: the gaps are slept, and the model reads the time the
    # script decided at (Admission.now_ms)
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        drive_limiter(RedisLimitStore(client, "prop"), pattern, lambda ms: time.sleep(ms / 1000))
    finally:
        client.close()


# --- the fold: resumed from a snapshot anywhere, a log folds to the same state -------


@settings(max_examples=examples(60))
@given(name=st.sampled_from(sorted(GOLDEN)), cut=st.floats(0, 1))
def test_a_run_resumed_from_its_snapshot_at_any_event_folds_to_the_whole_logs_state(
    name: str, cut: float
) -> None:
    events = GOLDEN[name]
    end = 1 + int(cut * (len(events) - 1))
    # Given the state folded from a prefix, saved as a snapshot and read back
    prefix = rebuild(events[:end])
    assert prefix is not None and prefix.seq == events[end - 1].seq
    state = snapshot_format.decode(snapshot_format.encode(prefix), name)
    # When the rest of the log is replayed onto it one event at a time
    for event in events[end:]:
        state = apply(state, event)
    # Then it is the state of the whole log
    assert state == rebuild(events)


# --- the snapshot codec ---------------------------------------------------------------


def golden_state(name: str, cut: float) -> RunState:
    events = GOLDEN[name]
    state = rebuild(events[: 1 + int(cut * (len(events) - 1))])
    assert state is not None
    return state


states = st.builds(golden_state, st.sampled_from(sorted(GOLDEN)), st.floats(0, 1))


@settings(max_examples=examples(40))
@given(state=states)
def test_a_snapshot_decodes_to_the_state_it_encodes(state: RunState) -> None:
    data = snapshot_format.encode(state)
    assert snapshot_format.decode(data, "x") == state
    assert snapshot_format.encode(snapshot_format.decode(data, "x")) == data


def paths(value: object, at: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every path to a value inside a JSON document."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*at, i))


def decoded_or_refused(data: bytes) -> None:
    """A document is refused with a SnapshotError, or is one whose state round-trips."""
    try:
        state = snapshot_format.decode(data, "mutated")
    except SnapshotError:
        return
    assert snapshot_format.decode(snapshot_format.encode(state), "again") == state


@settings(max_examples=examples(60))
@given(state=states, where=st.floats(0, 1), byte=st.integers(0, 255),
       how=st.sampled_from(["replace", "insert", "delete", "truncate"]))  # fmt: skip
def test_a_snapshot_mutated_byte_by_byte_is_refused_or_still_a_valid_state(
    state: RunState, where: float, byte: int, how: str
) -> None:
    data = bytearray(snapshot_format.encode(state))
    i = int(where * (len(data) - 1))
    if how == "replace":
        data[i] = byte
    elif how == "insert":
        data.insert(i, byte)
    elif how == "delete":
        del data[i]
    else:
        del data[i:]
    decoded_or_refused(bytes(data))


MODEL_LEVEL = ("", "run", "run.usage", "run.budgets")
"""Objects of the schema's own models: an unknown field there is refused."""


@settings(max_examples=examples(60))
@given(state=states, pick=st.floats(0, 1),
       how=st.sampled_from(["drop", "retype", "extra", "kind", "version"]))  # fmt: skip
def test_a_snapshot_with_a_field_dropped_retyped_or_added_is_refused(
    state: RunState, pick: float, how: str
) -> None:
    document = json.loads(snapshot_format.encode(state))
    required = [("",), ("run",), ("run", "run_id"), ("run", "status"), ("run", "seq")]
    if how == "kind":
        document["kind"] = "ratchet.memory"
    elif how == "version":
        document["version"] = 3 + int(pick * 100)
    elif how == "drop":
        where = required[int(pick * (len(required) - 1))]
        if where == ("",):
            del document["run"]
        elif where == ("run",):
            del document["kind"]
        else:
            del document["run"][where[1]]
    elif how == "retype":
        keys = sorted(k for k in document["run"] if isinstance(document["run"][k], int | str))
        key = keys[int(pick * (len(keys) - 1))]
        value = document["run"][key]
        document["run"][key] = [value]  # no scalar field of a run takes a list
    else:
        level = MODEL_LEVEL[int(pick * (len(MODEL_LEVEL) - 1))]
        target = document
        for part in filter(None, level.split(".")):
            target = target[part]
        target["unexpected_field"] = 1
    data = json.dumps(document).encode()
    if how == "drop" and where == ("run",):
        # `kind` has a default in the schema: a document without it is still a snapshot
        decoded_or_refused(data)
        return
    with pytest.raises(SnapshotError):
        snapshot_format.decode(data, "mutated")


# --- decide never breaks a budget -------------------------------------------------------


@pytest.fixture(scope="module")
def budgeted() -> Iterator[tuple[Agent, RunState]]:
    from tasks.start import create_run
    from tests.helpers import memory_context

    with tempfile.TemporaryDirectory(prefix="ratchet-decide-") as directory:
        agent_path = write_agent(
            Path(directory), [turn("x", call("lookup_order", order_id="A1"))],
            budgets={"max_turns": 5, "max_tool_calls": 5, "max_total_tokens": 500,
                     "timeout_seconds": 60},
            extra="max_parallel_tools = 3",
        )  # fmt: skip
        yield load_agent(agent_path), create_run(memory_context(), agent_path, "x")


@settings(max_examples=examples(150),
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    attempts=st.integers(0, 7), tokens=st.integers(0, 700), tool_calls=st.integers(0, 7),
    pending=st.integers(0, 5), late_ms=st.integers(-5_000, 5_000),
    max_turns=st.integers(1, 6), max_tool_calls=st.integers(1, 6),
    max_tokens=st.one_of(st.none(), st.integers(1, 600)),
)  # fmt: skip
def test_decide_never_returns_an_action_a_budget_forbids(
    budgeted: tuple[Agent, RunState], attempts: int, tokens: int, tool_calls: int,
    pending: int, late_ms: int, max_turns: int, max_tool_calls: int, max_tokens: int | None,
) -> None:  # fmt: skip
    agent, created = budgeted
    calls = tuple(
        ToolCall(id=f"call_9_{i}", name="lookup_order", arguments={"order_id": "A1"})
        for i in range(pending)
    )
    state = created.model_copy(
        update={
            "status": RunStatus.TOOLS if calls else RunStatus.MODEL,
            "pending": calls,
            "usage": created.usage.model_copy(
                update={
                    "model_attempts": attempts,
                    "model_turns": min(attempts, 1),
                    "total_tokens": tokens,
                    "tool_calls": tool_calls,
                }
            ),
            "budgets": created.budgets.model_copy(
                update={
                    "max_turns": max_turns,
                    "max_tool_calls": max_tool_calls,
                    "max_total_tokens": max_tokens,
                }
            ),
        }
    )
    now_ms = state.deadline_ms + late_ms
    action = decide(state, agent, now_ms)
    if isinstance(action, CallModel | RunTool):
        assert now_ms <= state.deadline_ms, action
    if isinstance(action, CallModel):
        assert attempts < max_turns
        assert max_tokens is None or tokens < max_tokens
    if isinstance(action, RunTool):
        assert tool_calls + 1 + len(action.also) <= max_tool_calls, action
        assert 1 + len(action.also) <= agent.spec.max_parallel_tools
