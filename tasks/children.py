"""Child runs (see runtime/children.py): start one for a `run_child` call; tell its parent.

``start_child`` is the parent's turn's side: create the child if it is absent
(its id is fixed by the call), enqueue its first turn. ``ratchet.deliver`` is
the child's side: once it has ended, record ``run.woken`` on the parent if the
parent still waits for it, then ``run.parent_told`` on the child. Both are
safe to repeat after a crash at any point, so the sweeper can simply do them
again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from runtime.children import (
    awaiting_delivery,
    child_tree,
    squatted_child,
    waits_for,
    woken_by_child,
)
from runtime.errors import RunBusy, RunNotFound, RunRefused, StaleWrite
from runtime.fsm import apply, created_event
from runtime.models import Event, RunState, ToolCall, validate_run_id
from runtime_io.agent_files import child_agent_path
from store.runs import RunRecord
from tasks.context import Context, get_context
from tasks.control import cancel
from tasks.lease import holding
from tasks.messages import chain_turn
from tasks.persistence import append_events, load
from tasks.task_base import control_task

log = logging.getLogger("ratchet.children")


def start_child(ctx: Context, parent: RunState, call: ToolCall, child_id: str) -> str | None:
    """Record the child run of ``call`` unless it exists, and enqueue its first turn.

    Returns None, or why the call has no child (told to the model as the call's error):
    its id is taken by a run this call did not make (a squatter; starts refuse such ids,
    so only a run from an older build can hold one). A parent cancelled meanwhile gets its
    child cancelled here, at once: the cancel may have looked for it before it existed.
    """
    agent = ctx.agent(parent.agent_file)
    child_agent = ctx.agent(
        child_agent_path(agent.path, agent.spec.children[call.arguments["agent"]])
    )
    now = ctx.runs.clock()
    data = created_event(
        child_id, child_agent, call.arguments["input"], now, tree=child_tree(parent)
    )
    data["parent"] = {"run_id": parent.run_id, "call_id": call.id}
    first = Event(seq=1, type="run.created", at_ms=now, data=data)
    state = apply(None, first)
    due = now + int(ctx.settings.lease_s * 1000)
    model_calls = parent.usage.model_turns
    try:
        ctx.runs.create(RunRecord.from_state(state, now, due), first)
        ctx.snapshots.save(state, None)
    except StaleWrite:
        existing = ctx.runs.events(child_id, after_seq=0, limit=1)
        if not existing:
            raise
        if existing[0].data.get("parent") != data["parent"]:
            log.warning("run %s: child id %s is taken by another run", parent.run_id, child_id)
            return squatted_child(child_id)
        log.info("run %s: child %s of call %s already started", parent.run_id, child_id, call.id)
    if ctx.observers:
        ctx.observers.reached("child.created", model_calls)
    parent_record = ctx.runs.get(parent.run_id)
    if parent_record is None or parent_record.status.is_terminal:
        _cancel_orphan(ctx, parent.run_id, child_id)
        return None
    record = ctx.runs.get(child_id)
    if record is not None and record.last_seq == 1:
        chain_turn(child_id, 1)
    if ctx.observers:
        ctx.observers.reached("child.enqueued", model_calls)
    return None


def _cancel_orphan(ctx: Context, parent_id: str, child_id: str) -> None:
    """The parent ended (cancelled) while its turn made ``child_id``: the child ends too."""
    try:
        cancel(ctx, child_id, f"its parent run {parent_id} was cancelled")
    except (RunNotFound, RunRefused) as exc:
        log.info("run %s: child %s not cancelled: %s", parent_id, child_id, exc)


@control_task(name="ratchet.deliver")
def deliver_run(*, child_id: str) -> str:
    """Tell an ended child's parent how it ended. Returns told | stale | busy."""
    return deliver(get_context(), validate_run_id(child_id))


def deliver(ctx: Context, child_id: str, enqueue: Callable[[str, int], None] | None = None) -> str:
    """:func:`deliver_run`'s work; ``enqueue`` chains the parent's turn (default: the broker)."""
    try:
        child = load(ctx, child_id, set_aside=False).state
    except RunNotFound:
        return "stale"
    if not awaiting_delivery(child):
        return "stale"
    assert child.parent is not None
    outcome = "not waiting"
    parent_record = ctx.runs.get(child.parent)
    if parent_record is not None and parent_record.status.is_suspended:
        try:
            with holding(ctx, parent_record.run_id, patience_s=1.0) as held:
                owner = held.owner
                parent = load(ctx, child.parent).state
                if waits_for(parent, child_id):
                    parent = append_events(
                        ctx, parent, [("run.woken", woken_by_child(child))], owner
                    )
                    outcome = "told"
        except RunBusy:
            log.info("run %s: its parent %s is busy; the sweeper tells it", child_id, child.parent)
            return "busy"
        if outcome == "told":
            (enqueue or chain_turn)(parent.run_id, parent.seq)
    append_events(
        ctx, child, [("run.parent_told", {"parent": child.parent, "outcome": outcome})], None
    )
    log.info("run %s: ended %s; parent %s %s", child_id, child.status.value, child.parent, outcome)
    return "told" if outcome == "told" else "stale"
