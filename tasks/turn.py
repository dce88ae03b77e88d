"""``ratchet.turn``: one turn of a run. Read top to bottom, this is a run's life.

1. Take the run's **lease**. Another worker holds it: this message is a
   duplicate delivery, do nothing.
2. **Load** the snapshot; if it is older than the event log (a crash between
   appending events and saving the snapshot), fold the missing events onto it.
3. If the run is not at the seq the message expects, the message is late or
   duplicated: do nothing.
4. Ask :func:`runtime.fsm.decide` what happens next, do it, record it:

   - call the model — journal ``model.requested`` first (an attempt counts even
     if we crash), then **checkpoint the response before any tool runs**;
   - run each tool call — journal ``tool.requested``, run it, journal its
     outcome, checkpoint. A call found requested with no outcome was cut short
     by a crash: an idempotent tool runs again, any other parks the run as
     ``needs_reconciliation`` for an operator;
   - suspend, complete or fail — recorded and checkpointed; a finished run's
     snapshot is deleted, its events kept.

5. Release the lease, then **chain** the next turn carrying the seq it must find.

Every write is fenced: events need the lease and the next seq, snapshots a
compare-and-set on seq. A worker that lost its lease cannot write; it logs why
and stops.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from runtime.agent import Agent, describe_binding_change
from runtime.errors import (
    BindingChanged,
    LeaseLost,
    ProviderError,
    SnapshotFailed,
    StaleWrite,
    StoreUnavailable,
)
from runtime.fsm import (
    CallModel,
    Fail,
    Idle,
    RunTool,
    Suspend,
    apply,
    decide,
    response_events,
    suspension_event,
    tool_events,
    unknown_tool_outcome,
)
from runtime.models import Event, RunState, ToolCall, validate_run_id
from runtime.providers import ModelRequest
from runtime.tools import invoke
from store.runs import RunRecord
from tasks import failpoints
from tasks.context import Context, get_context
from worker.app import app

log = logging.getLogger("ratchet.turn")

_HOST = socket.gethostname()


def new_owner() -> str:
    """A lease owner id unique to this attempt at this run, on this host and process."""
    return f"{_HOST}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


@app.task(name="ratchet.turn", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_turn(run_id: str, expected_seq: int | None) -> str:
    """Advance ``run_id`` by one turn if it is at ``expected_seq``.

    Idempotent: a duplicate, late or concurrent delivery does nothing.
    Raises SnapshotFailed (fail-stop) when a checkpoint cannot be saved.
    """
    ctx = get_context()
    done = advance(ctx, validate_run_id(run_id), expected_seq)
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


def chain(run_id: str, done: Advanced) -> None:
    """Enqueue the next turn; it will act only if the run is still at ``done.seq``."""
    run_turn.apply_async((run_id, done.seq))
    failpoints.hit("turn.enqueued", done.turns)


def advance(ctx: Context, run_id: str, expected_seq: int | None) -> Advanced:
    """Take the lease, take one turn, release the lease. Does not chain.

    ``next`` means the turn ended with the next model call due: the caller chains it.
    """
    owner = new_owner()
    if not ctx.runs.acquire_lease(run_id, owner, ctx.settings.lease_s):
        log.info("run %s: another worker holds the lease; this delivery is a duplicate", run_id)
        return Advanced("leased", -1, 0)
    try:
        turn = Turn.open(ctx, run_id, owner)
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
        outcome = turn.take()
        return Advanced(outcome, turn.state.seq, turn.state.usage.model_turns)
    except (LeaseLost, StaleWrite) as exc:
        # A zombie: our lease expired and another worker moved the run on.
        log.warning("%s", exc)
        return Advanced("fenced", -1, 0)
    finally:
        ctx.runs.release_lease(run_id, owner)


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

    @classmethod
    def open(cls, ctx: Context, run_id: str, owner: str) -> Turn | None:
        record = ctx.runs.get(run_id)
        if record is None:
            return None
        state = ctx.snapshots.load(run_id)
        snapshot_seq = state.seq if state is not None else None
        if state is None or state.seq < record.last_seq:
            # Stale or missing snapshot: the events are the truth; fold what it lacks.
            missing = ctx.runs.events(run_id, after_seq=snapshot_seq or 0)
            for event in missing:
                state = apply(state, event)
            if snapshot_seq is not None:
                log.info(
                    "run %s: snapshot at seq %s was stale; rebuilt to %s from events",
                    run_id,
                    snapshot_seq,
                    record.last_seq,
                )
        assert state is not None, "a run record always has its run.created event"
        return cls(ctx, ctx.agent(state.agent_file), state, snapshot_seq, owner)

    # --- the turn -----------------------------------------------------------

    def take(self) -> str:
        """Run decisions until the turn ends. Returns next | suspended | completed | failed | …"""
        if self.state.status.is_live and self.agent.binding != self.state.binding:
            return self._stall_on_binding()
        asked_model = False
        while True:
            action = decide(self.state, self.agent, self.ctx.runs.clock())
            if isinstance(action, Idle):
                return "idle"
            if isinstance(action, Fail):
                self.record([("run.failed", {"reason": action.reason})])
                return self.finish()
            if isinstance(action, Suspend):
                self.record([suspension_event(action)])
                self.checkpoint()
                return "suspended"
            if isinstance(action, CallModel):
                if asked_model:
                    return "next"
                asked_model = True
                self.call_model(action.request)
                if self.state.status.is_terminal:
                    return self.finish()
            elif isinstance(action, RunTool):
                if not self.run_tool(action.call):
                    return "parked"

    def call_model(self, request: ModelRequest) -> None:
        turn = request.turn + 1
        self.record([("model.requested", {"turn": turn})])
        try:
            with self.heartbeat():
                response = self.agent.provider.complete(
                    request,
                    observer=lambda kind, data: self.record([(kind, {"turn": turn, **data})]),
                )
        except ProviderError as exc:
            self.record(
                [
                    ("model.failed", {"turn": turn, "error": str(exc)}),
                    ("run.failed", {"reason": f"model call for turn {turn} failed: {exc}"}),
                ]
            )
            return
        failpoints.hit("model.response.received", turn)
        self.record(response_events(response))
        self.checkpoint()
        failpoints.hit("model.response.checkpointed", turn)

    def run_tool(self, call: ToolCall) -> bool:
        """Run one tool call and checkpoint its outcome; False if the run was parked instead."""
        spec = self.agent.tools.get(call.name)
        turn = self.state.usage.model_turns
        if self.state.in_flight == call.id:
            # Journaled as requested, no outcome: a crash cut it short, and it may have run.
            if spec is None or not spec.idempotent:
                self.park(call)
                return False
            log.info(
                "run %s: re-running idempotent tool %s (call %s) after a crash",
                self.state.run_id,
                call.name,
                call.id,
            )
        else:
            self.record(
                [
                    (
                        "tool.requested",
                        {"call_id": call.id, "name": call.name, "arguments": call.arguments},
                    )
                ]
            )
        failpoints.hit("tool.requested", turn)
        if spec is None:
            outcome = unknown_tool_outcome(call, self.agent)
        else:
            with self.heartbeat():
                outcome = invoke(spec, call.arguments)
        failpoints.hit("tool.completed", turn)
        self.record(tool_events(call, outcome))
        self.checkpoint()
        return True

    def park(self, call: ToolCall) -> None:
        reason = (
            f"tool `{call.name}` (call {call.id}) was in flight when a worker stopped and is not "
            f"idempotent, so it may or may not have run; check its effect, then "
            f"`ratchet runs reconcile {self.state.run_id} {call.id}` with --result, --retry or --fail"
        )
        self.record(
            [
                (
                    "run.parked",
                    {
                        "reason": reason,
                        "call_id": call.id,
                        "tool": call.name,
                        "arguments": call.arguments,
                    },
                )
            ]
        )
        self.checkpoint()

    def finish(self) -> str:
        """A terminal run keeps its events; its snapshot has served its purpose."""
        self.ctx.snapshots.delete(self.state.run_id)
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
        now = self.ctx.runs.clock()
        state, events = self.state, []
        for kind, data in items:
            event = Event(seq=state.seq + 1, type=kind, at_ms=now, data=data)
            state = apply(state, event)
            events.append(event)
        due = now + int(self.ctx.settings.lease_s * 1000)
        self.ctx.runs.append(RunRecord.from_state(state, now, due), events, self.owner)
        self.state = state

    def checkpoint(self) -> None:
        """Save the snapshot (CAS on seq). Fail-stop: on failure the run stays where it was."""
        turn = self.state.usage.model_turns
        failpoints.hit("snapshot.before_save", turn)
        try:
            self.ctx.snapshots.save(self.state, self.snapshot_seq)
        except StoreUnavailable as exc:
            error = SnapshotFailed(self.state.run_id, self.state.seq, str(exc))
            self._record_stall(str(error))
            raise error from exc
        self.snapshot_seq = self.state.seq
        failpoints.hit("snapshot.after_save", turn)

    def _record_stall(self, reason: str) -> None:
        try:
            self.record([("run.stalled", {"reason": reason})])
        except Exception:  # the run store may be down too; the task's failure still says why
            log.exception("run %s: could not record the stall", self.state.run_id)

    @contextmanager
    def heartbeat(self) -> Iterator[None]:
        """Renew the lease while a long model or tool call runs."""
        stop = threading.Event()
        interval = self.ctx.settings.lease_s / 3

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    if not self.ctx.runs.acquire_lease(
                        self.state.run_id, self.owner, self.ctx.settings.lease_s
                    ):
                        log.warning("run %s: lease lost during a call", self.state.run_id)
                        return
                except Exception:
                    log.exception("run %s: heartbeat failed", self.state.run_id)

        thread = threading.Thread(target=beat, name=f"heartbeat-{self.state.run_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
