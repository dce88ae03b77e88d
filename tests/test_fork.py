"""Fork: a new run at another run's state at a seq, driven in-process on memory stores.

The scripted model answers by turn index, so a fork that carries on from the
original's state reaches exactly the original's transcript: that is what
"the fork is the original at that seq" means for a deterministic model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.continuation import make_continuation
from runtime.errors import BindingChanged, RunNotFound, RunRefused
from runtime.fsm import rebuild
from runtime.models import Event, RunState, RunStatus
from tasks.context import Context
from tasks.control import apply_continuation
from tasks.fork import fork
from tasks.start import create_run
from tests.helpers import call, drive, memory_context, turn, write_agent

LOOKUP = call("lookup_order", order_id="B2")
REFUND = call("issue_refund", order_id="B2", amount_cents=2900)
SCRIPT = [turn("Looking.", LOOKUP), turn("Refunding.", REFUND), turn("Refunded B2.")]


def events(ctx: Context, run_id: str) -> list[Event]:
    return list(ctx.runs.events(run_id, after_seq=0))


def state_of(ctx: Context, run_id: str) -> RunState:
    state = rebuild(events(ctx, run_id))
    assert state is not None
    return state


def no_enqueue(run_id: str, seq: int) -> None:
    """The tests take the fork's turns themselves."""


def completed_run(ctx: Context, tmp_path: Path) -> str:
    agent = write_agent(tmp_path, SCRIPT, name="forkable")
    run_id = create_run(ctx, agent, "Refund order B2", "original").run_id
    assert drive(ctx, run_id).outcome == "completed"
    return run_id


def seq_of(log: list[Event], kind: str, nth: int = 0) -> int:
    return [e.seq for e in log if e.type == kind][nth]


def relabelled(state: RunState) -> dict[str, object]:
    """What a fork must share with the original at the fork point."""
    dump = state.model_dump(mode="json")
    for key in ("run_id", "seq", "created_at_ms", "recovery_attempts", "suspension"):
        dump.pop(key)
    return dump


@pytest.mark.parametrize(
    "point",
    ["after the first answer", "after the lookup", "after the refund's answer"],
)
def test_a_fork_starts_at_the_originals_state_and_reaches_its_transcript(
    tmp_path: Path, ledger: Path, point: str
) -> None:
    # Given a completed run
    ctx = memory_context()
    original = completed_run(ctx, tmp_path)
    log = events(ctx, original)
    at = {
        "after the first answer": seq_of(log, "model.responded", 0),
        "after the lookup": seq_of(log, "tool.completed", 0),
        "after the refund's answer": seq_of(log, "model.responded", 1),
    }[point]
    # When it is forked at a seq
    forked = fork(ctx, original, at, f"fork-{at}", enqueue=no_enqueue)
    # Then the fork is the original's state there, under its own id, at its own seq 1
    assert forked.state.run_id == f"fork-{at}" and forked.state.seq == 1
    assert relabelled(forked.state) == relabelled(rebuild(log[:at]))  # type: ignore[arg-type]
    # and carried on, it reaches the original's transcript
    assert drive(ctx, forked.state.run_id).outcome == "completed"
    fork_state = state_of(ctx, forked.state.run_id)
    assert fork_state.transcript == state_of(ctx, original).transcript
    assert fork_state.output == "Refunded B2."
    # while the original is untouched
    assert events(ctx, original) == log


