"""``ratchet.turn``: one turn of a run. Read top to bottom, this is a run's life.

1. Take the run's **lease**. Another worker holds it: this message is a
   duplicate delivery, do nothing.
2. **Load** the run (:func:`tasks.journal.load`): the snapshot, with the events
   it lacks folded on (a crash between appending events and saving it); a
   snapshot that cannot be used is moved aside and the state rebuilt from events.
3. If the run is not at the seq the message expects, the message is late or
   duplicated: do nothing.
4. Ask :func:`runtime.fsm.decide` what happens next, do it, record it:

   - call the model — journal ``model.requested`` first (an attempt counts even
     if we crash), then **checkpoint the response before any tool runs**;
   - run the tool calls — journal ``tool.requested``, run them side by side (up
     to ``max_parallel_tools``), journal and checkpoint each outcome as it
     finishes (tasks/tools_parallel.py). A call found requested with no
     outcome was cut short by a crash: an idempotent tool runs again, one with
     a probe is asked whether it ran, any other parks the run as
     ``needs_reconciliation`` for an operator;
   - suspend, complete or fail — recorded and checkpointed; a finished run's
     snapshot is deleted, its events kept.

5. Release the lease, then **chain** the next turn carrying the seq it must find.

Every write is fenced: events need the lease and the next seq, snapshots a
compare-and-set on seq. A worker that lost its lease cannot write; it logs why
and stops.

Hangs are bounded: a model or tool call runs in a thread of its own and the
turn stops waiting after the agent's ``model_timeout_s`` / ``tool_timeout_s``.
Python cannot kill a thread, so a call that times out is *abandoned*: it may
still finish in the background, and whatever it reports afterwards is dropped.
A model call that timed out is a failed attempt (``model.failed``; the next
turn asks again, within ``max_turns``); an idempotent tool is tried again a
bounded number of times; any other tool's outcome is unknown: its probe, if it
has one, is asked whether it ran, and otherwise the run is parked as
``needs_reconciliation``.

A worker told to shut down (SIGTERM, Celery's warm shutdown) ends the turn at
the next transition boundary and chains the rest, so another worker carries on
at once instead of waiting for the lease to expire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from celery.signals import worker_shutting_down

from runtime.agent import Agent, describe_binding_change
from runtime.errors import (
    BindingChanged,
    LeaseLost,
    ProviderError,
    ProviderRateLimited,
    RunNotFound,
    SnapshotFailed,
    StaleWrite,
    StoreUnavailable,
)
from runtime.fsm import (
    Action,
    CallModel,
    Fail,
    Idle,
    RefuseCall,
    RunTool,
    StartChild,
    Suspend,
    Unresolved,
    decide,
    response_events,
    suspension_event,
    tool_events,
)
from runtime.models import RunState, RunStatus, validate_run_id
from runtime.probes import Probed
from runtime.providers import ModelRequest
from runtime.tools import ToolOutcome
from store.runs import RunRecord
from tasks import failpoints, lease, limits, metrics
from tasks.calls import CallTimedOut, bounded, heartbeats
from tasks.children import start_child
from tasks.context import Context, get_context
from tasks.journal import (
    append_events,
    commit_checkpointed,
    load,
    save_snapshot,
    transition,
)
from tasks.messages import enqueue_turn, tell_parent_soon
from tasks.task_base import ratchet_task
from tasks.timers import schedule_wake
from tasks.tools_parallel import TOOL_TIMEOUT_ATTEMPTS as TOOL_TIMEOUT_ATTEMPTS
from tasks.tools_parallel import resolve, run_tools

log = logging.getLogger("ratchet.turn")

_stopping = threading.Event()


@worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    # Sent in the worker's main process: with the solo and threads pools the turn runs
    # in that process and sees the flag. A prefork child does not; Celery's warm
    # shutdown then waits for its turn to end, bounded by turn_time_limit_s.
    _stopping.set()


def stopping() -> bool:
    """This process was told to shut down: end turns at the next transition boundary."""
    return _stopping.is_set()


@ratchet_task(name="ratchet.turn", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_turn(*, run_id: str, expected_seq: int | None) -> str:
    """Advance ``run_id`` by one turn if it is at ``expected_seq``.

    Idempotent: a duplicate, late or concurrent delivery does nothing.
    Raises SnapshotFailed (fail-stop) when a checkpoint cannot be saved.
    """
    ctx = get_context()
    redelivered = bool((run_turn.request.delivery_info or {}).get("redelivered"))
    started = time.perf_counter()
    done = advance(ctx, validate_run_id(run_id), expected_seq, redelivered=redelivered)
    metrics.turn_timed(time.perf_counter() - started, throttled=done.countdown_s > 0)
    metrics.turn_done(done.outcome)
    if done.outcome == "next":
        chain(run_id, done)
    return done.outcome


class Advanced(NamedTuple):
    outcome: str
    """next | suspended | completed | failed | parked | stalled | idle | leased | stale | …"""
    seq: int
    """The run's seq afterwards (-1 when the run was not read)."""
    turns: int
    """Model turns the run has had."""
    countdown_s: float = 0.0
    """``next`` after waiting on a limit (tasks/limits.py): chain the turn this much later."""
    priority: int | None = None
    """The broker priority of the next turn (runs under way before new ones)."""


