"""A run's transcript fills its snapshot: what no longer fits is refused, never saved (issue 30).

A snapshot holds the whole transcript, at most the store's ``max_bytes`` (16 MiB by
default; 200 KiB here). Before the check, the result that took it over raised
SnapshotTooLarge at its checkpoint, and the turn — the tool in it — ran again until the
run was dead-lettered. Now that result is an error result the model reads (the tool ran
once), and a model answer that no longer fits fails the run, with
``SNAPSHOT_RESERVE_BYTES`` kept for the error results that say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.fsm import rebuild
from runtime.models import RunStatus
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent

pytestmark = pytest.mark.timeout(60)


def test_a_result_past_what_the_snapshot_holds_is_an_error_result_and_then_the_run_fails(
    tmp_path: Path, ledger: Path
) -> None:
    # Given a snapshot store that holds 200 KiB, and a model that asks for four 40 KiB
    # results one after another, then answers with 30 KiB of text
    ctx = memory_context()
    ctx.snapshots.max_bytes = 200 * 1024
    script = [turn(f"fetch {i}", call("sized", kib=40)) for i in range(4)]
    agent = write_agent(
        tmp_path, [*script, turn("y" * 30 * 1024)], tools=["tests.hostile_tools:sized"]
    )
    run_id = create_run(ctx, agent, "fill it").run_id
    # When the run goes through the turn loop
    done = drive(ctx, run_id)
    # Then every tool ran once: three results fit, the fourth is an error result
    assert ledger.read_text().splitlines() == ["sized 40"] * 4
    events = ctx.runs.events(run_id)
    assert [e.type for e in events].count("tool.completed") == 3
    [failed] = [e.data["error"] for e in events if e.type == "tool.failed"]
    assert failed.startswith("`sized` ran, but its result (")
    assert "does not fit: the snapshot has" in failed and "start a new run" in failed
    # And the model's answer, which no longer fits either, failed the run: once, cleanly
    assert done.outcome == "failed"
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.FAILED
    assert record.error is not None and "the model's answer (" in record.error
    assert record.usage.model_attempts == 5
    state = rebuild(events)
    assert state is not None and state.status == RunStatus.FAILED