def test_forking_before_a_refund_the_original_made_says_it_will_refund_again(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    original = completed_run(ctx, tmp_path)
    assert ledger.read_text().splitlines() == ["refund B2 2900"]
    log = events(ctx, original)
    # Given a fork point after the model asked for the refund and before it ran
    at = seq_of(log, "model.responded", 1)
    forked = fork(ctx, original, at, "fork-refund", enqueue=no_enqueue)
    # Then the fork says so, naming the call and where the original ran it
    refunded_at = seq_of(log, "tool.completed", 1)
    assert forked.notes == (
        f"the fork will run `issue_refund` (call call_2_1) again: the original ran it at seq "
        f"{refunded_at}, and it is not idempotent",
    )
    # and does exactly that when it runs
    drive(ctx, forked.state.run_id)
    assert ledger.read_text().splitlines() == ["refund B2 2900", "refund B2 2900"]


def test_a_fork_after_the_effect_does_not_repeat_it(tmp_path: Path, ledger: Path) -> None:
    ctx = memory_context()
    original = completed_run(ctx, tmp_path)
    at = seq_of(events(ctx, original), "tool.completed", 1)
    forked = fork(ctx, original, at, "fork-after", enqueue=no_enqueue)
    assert forked.notes == ()
    drive(ctx, forked.state.run_id)
    assert ledger.read_text().splitlines() == ["refund B2 2900"]


def test_a_fork_is_refused_where_a_call_was_in_flight_or_the_run_had_ended(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    original = completed_run(ctx, tmp_path)
    log = events(ctx, original)
    in_flight = seq_of(log, "tool.requested", 1)
    with pytest.raises(RunRefused, match=r"running call call_2_1 at seq \d+: whether that call"):
        fork(ctx, original, in_flight, "fork-in-flight", enqueue=no_enqueue)
    with pytest.raises(
        RunRefused, match=r"completed at seq \d+: a fork starts from a live or suspended state"
    ):
        fork(ctx, original, None, "fork-end", enqueue=no_enqueue)
    with pytest.raises(RunRefused, match=r"its log has seqs 1 to \d+, not 999"):
        fork(ctx, original, 999, "fork-beyond", enqueue=no_enqueue)
    with pytest.raises(RunNotFound):
        fork(ctx, "no-such-run", 1, "fork-nothing", enqueue=no_enqueue)
    # and nothing was created by any refusal
    for refused in ("fork-in-flight", "fork-end", "fork-beyond", "fork-nothing"):
        assert ctx.runs.get(refused) is None


def test_a_changed_agent_needs_rebind_and_the_fork_then_runs_under_it(
    tmp_path: Path, ledger: Path
) -> None:
    ctx = memory_context()
    original = completed_run(ctx, tmp_path)
    at = seq_of(events(ctx, original), "tool.completed", 0)
    # Given the agent's script was edited since the run started
    script = tmp_path / "forkable.script.json"
    edited = [*SCRIPT[:2], turn("Refunded B2, and sorry for the wait.")]
    script.write_text(json.dumps({"turns": edited}))
    # When it is forked without --rebind, it is refused, saying what changed
    with pytest.raises(BindingChanged, match=r"changed: provider; fork with --rebind"):
        fork(ctx, original, at, "fork-stale", enqueue=no_enqueue)
    assert ctx.runs.get("fork-stale") is None
    # With it, the fork runs under the agent as it is now
    forked = fork(ctx, original, at, "fork-rebound", rebind=True, enqueue=no_enqueue)
    assert forked.state.binding != state_of(ctx, original).binding
    drive(ctx, "fork-rebound")
    assert state_of(ctx, "fork-rebound").output == "Refunded B2, and sorry for the wait."
    assert events(ctx, "fork-rebound")[0].data["fork"]["rebind"] is True


def test_a_fork_of_a_suspended_run_answers_its_own_suspension(tmp_path: Path) -> None:
    ctx = memory_context()
    agent = write_agent(
        tmp_path,
        [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")],
        name="asks",
    )
    original = create_run(ctx, agent, "Refund my order", "asking").run_id
    assert drive(ctx, original).outcome == "suspended"
    # Given a fork of the suspended run
    forked = fork(ctx, original, None, "asking-fork", enqueue=no_enqueue)
    assert forked.state.status == RunStatus.NEEDS_USER_INPUT
    assert forked.state.suspension is not None and forked.state.suspension.seq == 1
    # When the fork's question is answered (its suspension is at the fork's seq 1)
    answer = make_continuation("asking-fork", "c-1", input="B2", suspension_seq=1)
    assert apply_continuation(ctx, answer, no_enqueue) == "continued"
    # Then the fork completes and the original still waits for its own answer
    assert drive(ctx, "asking-fork").outcome == "completed"
    assert state_of(ctx, original).status == RunStatus.NEEDS_USER_INPUT


def test_a_fork_waits_for_a_person_as_long_as_the_agent_it_runs_under_allows(
    tmp_path: Path,
) -> None:
    ctx = memory_context()
    ask = [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")]
    agent = write_agent(tmp_path, ask, name="asks", extra="max_suspended_s = 60")
    original = create_run(ctx, agent, "Refund my order", "asking").run_id
    assert drive(ctx, original).outcome == "suspended"
    assert state_of(ctx, original).max_suspended_s == 60
    # Given the agent's limit was changed since the run started
    write_agent(tmp_path, ask, name="asks", extra="max_suspended_s = 600")
    # When the suspended run is forked under the agent as it is now
    forked = fork(ctx, original, None, "asking-fork", rebind=True, enqueue=no_enqueue)
    # Then the fork has the new limit, the original keeps its own
    assert forked.state.max_suspended_s == state_of(ctx, "asking-fork").max_suspended_s == 600
    assert state_of(ctx, original).max_suspended_s == 60


def test_a_fork_of_a_fork_folds_its_whole_lineage(tmp_path: Path, ledger: Path) -> None:
    ctx = memory_context()
    original = completed_run(ctx, tmp_path)
    first = fork(
        ctx,
        original,
        seq_of(events(ctx, original), "tool.completed", 0),
        "gen-1",
        enqueue=no_enqueue,
    )
    drive(ctx, first.state.run_id)
    second = fork(
        ctx,
        "gen-1",
        seq_of(events(ctx, "gen-1"), "model.responded", 0),
        "gen-2",
        enqueue=no_enqueue,
    )
    assert second.state.run_id == "gen-2"
    assert events(ctx, "gen-2")[0].data["fork"]["run_id"] == "gen-1"
    drive(ctx, "gen-2")
    assert state_of(ctx, "gen-2").transcript == state_of(ctx, original).transcript