def chain(run_id: str, done: Advanced) -> None:
    """Enqueue the next turn; it will act only if the run is still at ``done.seq``.

    One path for every turn that follows another: at once, or after ``countdown_s``
    when the turn waited on a limit (a broker-held countdown, no worker slot).
    """
    enqueue_turn(
        run_id=run_id, expected_seq=done.seq, priority=done.priority, countdown_s=done.countdown_s
    )
    failpoints.hit("turn.enqueued", done.turns)


def advance(
    ctx: Context,
    run_id: str,
    expected_seq: int | None,
    owner: str | None = None,
    redelivered: bool = False,
) -> Advanced:
    """Take the lease, take one turn, release the lease. Does not chain.

    ``next`` means the turn ended with the next model call due: the caller chains it.
    ``owner``: a caller that already holds the lease (a resume) passes its owner id.
    ``redelivered``: the broker delivers this message again (its consumer died), so
    a holder of the lease is waited for until its process is known dead or alive.
    """
    with lease.holding(
        ctx,
        run_id,
        owner,
        patience_s=LEASE_PATIENCE_S,
        until_dead_s=ctx.settings.liveness_s if redelivered else 0.0,
        must=False,
        recovers=True,
    ) as held:
        if held.took_from is not None:
            # The holder's process died mid-turn: recover the run here and now, as the
            # sweeper would (counted towards dead-lettering), instead of waiting for it.
            held.released = True  # the recovery lets the lease go itself
            return _recover_takeover(ctx, run_id, held.owner)
        if not held.taken:
            reason = held.busy.reason if held.busy is not None else "lease held"
            log.info("run %s: %s; this delivery is a duplicate", run_id, reason)
            return Advanced("leased", -1, 0)
        return _advance_holding(ctx, held, expected_seq)


def _advance_holding(ctx: Context, held: lease.Held, expected_seq: int | None) -> Advanced:
    run_id, owner, record = held.run_id, held.owner, held.record
    turn: Turn | None = None
    try:
        turn = Turn.open(ctx, run_id, owner, record) if record is not None else None
        if turn is None:
            log.warning("run %s: no such run; dropping the message", run_id)
            return Advanced("missing", -1, 0)
        if expected_seq is not None and turn.state.seq != expected_seq:
            log.info(
                "run %s: message expects seq %s but the run is at %s; a late or duplicate "
                "message, ignored",
                run_id,
                expected_seq,
                turn.state.seq,
            )
            return Advanced("stale", turn.state.seq, turn.state.usage.model_turns)
        with turn.heartbeat():
            turn.adopt()
            outcome = turn.take()
        limits.turn_ended(ctx, turn.agent, turn.state)
        return Advanced(
            outcome,
            turn.state.seq,
            turn.state.usage.model_turns,
            turn.waited.countdown_s if turn.waited is not None and outcome == "next" else 0.0,
            limits.turn_priority(ctx, turn.agent, turn.state),
        )
    except (LeaseLost, StaleWrite) as exc:
        # A zombie: our lease expired and another worker moved the run on.
        log.warning("%s", exc)
        return Advanced("fenced", -1, 0)
    finally:
        held.released = turn is not None and turn.released


