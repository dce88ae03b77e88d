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

Hangs are bounded: a model or tool call runs in a thread of its own and the
turn stops waiting after the agent's ``model_timeout_s`` / ``tool_timeout_s``.
Python cannot kill a thread, so a call that times out is *abandoned*: it may
still finish in the background, and whatever it reports afterwards is dropped.
A model call that timed out is a failed attempt (``model.failed``; the next
turn asks again, within ``max_turns``); an idempotent tool is tried again a
bounded number of times; any other tool's outcome is unknown, so the run is
parked as ``needs_reconciliation``.

A worker told to shut down (SIGTERM, Celery's warm shutdown) ends the turn at
the next transition boundary and chains the rest, so another worker carries on
at once instead of waiting for the lease to expire.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

from celery.signals import worker_shutting_down

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
from runtime.tools import ToolOutcome, ToolSpec, invoke
from store.runs import RunRecord
from tasks import failpoints
from tasks.context import Context, get_context
from worker import metrics
from worker.app import app

log = logging.getLogger("ratchet.turn")

_HOST = socket.gethostname()

T = TypeVar("T")

TOOL_TIMEOUT_ATTEMPTS = 3
"""Tries in all for an idempotent tool that times out, before its call fails."""

_stopping = threading.Event()
_heartbeats_lock = threading.Lock()


@worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    # Sent in the worker's main process: with the solo and threads pools the turn runs
    # in that process and sees the flag. A prefork child does not; Celery's warm
    # shutdown then waits for its turn to end, bounded by turn_time_limit_s.
    _stopping.set()


def stopping() -> bool:
    """This process was told to shut down: end turns at the next transition boundary."""
    return _stopping.is_set()


class CallTimedOut(Exception):
    """A model or tool call did not return in time and was abandoned."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} did not return within {timeout_s:g} s and was abandoned")
        self.timeout_s = timeout_s


class _Callers:
    """Daemon threads that run model and tool calls, so a turn can stop waiting for one.

    Reused across calls (a thread per call costs more than most tool calls). A
    call that times out is abandoned, not stopped — Python cannot stop a thread —
    and its thread is written off; a fresh one takes its place, so abandoned calls
    never starve the next turn. Daemon threads never hold the process open at exit.
    """

    def __init__(self) -> None:
        self._idle: list[tuple[threading.Event, list[Any]]] = []
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        with self._lock:
            slot = self._idle.pop() if self._idle else self._spawn()
        wake, box = slot
        done = threading.Event()
        box[:] = [fn, done, None, None]
        wake.set()
        if not done.wait(timeout_s):
            box[0] = None  # the thread exits when (if ever) the call returns
            raise CallTimedOut(what, timeout_s)
        value, error = box[2], box[3]
        with self._lock:
            self._idle.append(slot)
        if error is not None:
            raise error
        result: T = value
        return result

    @staticmethod
    def _spawn() -> tuple[threading.Event, list[Any]]:
        wake = threading.Event()
        box: list[Any] = [None, None, None, None]

        def serve() -> None:
            while True:
                wake.wait()
                wake.clear()
                fn, done = box[0], box[1]
                try:
                    box[2], box[3] = fn(), None
                except BaseException as exc:  # handed to the waiting thread as is
                    box[2], box[3] = None, exc
                abandoned = box[0] is None
                done.set()
                if abandoned:
                    return

        threading.Thread(target=serve, name="ratchet-call", daemon=True).start()
        return wake, box


_callers_by_pid: dict[int, _Callers] = {}


def bounded(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``call`` on a caller thread; raise CallTimedOut if it takes over ``timeout_s``."""
    pid = os.getpid()
    with _heartbeats_lock:
        callers = _callers_by_pid.get(pid)
        if callers is None:
            callers = _callers_by_pid[pid] = _Callers()
    return callers.call(call, timeout_s, what)


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


def chain(run_id: str, done: Advanced) -> None:
    """Enqueue the next turn; it will act only if the run is still at ``done.seq``."""
    run_turn.apply_async((run_id, done.seq))
    failpoints.hit("turn.enqueued", done.turns)


def advance(
    ctx: Context, run_id: str, expected_seq: int | None, owner: str | None = None
) -> Advanced:
    """Take the lease, take one turn, release the lease. Does not chain.

    ``next`` means the turn ended with the next model call due: the caller chains it.
    ``owner``: a caller that already holds the lease (a resume) passes its owner id.
    """
    owner = owner or new_owner()
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
        with turn.heartbeat():
            outcome = turn.take()
        return Advanced(outcome, turn.state.seq, turn.state.usage.model_turns)
    except (LeaseLost, StaleWrite) as exc:
        # A zombie: our lease expired and another worker moved the run on.
        log.warning("%s", exc)
        return Advanced("fenced", -1, 0)
    finally:
        ctx.runs.release_lease(run_id, owner)


def load_state(ctx: Context, run_id: str) -> tuple[RunState, int | None] | None:
    """The run's state and the seq of its stored snapshot; None if there is no such run.

    A stale or missing snapshot is healed here: the events are the truth, and the
    ones the snapshot lacks are folded onto it.
    """
    record = ctx.runs.get(run_id)
    if record is None:
        return None
    remembered = ctx.recall_checkpoint(run_id, record.last_seq)
    if remembered is not None:
        return remembered, remembered.seq
    state = ctx.snapshots.load(run_id)
    snapshot_seq = state.seq if state is not None else None
    if state is None or state.seq < record.last_seq:
        for event in ctx.runs.events(run_id, after_seq=snapshot_seq or 0):
            state = apply(state, event)
        if snapshot_seq is not None:
            log.info(
                "run %s: snapshot at seq %s was stale; rebuilt to %s from events",
                run_id,
                snapshot_seq,
                record.last_seq,
            )
    if state is None:
        raise ValueError(f"run {run_id} has a record but no events to rebuild its state from")
    return state, snapshot_seq


def append_events(
    ctx: Context, state: RunState, items: list[tuple[str, dict[str, Any]]], owner: str | None
) -> RunState:
    """Append events after ``state`` (fenced by ``owner``'s lease and the seq); the new state."""
    now = ctx.runs.clock()
    before = state.status
    events = []
    for kind, data in items:
        event = Event(seq=state.seq + 1, type=kind, at_ms=now, data=data)
        state = apply(state, event)
        events.append(event)
    # A live run is overdue for the sweeper if nothing happens within one lease.
    due = now + int(ctx.settings.lease_s * 1000)
    ctx.runs.append(RunRecord.from_state(state, now, due), events, owner)
    metrics.recorded(before, state.status, events)
    return state


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

    @classmethod
    def open(cls, ctx: Context, run_id: str, owner: str) -> Turn | None:
        loaded = load_state(ctx, run_id)
        if loaded is None:
            return None
        state, snapshot_seq = loaded
        return cls(ctx, ctx.agent(state.agent_file), state, snapshot_seq, owner)

    # --- the turn -----------------------------------------------------------

    def take(self) -> str:
        """Run decisions until the turn ends. Returns next | suspended | completed | failed | …"""
        if self.state.status.is_live and self.agent.binding != self.state.binding:
            return self._stall_on_binding()
        asked_model = False
        while True:
            if stopping() and self.state.status.is_live:
                log.info(
                    "run %s: worker shutting down; stopping at seq %s and chaining the rest",
                    self.state.run_id,
                    self.state.seq,
                )
                return "next"
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
            found = self._invoke_bounded(spec, call)
            if found is None:
                self.park(call, timed_out_s=self.agent.spec.tool_timeout_s)
                return False
            outcome = found
        failpoints.hit("tool.completed", turn)
        self.record(tool_events(call, outcome))
        self.checkpoint()
        return True

    def _invoke_bounded(self, spec: ToolSpec, call: ToolCall) -> ToolOutcome | None:
        """The tool's outcome; None when a non-idempotent call timed out (outcome unknown)."""
        timeout_s = self.agent.spec.tool_timeout_s
        attempts = TOOL_TIMEOUT_ATTEMPTS if spec.idempotent else 1
        for attempt in range(1, attempts + 1):
            try:
                return bounded(lambda: invoke(spec, call.arguments), timeout_s, f"tool {call.name}")
            except CallTimedOut as exc:
                log.warning(
                    "run %s: %s (attempt %s of %s)", self.state.run_id, exc, attempt, attempts
                )
        if not spec.idempotent:
            return None
        return ToolOutcome(
            False, f"`{call.name}` did not return within {timeout_s:g} s, {attempts} times"
        )

    def park(self, call: ToolCall, timed_out_s: float | None = None) -> None:
        cause = (
            f"did not return within {timed_out_s:g} s and was abandoned"
            if timed_out_s is not None
            else "was in flight when a worker stopped"
        )
        reason = (
            f"tool `{call.name}` (call {call.id}) {cause} and is not "
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
        self.ctx.forget_checkpoint(self.state.run_id)
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
        with self._recording:
            self.state = append_events(self.ctx, self.state, items, self.owner)

    def checkpoint(self) -> None:
        """Save the snapshot (CAS on seq). Fail-stop: on failure the run stays where it was."""
        turn = self.state.usage.model_turns
        failpoints.hit("snapshot.before_save", turn)
        try:
            started = time.perf_counter()
            self.ctx.snapshots.save(self.state, self.snapshot_seq)
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
        except Exception:  # the run store may be down too; the task's failure still says why
            log.exception("run %s: could not record the stall", self.state.run_id)

    @contextmanager
    def heartbeat(self) -> Iterator[None]:
        """Renew the lease every third of it while the turn runs (model and tool calls too).

        It stops with the process: a worker that is killed or frozen lets the lease expire.
        """
        beat = _heartbeats().add(self.ctx, self.state.run_id, self.owner)
        try:
            yield
        finally:
            _heartbeats().remove(beat)


class _Heartbeats:
    """One thread per process renews the lease of every turn in progress.

    Most turns end long before their first renewal is due, so a thread per turn
    would be started and joined for nothing.
    """

    def __init__(self) -> None:
        self._due: dict[tuple[str, str], tuple[Context, float]] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="ratchet-heartbeats", daemon=True).start()

    def add(self, ctx: Context, run_id: str, owner: str) -> tuple[str, str]:
        key = (run_id, owner)
        with self._changed:
            self._due[key] = (ctx, time.monotonic() + ctx.settings.lease_s / 3)
            self._changed.notify()
        return key

    def remove(self, key: tuple[str, str]) -> None:
        with self._changed:
            self._due.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._changed:
                now = time.monotonic()
                due = [(key, ctx) for key, (ctx, at) in self._due.items() if at <= now]
                for key, ctx in due:
                    self._due[key] = (ctx, now + ctx.settings.lease_s / 3)
                if not due:
                    wake = min((at for _, at in self._due.values()), default=now + 1.0)
                    self._changed.wait(max(0.0, wake - now))
                    continue
            for (run_id, owner), ctx in due:
                try:
                    if not ctx.runs.acquire_lease(run_id, owner, ctx.settings.lease_s):
                        log.warning("run %s: lease lost during the turn", run_id)
                except Exception:
                    log.exception("run %s: heartbeat failed", run_id)


_heartbeats_by_pid: dict[int, _Heartbeats] = {}


def _heartbeats() -> _Heartbeats:
    """This process's heartbeat thread (a forked pool child starts its own)."""
    pid = os.getpid()
    with _heartbeats_lock:
        beats = _heartbeats_by_pid.get(pid)
        if beats is None:
            beats = _heartbeats_by_pid[pid] = _Heartbeats()
    return beats
