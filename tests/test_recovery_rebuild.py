"""Property: folding a run's events gives exactly the snapshot saved at that point.

Random scripted runs — tool calls that succeed, fail, or are unknown; control
tools and approvals that suspend the run, answered by appending
``run.continued`` directly (the snapshot is then stale, and the next turn heals
it); budgets that end the run; scripts that run out (a provider error) — and
for every prefix of the event log the fold succeeds, and wherever a snapshot
was saved, the fold of that prefix equals it: the snapshot is only a cache of
the fold (runtime/fsm.py).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.fsm import rebuild
from runtime.models import RunState, RunStatus
from store.snapshots import format as snapshot_format
from tasks.persistence import append_events, load
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent

CALLS = st.sampled_from(
    [
        call("lookup_order", order_id="A1"),
        call("lookup_order", order_id="ZZ"),
        call("lookup_order", order="A1"),
        call("issue_refund", order_id="B2", amount_cents=1),
        call("refund_policy", reason="lost"),
        call("request_user_input", prompt="which order?"),
        call("blocked", reason="need a manager"),
        call("no_such_tool"),
    ]
)
TURNS = st.lists(
    st.builds(
        lambda calls, n: turn(f"turn {n}", *calls), st.lists(CALLS, max_size=3), st.integers(0, 9)
    ),
    min_size=0,
    max_size=5,
).map(lambda turns: [*turns, turn("done")])
RUNS = st.fixed_dictionaries(
    {
        "turns": TURNS,
        "truncate": st.booleans(),
        "max_turns": st.integers(1, 7),
        "max_tool_calls": st.integers(0, 8),
        "approval": st.booleans(),
        "answers": st.lists(st.booleans(), min_size=8, max_size=8),
    }
)


@contextmanager
def ledger_in(directory: Path) -> Iterator[None]:
    before = os.environ.get("RATCHET_EXAMPLE_LEDGER")
    os.environ["RATCHET_EXAMPLE_LEDGER"] = str(directory / "ledger")
    try:
        yield
    finally:
        if before is None:
            del os.environ["RATCHET_EXAMPLE_LEDGER"]
        else:
            os.environ["RATCHET_EXAMPLE_LEDGER"] = before


def answer(state: RunState, approve: bool) -> dict[str, Any]:
    assert state.suspension is not None
    if state.suspension.reason == RunStatus.AWAITING_APPROVAL:
        return {"approved": approve, "reason": None if approve else "not today", "suspended_ms": 5}
    return {"input": "order A1", "continuation_id": f"c{state.seq}", "suspended_ms": 5}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(RUNS)
def test_every_prefix_of_a_runs_events_folds_to_the_snapshot_saved_there(
    run: dict[str, Any],
) -> None:
    with tempfile.TemporaryDirectory() as directory, ledger_in(Path(directory)):
        turns = run["turns"][:-1] if run["truncate"] else run["turns"]
        agent = write_agent(
            Path(directory),
            turns,
            budgets={"max_turns": run["max_turns"], "max_tool_calls": run["max_tool_calls"]},
            require_approval=["issue_refund"] if run["approval"] else [],
        )
        ctx = memory_context()
        saved: dict[int, RunState] = {}
        save = ctx.snapshots.save

        def spy(state: RunState, expected_seq: int | None) -> None:
            save(state, expected_seq)
            # What a later load would read: the state through the snapshot format.
            saved[state.seq] = snapshot_format.decode(
                snapshot_format.encode(state, ctx.snapshots.max_bytes), "spy"
            )

        ctx.snapshots.save = spy  # type: ignore[method-assign]
        run_id = create_run(ctx, agent, "help me").run_id
        for approve in run["answers"]:
            outcome = drive(ctx, run_id).outcome
            if outcome != "suspended":
                break
            loaded = load(ctx, run_id)
            append_events(
                ctx, loaded.state, [("run.continued", answer(loaded.state, approve))], None
            )

        events = ctx.runs.events(run_id)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        for end in range(1, len(events) + 1):
            folded = rebuild(events[:end])
            assert folded is not None and folded.seq == end
            if end in saved:
                assert folded == saved[end], f"prefix {end} of {[e.type for e in events]}"
        assert saved, "at least the first snapshot is saved"
        final = rebuild(events)
        record = ctx.runs.get(run_id)
        assert final is not None and record is not None and final.status == record.status