LEASE_PATIENCE_S = 0.5
"""How long a turn waits for a lease another worker holds before calling itself a duplicate.

The holder may be a late duplicate of the *previous* turn's message, which only
reads the run, finds it moved on, and lets go within milliseconds; a chained
turn that gave up at once would leave the run to the sweeper. A redelivered
message waits longer: RabbitMQ redelivers a dead consumer's message within a
fraction of a second, before its liveness lapses, so the turn waits (at most one
``liveness_s``) for the holder to be known dead rather than leave the run to the
sweeper; a holder that keeps beating is alive, and the delivery a duplicate."""


Takeover = Callable[[Context, str, str], Advanced]
"""Recovers a run whose lease a turn took from a dead holder: ``(ctx, run_id, owner)``."""

_takeover: Takeover | None = None


def recover_takeovers_with(recover: Takeover) -> None:
    """Set how a turn recovers a run it took from a dead holder (tasks.recovery's resume).

    Handed in rather than imported: tasks.recovery imports this module, and importing
    ``tasks`` imports tasks.recovery, so it is set before any turn runs.
    """
    global _takeover
    _takeover = recover


def _recover_takeover(ctx: Context, run_id: str, owner: str) -> Advanced:
    if _takeover is None:
        ctx.runs.release_lease(run_id, owner)
        raise RuntimeError("tasks.recovery is not imported: a taken-over run cannot recover")
    return _takeover(ctx, run_id, owner)


