"""``ratchet.turn``: one turn of a run. Read top to bottom, this is a run's life.

1. **Arrival** (:func:`run_turn`): the message names the run and the seq it expects.
2. **Lease** (:func:`advance`, tasks/lease.py): taken, or taken from a holder
   whose process died (the run is then recovered as the sweeper would); held by
   another worker, this message is a duplicate: do nothing. Where this process
   chained the turn, the model call's journal goes with it (tasks/ahead.py).
3. **Load** (tasks/held_run.py, :func:`tasks.persistence.load`): the snapshot with the
   events it lacks folded on. Not at the seq the message expects: a late or
   duplicate message, do nothing.
4. **Decide, carry out** (:func:`take`): :func:`runtime.fsm.decide` returns one
   action of runtime/actions.py; :func:`perform` does it — the model call
   (tasks/held_run.py), the tool calls side by side (tasks/tools_parallel.py) — and
   records it. A step that goes wrong asks runtime/actions.py what follows.
5. **Checkpoint** (``HeldRun.checkpointed``): events and snapshot, fenced by lease
   and seq; the turn's last checkpoint takes the lease's release along.
6. **Enqueue the next turn** (:func:`enqueue_next`, tasks/messages.py), carrying the seq it
   must find; on one Redis for broker and stores, the last checkpoint pushed it already.

To follow one message to the next and the saved snapshot, read the files
docs/architecture.md lists, in its order (tests/integration/test_turn_trace.py checks that
list against the files a real turn runs).
"""

from __future__ import annotations

import logging
import time

from runtime.actions import (
    Action,
    Advanced,
    CallModel,
    CheckBinding,
    Idle,
    RefuseCall,
    RunTool,
    StartChild,
    Suspend,
    TurnOutcome,
    Unresolved,
)
from runtime.errors import ClockSkewed, LeaseLost, StaleWrite
from runtime.fsm import ends_turn, suspension_event, tool_events
from runtime.models import RunStatus, validate_run_id
from runtime.recovery import SWEEPER
from runtime.tools import ToolOutcome
from tasks import lease, limits, resumption
from tasks.ahead import journal_ahead
from tasks.children import start_child
from tasks.context import Context, get_context
from tasks.held_run import AgentNotLoaded, HeldRun, stopping
from tasks.messages import enqueue_turn
from tasks.persistence import append_events
from tasks.task_base import ratchet_task
from tasks.timers import schedule_wake
from tasks.tools_parallel import resolve, run_tools

log = logging.getLogger("ratchet.turn")

SKEWED_COUNTDOWN_S = 5.0
"""How long a turn refused for this host's clock waits on the queue before it is tried again."""


@ratchet_task(name="ratchet.turn")
def run_turn(*, run_id: str, expected_seq: int | None) -> str:
    """Advance ``run_id`` by one turn if it is at ``expected_seq``.

    Idempotent: a duplicate, late or concurrent delivery does nothing.
    Raises SnapshotFailed (fail-stop) when a checkpoint cannot be saved.
    """
    ctx = get_context()
    redelivered = bool((run_turn.request.delivery_info or {}).get("redelivered"))
    started = time.perf_counter()
    try:
        done = advance(ctx, validate_run_id(run_id), expected_seq, redelivered=redelivered)
    except ClockSkewed:
        # This host takes no lease (tasks/liveness.py logged why): the turn goes back on
        # the queue for a worker whose clock agrees with the store's, or for this one later.
        enqueue_turn(run_id=run_id, expected_seq=expected_seq, countdown_s=SKEWED_COUNTDOWN_S)
        return TurnOutcome.LEASED.value
    if ctx.observers:
        seconds = time.perf_counter() - started
        ctx.observers.turn_ended(done.outcome, seconds, throttled=done.countdown_s > 0)
    if done.outcome == TurnOutcome.NEXT:
        enqueue_next(ctx, run_id, done)
    return done.outcome.value


def enqueue_next(ctx: Context, run_id: str, done: Advanced) -> None:
    """Enqueue the next turn; it will act only if the run is still at ``done.seq``.

    One path for every turn that follows another: at once, or after ``countdown_s``
    when the turn waited on a limit (a broker-held countdown, no worker slot). A turn
    whose last checkpoint pushed it already (``done.queued``, tasks/held_run.py) is not
    sent again.
    """
    observers = ctx.observers
    if observers:
        observers.reached("turn.ended", done.turns)
    if done.queued:
        if observers:
            observers.reached("turn.enqueued", done.turns)
        return
    enqueue_turn(
        run_id=run_id, expected_seq=done.seq, priority=done.priority, countdown_s=done.countdown_s
    )
    if observers:
        observers.reached("turn.enqueued", done.turns)


