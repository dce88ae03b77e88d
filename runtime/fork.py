"""Fork: a new run whose state is another run's state at a chosen seq. Pure.

The fork's whole lineage is its first event. ``run.created`` carries
``fork = {"run_id", "seq", "events"}``: the original's events up to that seq,
which the fold replays to get the base state, then re-labels as the new run
(its id, its own seq 1, a creation time of now, the binding it runs under).
So a fork is written in one atomic create — a crash can never leave a fork
with only half of its history, which a sweeper would then run from scratch —
and its log is readable on its own, forever, like any other.

What the fork keeps: the transcript, the pending tool calls and approvals,
usage (budgets go on counting from where the original was), time suspended
and an open suspension (re-numbered to the fork's seq 1, so a continuation
answers it as ``suspension_seq=1``). What it refuses: a seq outside the log, a
state that has ended (completed, failed, cancelled, parked, stalled,
dead-lettered: fork at an earlier seq), and a seq where a tool call was in
flight with no recorded outcome (whether it ran is unknown: fork just before
it to run it again, or just after its outcome).

Forking before a tool call that is not idempotent is allowed, and said: the
fork will run it again although the original already did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runtime.agent import Agent, describe_binding_change
from runtime.errors import BindingChanged, EventsDoNotFold, RunRefused
from runtime.models import Budgets, Event, RunState

Fold = Callable[[list[Event]], RunState | None]

FORK_KEY = "fork"
"""The key of ``run.created``'s data that makes a run a fork."""


@dataclass(frozen=True)
class ForkPlan:
    first: Event
    """The fork's ``run.created``; folding it alone gives the fork's state."""
    notes: tuple[str, ...]
    """What an operator should know before the fork runs (calls it will repeat)."""


def fold_fork(created: Event, fold: Fold) -> RunState:
    """The state a fork's ``run.created`` describes (``fold`` is :func:`runtime.fsm.rebuild`)."""
    data = created.data
    lineage = data[FORK_KEY]
    base = fold([Event.model_validate(e) for e in lineage["events"]])
    if base is None:
        raise EventsDoNotFold(data["run_id"], created.seq, "a fork's run.created holds no events")
    suspension = base.suspension
    if suspension is not None:
        suspension = suspension.model_copy(update={"seq": created.seq, "since_ms": created.at_ms})
    return base.model_copy(
        update={
            "run_id": data["run_id"],
            "seq": created.seq,
            "agent": data["agent"],
            "agent_file": data["agent_file"],
            "binding": data["binding"],
            "budgets": Budgets.model_validate(data["budgets"]),
            "created_at_ms": data["created_at_ms"],
            "suspension": suspension,
            "recovery_attempts": 0,
            # The fork's own binding's, not the original's (it may run under another).
            "max_suspended_s": data.get("max_suspended_s"),
        }
    )


def plan_fork(
    events: list[Event],
    at_seq: int | None,
    new_run_id: str,
    agent: Agent,
    now_ms: int,
    fold: Fold,
    *,
    rebind: bool = False,
) -> ForkPlan:
    """The first event of a fork of the run whose log is ``events``, at ``at_seq`` (default: last).

    ``agent`` is the agent file as it is now; the fork runs under it. Raises
    RunRefused for a seq that cannot be forked, BindingChanged when the agent
    changed since the original started and ``rebind`` is not set.
    """
    original = events[0].data["run_id"]
    last = events[-1].seq
    seq = last if at_seq is None else at_seq
    if not 1 <= seq <= last:
        raise RunRefused(original, "not forkable there", f"its log has seqs 1 to {last}, not {seq}")
    upto = events[:seq]
    base = fold(upto)
    assert base is not None  # upto holds run.created at least
    _check_forkable(base, seq)
    created = events[0].data
    if agent.binding != created["binding"] and not rebind:
        change = describe_binding_change(
            created.get("binding_document", {}), agent.binding_document
        )
        raise BindingChanged(original, agent.name, f"{change}; fork with --rebind to run under it")
    data = {
        "run_id": new_run_id,
        "agent": agent.name,
        "agent_file": str(agent.path),
        "binding": agent.binding,
        "binding_document": agent.binding_document,
        "budgets": agent.spec.budgets.model_dump(mode="json"),
        "input": base.input,
        "system": created.get("system"),
        "created_at_ms": now_ms,
        FORK_KEY: {
            "run_id": original,
            "seq": seq,
            "rebind": agent.binding != created["binding"],
            "events": [e.model_dump(mode="json") for e in upto],
        },
    }
    if agent.spec.max_suspended_s is not None:
        data["max_suspended_s"] = agent.spec.max_suspended_s
    first = Event(seq=1, type="run.created", at_ms=now_ms, data=data)
    return ForkPlan(first, tuple(_repeats(base, events[seq:], agent)))


def _check_forkable(state: RunState, seq: int) -> None:
    if not (state.status.is_live or state.status.is_suspended):
        raise RunRefused(
            state.run_id,
            f"{state.status.value} at seq {seq}",
            "a fork starts from a live or suspended state: fork at an earlier seq (`ratchet runs events` "
            "lists them)",
        )
    if state.in_flight is not None:
        raise RunRefused(
            state.run_id,
            f"running call {state.in_flight} at seq {seq}",
            "whether that call ran is unknown there: fork one seq earlier to run it again, "
            "or at the seq of its outcome",
        )


def _repeats(base: RunState, later: list[Event], agent: Agent) -> list[str]:
    """The pending calls the original ran after the fork point that are not idempotent."""
    ran = {
        e.data.get("call_id"): e.seq
        for e in later
        if e.type in ("tool.completed", "tool.failed", "tool.reconciled")
    }
    notes = []
    for call in base.pending:
        spec = agent.tools.get(call.name)
        if call.id in ran and spec is not None and not spec.idempotent and not spec.control:
            notes.append(
                f"the fork will run `{call.name}` (call {call.id}) again: the original ran it "
                f"at seq {ran[call.id]}, and it is not idempotent"
            )
    return notes
