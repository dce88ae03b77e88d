"""Outcome probes and the tool context, in-process: declaring them, and a timeout probed.

The crash cases (a worker killed with a call unknown) are tests/crash/test_probes.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from runtime import NotRun, ToolContext, tool
from runtime.actions import TOOL_TIMEOUT_ATTEMPTS
from runtime.errors import ToolError
from runtime.models import RunStatus
from runtime.probes import idempotency_key
from runtime.tools import spec_from_function
from runtime_io.tools import invoke
from tasks.control import cancel
from tasks.start import create_run
from tasks.turn import advance
from tests.helpers import call, drive, memory_context, turn, write_agent

TOOLS = ["tests.probed_tools:effect", "tests.probed_tools:effect_unknown",
         "tests.probed_tools:timed_effect"]  # fmt: skip


@pytest.fixture
def effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "effects"
    monkeypatch.setenv("RATCHET_TEST_EFFECTS", str(path))
    monkeypatch.setenv("RATCHET_TEST_TIMES", str(tmp_path / "times"))
    return path


def keys(effects: Path) -> list[str]:
    return (
        [line.split()[0] for line in effects.read_text().splitlines()] if effects.exists() else []
    )


def test_the_tool_context_is_no_part_of_the_schema_and_carries_the_calls_key() -> None:
    seen: list[ToolContext] = []

    def probe_it(call: ToolContext) -> NotRun:
        return NotRun()

    @tool(probe=probe_it)
    def charge(amount: int, call: ToolContext) -> int:
        seen.append(call)
        return amount

    spec = spec_from_function(charge, "mine:charge")
    assert spec.parameters["properties"] == {"amount": {"type": "integer"}}
    assert spec.declaration()["probe"] is True
    context = ToolContext("run-1", "call_1_1", idempotency_key("run-1", 1, "call_1_1"))
    assert invoke(spec, {"amount": 5}, context).result == 5
    assert seen == [context]
    # The model cannot set it: it is an unknown argument like any other
    assert not invoke(spec, {"amount": 5, "call": {}}, context).ok


def test_a_probe_that_takes_what_the_tool_does_not_is_refused_at_load() -> None:
    def probe_it(order: str) -> NotRun:
        return NotRun()

    @tool(probe=probe_it)
    def refund(order_id: str) -> None:
        """Refund."""

    with pytest.raises(ToolError, match="its probe takes `order`"):
        spec_from_function(refund, "mine:refund")


def test_a_tool_without_a_probe_keeps_the_declaration_its_runs_were_bound_to() -> None:
    @tool
    def refund(order_id: str) -> None:
        """Refund."""

    assert "probe" not in spec_from_function(refund, "mine:refund").declaration()


def test_a_call_that_times_out_after_its_effect_is_probed_and_recorded_not_run_again(
    tmp_path: Path, effects: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a non-idempotent call that has its effect, then is slow to return
    monkeypatch.setenv("RATCHET_TEST_SLOW_LABEL", "slow")
    monkeypatch.setenv("RATCHET_TEST_SLOW_S", "3")
    agent = write_agent(tmp_path, [turn("go", call("effect", label="slow")), turn("Done.")],
                        tools=TOOLS, extra="tool_timeout_s = 0.5")  # fmt: skip
    ctx = memory_context()
    run_id = create_run(ctx, agent, "go").run_id
    # When its wait times out, the worker asks the probe, which finds the effect
    assert drive(ctx, run_id).outcome == "completed"
    events = ctx.runs.events(run_id)
    probed = [e.data for e in events if e.type == "tool.probed"]
    assert [(p["call_id"], p["answer"]) for p in probed] == [("call_1_1", "ran")]
    # Then the run goes on with the probe's result, and the effect happened once
    assert keys(effects) == [idempotency_key(run_id, 1, "call_1_1")]
    assert not [e for e in events if e.type in ("tool.completed", "run.parked")]


def test_a_call_that_times_out_with_a_probe_that_cannot_tell_parks_naming_it(
    tmp_path: Path, effects: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_TEST_SLOW_LABEL", "slow")
    monkeypatch.setenv("RATCHET_TEST_SLOW_S", "3")
    agent = write_agent(
        tmp_path,
        [turn("go", call("effect", label="a"), call("effect_unknown", label="slow")),
         turn("Done.")],
        tools=TOOLS, extra="tool_timeout_s = 0.5",
    )  # fmt: skip
    ctx = memory_context()
    run_id = create_run(ctx, agent, "go").run_id
    assert drive(ctx, run_id).outcome == "parked"
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.NEEDS_RECONCILIATION
    assert "(call call_1_2) did not return within 0.5 s" in (record.error or "")
    assert "its probe answered unknown" in (record.error or "")
    # The call that finished is recorded once and stays so
    done = [e.data["call_id"] for e in ctx.runs.events(run_id) if e.type == "tool.completed"]
    assert done == ["call_1_1"]


@pytest.mark.timeout(60)
def test_a_hanging_call_whose_probe_says_not_run_gets_exactly_the_documented_tries(
    tmp_path: Path, effects: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a non-idempotent call that hangs before its effect on every try, and a probe
    # that truthfully answers "not run" each time
    monkeypatch.setenv("RATCHET_TEST_HANG_LABEL", "hangs")
    agent = write_agent(tmp_path, [turn("go", call("effect", label="hangs")), turn("Done.")],
                        tools=TOOLS, extra="tool_timeout_s = 0.2")  # fmt: skip
    ctx = memory_context()
    run_id = create_run(ctx, agent, "go").run_id
    # When the run is driven
    assert drive(ctx, run_id).outcome == "parked"
    # Then the call was tried TOOL_TIMEOUT_ATTEMPTS times in all, probed between tries
    # (each abandoned try is free to take effect later: the count is the bound on that)
    events = ctx.runs.events(run_id)
    probed = [e.data["answer"] for e in events if e.type == "tool.probed"]
    assert probed == ["not_run"] * (TOOL_TIMEOUT_ATTEMPTS - 1)
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.NEEDS_RECONCILIATION
    assert "its probe answered not run, but the call was out of tries" in (record.error or "")


def test_a_cancel_during_parallel_calls_stops_the_turn_before_it_records_another_outcome(
    tmp_path: Path, effects: Path
) -> None:
    # Given three parallel calls of a second and a half
    calls = [call("timed_effect", label=x, sleep_s=1.5) for x in "abc"]
    agent = write_agent(tmp_path, [turn("go", *calls), turn("Done.")], tools=TOOLS)
    ctx = memory_context()
    run_id = create_run(ctx, agent, "go").run_id

    def cancel_once_requested() -> None:
        deadline = time.monotonic() + 30
        while not any(e.type == "tool.requested" for e in ctx.runs.events(run_id)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cancel(ctx, run_id, "the customer called")

    canceller = threading.Thread(target=cancel_once_requested)
    canceller.start()
    # When an operator cancels the run while they run
    done = advance(ctx, run_id, None)
    canceller.join()
    # Then the turn stops at its next write: nothing is recorded after the cancel
    assert done.outcome == "fenced"
    events = ctx.runs.events(run_id)
    assert events[-1].type == "run.cancelled"
    assert not [e for e in events if e.type == "tool.completed"]


def test_only_a_probe_that_found_the_effect_counts_as_progress_for_dead_lettering() -> None:
    from runtime.models import Event
    from runtime.recovery import consecutive_recoveries

    def log(answer: str) -> list[Event]:
        kinds = [("run.resumed", {"by": "sweeper"}),
                 ("tool.probed", {"call_id": "c", "name": "t", "answer": answer}),
                 ("run.resumed", {"by": "sweeper"})]  # fmt: skip
        return [Event(seq=i + 2, type=k, at_ms=0, data=d) for i, (k, d) in enumerate(kinds)]

    assert len(consecutive_recoveries(log("ran"))) == 1
    assert len(consecutive_recoveries(log("not_run"))) == 2