def advance(
    ctx: Context,
    run_id: str,
    expected_seq: int | None,
    owner: str | None = None,
    redelivered: bool = False,
) -> Advanced:
    """Take the lease, take one turn, release the lease. Does not enqueue the next turn.

    ``next`` means the turn ended with the next model call due: the caller enqueues it.
    ``owner``: a caller that already holds the lease (a resume) passes its owner id.
    ``redelivered``: the broker delivers this message again (its consumer died), so
    a holder of the lease is waited for until its process is known dead or alive.
    """
    # Where this process left the run, its first write goes with the lease (tasks/ahead.py).
    ahead = journal_ahead(ctx, run_id, expected_seq) if owner is None else None
    with lease.holding(
        ctx,
        run_id,
        owner,
        patience_s=lease.TURN_PATIENCE_S,
        until_dead_s=ctx.settings.liveness_s if redelivered else 0.0,
        must=False,
        recovers=True,
        reads_snapshot=True,
        ahead=ahead,
    ) as claim:
        if claim.took_from is not None:
            # The holder's process died mid-turn: recover the run here and now, as the
            # sweeper would (counted towards dead-lettering), instead of waiting for it.
            claim.released = True  # the recovery lets the lease go itself
            resumed = resumption.recover(ctx, run_id, SWEEPER, owner=claim.owner)
            if isinstance(resumed, Advanced):
                return resumed
            return advance(ctx, run_id, resumed.seq, owner=resumed.owner)
        if not claim.taken:
            reason = claim.busy.reason if claim.busy is not None else "lease held"
            log.info("run %s: %s; this delivery is a duplicate", run_id, reason)
            return Advanced(TurnOutcome.LEASED, -1, 0)
        held: HeldRun | None = None
        try:
            try:
                if claim.journaled and ahead is not None:
                    held = HeldRun.journaled(ctx, claim.owner, ahead)
                    expected_seq = held.state.seq  # the journal's fences proved the run there
                elif claim.record:
                    held = HeldRun.open(ctx, run_id, claim.owner, claim.record, claim.snapshot)
            except AgentNotLoaded as exc:
                return _not_loaded(ctx, exc, expected_seq, claim.owner)
            if held is None:
                log.warning("run %s: no such run; dropping the message", run_id)
                return Advanced(TurnOutcome.MISSING, -1, 0)
            if expected_seq is not None and held.state.seq != expected_seq:
                log.info(
                    "run %s: message expects seq %s but the run is at %s; a late or duplicate "
                    "message, ignored",
                    run_id,
                    expected_seq,
                    held.state.seq,
                )
                return Advanced(TurnOutcome.STALE, held.state.seq, held.state.usage.model_turns)
            with held.heartbeat():
                held.adopt()
                outcome = take(held)
            limits.turn_ended(ctx, held.agent, held.state)
            wait = held.waited if outcome == TurnOutcome.NEXT else None
            countdown_s = wait.countdown_s if wait is not None else 0.0
            queued = held.queued and outcome == TurnOutcome.NEXT
            # A turn its last checkpoint pushed went at the priority reckoned then.
            priority = None if queued else limits.turn_priority(ctx, held.agent, held.state)
            return Advanced(
                outcome,
                held.state.seq,
                held.state.usage.model_turns,
                countdown_s,
                priority,
                queued=queued,
            )
        except (LeaseLost, StaleWrite) as exc:
            # A zombie: our lease expired and another worker moved the run on.
            log.warning("%s", exc)
            return Advanced(TurnOutcome.FENCED, -1, 0)
        finally:
            claim.released = held is not None and held.released


def _not_loaded(
    ctx: Context, exc: AgentNotLoaded, expected_seq: int | None, owner: str
) -> Advanced:
    """The run's agent could not be loaded for its turn: it stalls with the one-line reason
    (not a traceback the sweeper would meet again), unless the message was a late one."""
    state = exc.state
    if (expected_seq is not None and state.seq != expected_seq) or not state.status.is_live:
        return Advanced(TurnOutcome.STALE, state.seq, state.usage.model_turns)
    log.warning("run %s: %s", state.run_id, exc.reason)
    state = append_events(ctx, state, [("run.stalled", {"reason": exc.reason})], owner)
    return Advanced(TurnOutcome.STALLED, state.seq, state.usage.model_turns)


def take(held: HeldRun) -> TurnOutcome:
    """Carry out decisions until the turn ends; how it ended."""
    while not held.released:  # the last checkpoint let the lease go: the next turn decides
        action = held.next_action()
        # A call journaled with the lease is made: it is counted already (tasks/ahead.py).
        counted = held.ahead is not None and action is held.ahead.action
        if stopping() and not counted and not isinstance(action, (CheckBinding, Idle)):
            log.info(
                "run %s: worker shutting down; stopping at seq %s and chaining the rest",
                held.state.run_id,
                held.state.seq,
            )
            return TurnOutcome.NEXT
        ended = perform(held, action)
        if ended is not None:
            return ended
    return TurnOutcome.NEXT


def perform(held: HeldRun, action: Action) -> TurnOutcome | None:
    """Carry out one action and record it; the turn's outcome if that ends the turn."""
    if isinstance(action, CallModel):
        if ends_turn(action, held.asked_model):
            return TurnOutcome.NEXT
        held.asked_model = True
        return held.call_model(action)
    if isinstance(action, RunTool):
        stalled = run_tools(held, action)
        return held.end(stalled) if stalled is not None else None
    if isinstance(action, Unresolved):
        ended = resolve(held, action)
        return held.end(ended) if ended is not None else None
    if isinstance(action, RefuseCall):
        held.checkpointed(tool_events(action.call, ToolOutcome(False, action.error)))
        return None
    if isinstance(action, Suspend):
        held.checkpointed([suspension_event(action)])
        if action.reason == RunStatus.WAITING:
            schedule_wake(held.ctx, held.state)
        return TurnOutcome.SUSPENDED
    if isinstance(action, StartChild):
        problem = start_child(held.ctx, held.state, action.call, action.child_id)
        if problem is not None:
            held.checkpointed(tool_events(action.call, ToolOutcome(False, problem)))
            return None
        wait = Suspend(RunStatus.WAITING, action.call, f"waiting for child run {action.child_id}")
        held.record([suspension_event(wait)])
        held.checkpoint()
        return TurnOutcome.SUSPENDED
    return held.end(action)