class Turn:
    """One worker's hold on one run, between taking and releasing its lease."""

    def __init__(
        self, ctx: Context, agent: Agent, state: RunState, snapshot_seq: int | None, owner: str
    ):
        self.ctx = ctx
        self.agent = agent
        self.state = state
        self.snapshot_seq = snapshot_seq
        self.owner = owner
        self._recording = threading.RLock()
        self.waited: limits.Wait | None = None
        """Set when the model call waits on a limit: the turn ends and is chained later."""
        self.recording = self._recording
        """Held to record and checkpoint, by the turn and its parallel tool calls."""
        self.timed_out: dict[str, int] = {}
        """Calls of this turn that timed out with their outcome unknown, and how often."""
        self.last_probed: dict[str, Probed] = {}
        self.asked_model = False
        """This turn has called the model: the next model call is the next turn's."""
        self.released = False
        """The lease went with the turn's last checkpoint (:meth:`checkpointed`)."""
        self._beat: tuple[str, str] | None = None

    @classmethod
    def open(
        cls, ctx: Context, run_id: str, owner: str, record: RunRecord | None = None
    ) -> Turn | None:
        try:
            loaded = load(ctx, run_id, record=record)
        except RunNotFound:
            return None
        state = loaded.state
        return cls(ctx, ctx.agent(state.agent_file), state, loaded.snapshot_seq, owner)

    # --- the turn -----------------------------------------------------------

    def adopt(self) -> None:
        """Checkpoint at once when the snapshot lags the log (a resume, a crashed turn).

        The events past the snapshot were appended by an earlier holder, which may
        still send the checkpoint it owes: a frozen or partitioned worker's save can
        reach the store long after it was sent. Saving ours first makes that late
        save fail its compare-and-set instead of landing while this turn runs.
        """
        if self.snapshot_seq != self.state.seq and self.state.status.is_live:
            self.checkpoint()

    def take(self) -> str:
        """Run decisions until the turn ends. Returns next | suspended | completed | failed | …"""
        if self.state.status.is_live and self.agent.binding != self.state.binding:
            return self._stall_on_binding()
        while True:
            if self.released:
                return "next"  # the last checkpoint let the lease go: the next turn decides
            if stopping() and self.state.status.is_live:
                log.info(
                    "run %s: worker shutting down; stopping at seq %s and chaining the rest",
                    self.state.run_id,
                    self.state.seq,
                )
                return "next"
            action = decide(self.state, self.agent, self.ctx.runs.clock())
            if isinstance(action, CallModel):
                if self.asked_model:
                    return "next"
                self.asked_model = True
                self.call_model(action.request)
                if self.waited is not None:
                    return "stalled" if self.waited.stalls else "next"
                if self.state.status.is_terminal:
                    return self.finish()
                continue
            ended = self.perform(action)
            if ended is not None:
                return ended

    def perform(self, action: Action) -> str | None:
        """Carry out one action other than a model call; the turn's outcome if it ends it."""
        if isinstance(action, Idle):
            return "idle"
        if isinstance(action, Fail):
            budget = {"budget": action.budget} if action.budget else {}
            self.record([("run.failed", {"reason": action.reason, **budget})])
            return self.finish()
        if isinstance(action, Suspend):
            self.checkpointed([suspension_event(action)])
            if action.reason == RunStatus.WAITING:
                schedule_wake(self.ctx, self.state)
            return "suspended"
        if isinstance(action, StartChild):
            start_child(self.ctx, self.state, action.call, action.child_id)
            wait = Suspend(
                RunStatus.WAITING, action.call, f"waiting for child run {action.child_id}"
            )
            self.record([suspension_event(wait)])
            self.checkpoint()
            return "suspended"
        if isinstance(action, RefuseCall):
            self.checkpointed(tool_events(action.call, ToolOutcome(False, action.error)))
            return None
        if isinstance(action, RunTool):
            run_tools(self, action)
        if isinstance(action, Unresolved) and not resolve(self, action):
            return "parked"
        return None

    def call_model(self, request: ModelRequest) -> None:
        turn = request.turn + 1
        gate = limits.admit(self.ctx, self.agent, self.state, request)
        if isinstance(gate, limits.Wait):
            self.wait_on_limit(gate)
            return
        self.record([("model.requested", {"turn": turn})])
        abandoned = threading.Event()

        def observe(kind: str, data: dict[str, Any]) -> None:
            with self._recording:
                if not abandoned.is_set():
                    self.record([(kind, {"turn": turn, **data})])

        timeout_s = self.agent.spec.model_timeout_s
        try:
            response = bounded(
                lambda: self.agent.provider.complete(request, observer=observe),
                timeout_s,
                f"model call for turn {turn}",
            )
        except CallTimedOut as exc:
            with self._recording:
                abandoned.set()
            # A counted attempt: the next turn asks again, as a new model.requested.
            self.record([("model.failed", {"turn": turn, "error": str(exc), "timeout": True})])
            return
        except ProviderRateLimited as exc:
            self.wait_on_limit(limits.refused(self.ctx, self.agent, self.state, gate, turn, exc))
            return
        except ProviderError as exc:
            if exc.retryable:
                # The provider is down for longer than its retries cover: nothing about
                # the run is wrong, so park it for an operator rather than end it.
                reason = (
                    f"model call for turn {turn} failed: {exc}; once the provider is back, "
                    f"`ratchet runs resume {self.state.run_id}`"
                )
                ending = ("run.stalled", {"reason": reason})
            else:
                ending = ("run.failed", {"reason": f"model call for turn {turn} failed: {exc}"})
            self.record([("model.failed", {"turn": turn, "error": str(exc)}), ending])
            if exc.retryable:
                self.checkpoint()
            return
        failpoints.hit("model.response.received", turn)
        limits.settle(self.ctx, gate, response)
        self.checkpointed(response_events(response))
        failpoints.hit("model.response.checkpointed", turn)

    def wait_on_limit(self, wait: limits.Wait) -> None:
        """Record the wait (no attempt counted); the turn ends and is chained after it."""
        self.waited = wait
        if wait.events:
            self.record(wait.events)
        if wait.stalls:
            self.checkpoint()

    def finish(self) -> str:
        """A terminal run keeps its events; its snapshot has served its purpose."""
        self.ctx.forget_checkpoint(self.state.run_id)
        self.ctx.snapshots.delete(self.state.run_id)
        if self.state.parent is not None:
            # The fast path; the sweeper tells the parent if this process dies first.
            tell_parent_soon(self.state.run_id)
        return self.state.status.value

    def _stall_on_binding(self) -> str:
        before = self._created_binding_document()
        changed = (
            describe_binding_change(before, self.agent.binding_document) if before else "binding"
        )
        error = BindingChanged(self.state.run_id, self.agent.name, changed)
        log.warning("%s", error)
        self.record([("run.stalled", {"reason": str(error)})])
        self.checkpoint()
        return "stalled"

    def _created_binding_document(self) -> dict[str, Any] | None:
        first = self.ctx.runs.events(self.state.run_id, after_seq=0, limit=1)
        return first[0].data.get("binding_document") if first else None

    # --- persistence ----------------------------------------------------------

    def record(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        """Append events (fenced by lease and seq) and the record they produce."""
        with self._recording:
            self.state = append_events(self.ctx, self.state, items, self.owner)

    def checkpointed(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        """Record events and checkpoint the state they produce (:meth:`record`, :meth:`checkpoint`).

        One store call when both stores are one Redis: the events, the snapshot and, on
        the turn's last checkpoint, the lease's release, all written or none.
        """
        if not self.ctx.runs.commits_with(self.ctx.snapshots):
            self.record(items)
            self.checkpoint()
            return
        with self._recording:
            change = transition(self.ctx, self.state, items)
            turn = change.state.usage.model_turns
            failpoints.hit("snapshot.before_save", turn)
            release = self._ends_turn(change.state)
            try:
                started = time.perf_counter()
                commit_checkpointed(
                    self.ctx, self.state, change, self.owner, self.snapshot_seq, release
                )
                metrics.checkpointed(
                    time.perf_counter() - started, self.ctx.snapshots.last_save_bytes
                )
            except StoreUnavailable as exc:
                # All or nothing: the run is still where it was.
                error = SnapshotFailed(self.state.run_id, change.state.seq, str(exc))
                self._record_stall(str(error))
                raise error from exc
            self.state = change.state
            self.snapshot_seq = change.state.seq
            if release:
                self.released = True
                if self._beat is not None:
                    heartbeats().remove(self._beat)
            self.ctx.remember_checkpoint(self.state)
            failpoints.hit("snapshot.after_save", turn)

    def _ends_turn(self, state: RunState) -> bool:
        """Whether the turn ends right after checkpointing ``state``, with the next model call
        (the next turn's): that checkpoint takes the lease's release along."""
        return (
            self.asked_model
            and state.status.is_live
            and not stopping()
            and isinstance(decide(state, self.agent, self.ctx.runs.clock()), CallModel)
        )

    def checkpoint(self) -> None:
        """Save the snapshot (CAS on seq). Fail-stop: on failure the run stays where it was."""
        turn = self.state.usage.model_turns
        failpoints.hit("snapshot.before_save", turn)
        try:
            started = time.perf_counter()
            save_snapshot(self.ctx, self.state, self.snapshot_seq, self.owner)
            metrics.checkpointed(time.perf_counter() - started, self.ctx.snapshots.last_save_bytes)
        except StoreUnavailable as exc:
            error = SnapshotFailed(self.state.run_id, self.state.seq, str(exc))
            self._record_stall(str(error))
            raise error from exc
        self.snapshot_seq = self.state.seq
        self.ctx.remember_checkpoint(self.state)
        failpoints.hit("snapshot.after_save", turn)

    def _record_stall(self, reason: str) -> None:
        try:
            self.record([("run.stalled", {"reason": reason})])
        except Exception as exc:  # the run store may be down too (a full disk takes both)
            # Nothing is lost: the run stays live at its last recorded seq, its lease
            # expires, and the sweeper resumes it once the stores take writes again.
            log.error(
                "run %s: could not record the stall (%s: %s); it stays live and the sweeper "
                "resumes it once the stores accept writes again",
                self.state.run_id,
                type(exc).__name__,
                " ".join(str(exc).split()),
            )

    @contextmanager
    def heartbeat(self) -> Iterator[None]:
        """Renew the lease every third of it while the turn runs (model and tool calls too).

        It stops with the process: a worker that is killed or frozen lets the lease expire.
        """
        beat = self._beat = heartbeats().add(self.ctx, self.state.run_id, self.owner)
        try:
            yield
        finally:
            heartbeats().remove(beat)
