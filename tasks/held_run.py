"""The run a turn holds: its state, the model call, and every write the turn makes.

Every write is fenced: events need the lease and the next seq, snapshots a
compare-and-set on seq. A worker that lost its lease cannot write; the turn logs
why and stops. :meth:`HeldRun.checkpointed` is the turn's usual write: the events,
the snapshot and, on the turn's last checkpoint, the lease's release, in one store
call when both stores are one Redis (:func:`tasks.persistence.commit_checkpointed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_shutting_down

from runtime.actions import (
    Action,
    CallModel,
    CheckBinding,
    Fail,
    Idle,
    Park,
    RequestOrder,
    RunTool,
    Stall,
    TurnOutcome,
    Unresolved,
    after_model_timeout,
    after_store_failure,
    binding_stall,
    model_failed,
)
from runtime.agent import Agent
from runtime.errors import (
    AgentFileError,
    NotReplicated,
    ProviderError,
    ProviderRateLimited,
    RunNotFound,
    StoreUnavailable,
)
from runtime.fsm import (
    decide,
    ends_turn,
    model_requested,
    requested_early,
    requested_event,
    response_events,
)
from runtime.limits import Wait
from runtime.models import RunState
from runtime.probes import Probed
from runtime.provider import ModelRequest, ModelResponse, Observer, checked_response
from runtime.tools import SNAPSHOT_RESERVE_BYTES, overflow
from runtime_io.providers.http import DeadlineExceeded, call_deadline
from store.runs import RunRecord
from store.snapshots import Prefetched
from store.snapshots import format as snapshot_format
from tasks import limits
from tasks.context import Context, TranscriptSize
from tasks.live import MAX_PIECES_BYTES, SETTLE_S, live_piece, watched
from tasks.messages import tell_parent_soon, turn_outbox
from tasks.persistence import (
    Transition,
    append_events,
    append_transition,
    commit_checkpointed,
    commit_finished,
    extended,
    load,
    save_snapshot,
    transition,
)
from tasks.threads import CallTimedOut, bounded, heartbeats

log = logging.getLogger("ratchet.turn")

HEAD_BYTES = 64 * 1024
"""More than a snapshot's head takes besides the run's texts, pending calls and suspension."""

_stopping = threading.Event()


@worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    # Sent in the worker's main process: with the solo and threads pools the turn runs
    # in that process and sees the flag. A prefork child does not; Celery's warm
    # shutdown then waits for its turn to end, bounded by turn_time_limit_s.
    _stopping.set()


def stopping() -> bool:
    """This process was told to shut down (SIGTERM, Celery's warm shutdown): end turns at
    the next transition boundary and chain the rest, so another worker carries on at once
    instead of waiting for the lease to expire."""
    return _stopping.is_set()


@dataclass(frozen=True)
class Ahead:
    """A turn's model call, decided on the state this process remembers, and its journal
    (tasks/ahead.py)."""

    before: RunState
    """The run's state at the seq the turn's message expects, as this process saved it."""
    was: RunRecord
    """The record it wrote with that state: the run must still have exactly this one."""
    agent: Agent
    action: CallModel
    request: ModelRequest
    gate: limits.Go
    """What :func:`tasks.limits.admit` would answer, known without the limit store."""
    change: Transition
    """``model.requested`` after ``before``: the write that goes with the lease."""


class AgentNotLoaded(Exception):
    """The run's agent file cannot be loaded for its turn (an MCP server it names is down,
    the file was broken or removed): ``state`` is the run as loaded, ``reason`` says why."""

    def __init__(self, state: RunState, reason: str) -> None:
        super().__init__(reason)
        self.state, self.reason = state, reason


class HeldRun:
    """One worker's hold on one run, between taking and releasing its lease: the run's state,
    and every write the turn makes to it."""

    def __init__(
        self, ctx: Context, agent: Agent, state: RunState, snapshot_seq: int | None, owner: str
    ):
        self.ctx = ctx
        self.agent = agent
        self.state = state
        self.snapshot_seq = snapshot_seq
        self.owner = owner
        self._recording = threading.RLock()
        self.waited: Wait | None = None
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
        self.queued = False
        """The next turn's message went with it too (an outbox on the broker's Redis)."""
        self.dropped = False
        """The run finished and its snapshot went with that checkpoint (:meth:`finish`)."""
        self.requested_early: frozenset[str] = frozenset()
        """Calls journaled as requested with the model's response, not started yet: the
        turn starts them as new calls (tasks/tools_parallel.py), not as calls cut short."""
        self.ahead: Ahead | None = None
        """The turn's model call, journaled with the lease and not made yet (tasks/ahead.py)."""
        self._beat: tuple[str, str] | None = None
        self._decided: tuple[RunState, Action] | None = None
        ctx.remember_agent(state)

    @classmethod
    def journaled(cls, ctx: Context, owner: str, ahead: Ahead) -> HeldRun:
        """The run whose lease was taken with ``ahead``'s journal: at the state that journal
        made, its model call the turn's first step, its snapshot the state before."""
        state = ahead.change.state
        if ctx.observers:  # only now, when the events are committed
            ctx.observers.committed(ahead.before.status, state.status, ahead.change.events, state)
        held = cls(ctx, ahead.agent, state, ahead.before.seq, owner)
        held.ahead = ahead
        held._decided = (state, ahead.action)
        return held

    @classmethod
    def open(
        cls,
        ctx: Context,
        run_id: str,
        owner: str,
        record: RunRecord | None = None,
        snapshot: Prefetched | None = None,
    ) -> HeldRun | None:
        """The run as :func:`tasks.persistence.load` finds it (``record`` and ``snapshot``:
        as read with the lease); None if there is no such run."""
        try:
            loaded = load(ctx, run_id, record=record, snapshot=snapshot)
        except RunNotFound:
            return None
        state = loaded.state
        try:
            agent = ctx.agent(state.agent_file, lambda: _beating(ctx, run_id, owner))
        except AgentFileError as exc:
            raise AgentNotLoaded(
                state,
                f"its agent file cannot be loaded: {exc}; once it loads, "
                f"`ratchet runs resume {run_id}`",
            ) from exc
        return cls(ctx, agent, state, loaded.snapshot_seq, owner)

    # --- the turn's steps -----------------------------------------------------

    def adopt(self) -> None:
        """Checkpoint at once when the snapshot lags the log (a resume, a crashed turn).

        The events past the snapshot were appended by an earlier holder, which may
        still send the checkpoint it owes: a frozen or partitioned worker's save can
        reach the store long after it was sent. Saving ours first makes that late
        save fail its compare-and-set instead of landing while this turn runs. (A turn
        journaled with its lease lags by its own ``model.requested`` only: nothing to adopt.)
        """
        if self.snapshot_seq != self.state.seq and self.state.status.is_live and not self.ahead:
            self.checkpoint()

    def call_model(self, action: CallModel) -> TurnOutcome | None:
        """Call the model and checkpoint its response **before any tool runs**; the turn's
        outcome if that ends it (a provider error ends it as runtime/actions.py says).

        The calls it asks for are journaled as requested in the same transition when all
        of them may run again (:func:`runtime.fsm.requested_with_response`): one store
        call fewer per turn. Any other call is journaled as it starts, so that a crash
        before it started never leaves it looking as if it may have run.

        ``model.requested`` is recorded first, so an attempt counts even if we crash. A
        call that outlives ``model_timeout_s`` is abandoned (Python cannot kill a thread;
        whatever it reports afterwards is dropped) and counts as a failed attempt: the
        next turn asks again, within ``max_turns``."""
        run_id = self.state.run_id
        ahead, self.ahead = self.ahead, None
        if ahead is not None and action is ahead.action:
            # Journaled with the lease (tasks/ahead.py): admitted and counted already.
            request, gate = ahead.request, ahead.gate
        else:
            request = action.request(self.ctx.request_order(run_id))
            prepare = getattr(self.agent.provider, "prepare", None)
            if callable(prepare):
                # Before the limiter decides: a call it lets go must not then wait on setup.
                prepare()
            admitted = limits.admit(self.ctx, self.agent, self.state, request)
            if isinstance(admitted, Wait):
                return self.wait_on_limit(admitted)
            gate = admitted
            self.record([model_requested(request.model_call + 1)])
        self.ctx.remember_request_order(run_id, RequestOrder(action.transcript, request.messages))
        model_calls = request.model_call + 1
        abandoned = threading.Event()

        def observe(kind: str, data: dict[str, Any]) -> None:
            with self._recording:
                if not abandoned.is_set():
                    self.record([(kind, {"turn": model_calls, **data})])

        complete = self._model_call(model_calls, abandoned)
        timeout_s = self.agent.spec.model_timeout_s
        try:
            response = self._within(
                lambda: checked_response(complete(request, observer=observe)),
                timeout_s,
                f"model call for turn {model_calls}",
            )
        except CallTimedOut as exc:
            with self._recording:
                abandoned.set()
            self.record(list(after_model_timeout(model_calls, str(exc))))
            return None
        except ProviderRateLimited as exc:
            return self.wait_on_limit(
                limits.refused(self.ctx, self.agent, self.state, gate, model_calls, exc)
            )
        except ProviderError as exc:
            return self.end(model_failed(self.state.run_id, model_calls, str(exc), exc.retryable))
        if self.ctx.observers:
            self.ctx.observers.reached("model.response.received", model_calls)
        limits.settle(self.ctx, gate, response)
        with self._recording:
            answered = transition(self.ctx, self.state, response_events(response))
        # The answer as the fold put it in the transcript: the message object the snapshot
        # encodes later, so its encoding is made once (store/snapshots/format.py).
        message = next(m for m in reversed(answered.state.transcript) if m.role == "assistant")
        # Twice: its calls are in the transcript and pending, until each has its outcome.
        size = 2 * len(snapshot_format.encode_fragment(message))
        too_large = overflow("the model's answer", size, self.snapshot_room(size))
        if too_large is not None:
            return self.end(model_failed(self.state.run_id, model_calls, too_large, False))
        self.commit(answered, requesting=True)
        if self.ctx.observers:
            self.ctx.observers.reached("model.response.checkpointed", model_calls)
        return self.finish() if self.state.status.is_terminal else None

    def _within(
        self, call: Callable[[], ModelResponse], timeout_s: float, what: str
    ) -> ModelResponse:
        """``call()``, ended by ``timeout_s``: by the provider itself where it bounds its calls
        (no thread to hand the call to, and none left behind: runtime_io/providers/http.py),
        else on a caller thread, abandoned then. CallTimedOut when it did not end in time."""
        if getattr(self.agent.provider, "bounds_calls", False):
            try:
                with call_deadline(timeout_s):
                    return call()
            except DeadlineExceeded:
                raise CallTimedOut(what, timeout_s) from None
        return bounded(call, timeout_s, what)

    def _model_call(
        self, model_calls: int, abandoned: threading.Event
    ) -> Callable[..., ModelResponse]:
        """The provider's ``complete``; for a provider that streams, when someone watches
        the run, one that hands the answer's pieces to the run's live stream
        (tasks/live.py) and, before it returns, waits a moment for the last of them to be
        written (``SETTLE_S``). Nobody watching, the call does not stream at all: reading
        an answer piece by piece costs a worker about half again the CPU of reading it
        whole (bench/streaming.py)."""
        provider = self.agent.provider
        run_id = self.state.run_id
        live = self.ctx.live() if getattr(provider, "streams", False) else None
        if live is None or not watched(live, run_id):
            return provider.complete
        # Named by this attempt's model.requested: a worker that takes the call over after
        # a crash writes under its own, and observers tell the two apart.
        named = {"kind": "model.delta", "run": run_id, "model_call": model_calls}
        named["at"] = self.state.seq

        left = [MAX_PIECES_BYTES]  # a model's output is an input: what it may put in the stream
        observers = self.ctx.observers

        def deltas(piece: dict[str, Any]) -> None:
            if abandoned.is_set():
                return
            shown = live_piece(piece)
            left[0] -= sum(len(v) for v in shown.values() if isinstance(v, str))
            if left[0] < 0:
                if observers:
                    observers.live_dropped("too_large", 1)
                return
            live.put(run_id, {**named, **shown})

        def complete(request: ModelRequest, observer: Observer) -> ModelResponse:
            answer = provider.complete(request, observer=observer, deltas=deltas)  # type: ignore[call-arg]
            live.settle(SETTLE_S)
            return answer

        return complete

    def wait_on_limit(self, wait: Wait) -> TurnOutcome:
        """Record the wait (no attempt counted); the turn ends and is chained after it."""
        self.waited = wait
        if wait.events:
            self.record(wait.events)
        if wait.stalls:
            self.checkpoint()
            return TurnOutcome.STALLED
        return TurnOutcome.NEXT

    def end(self, action: Fail | CheckBinding | Stall | Park | Idle) -> TurnOutcome:
        """Carry out an action that ends the turn: the run fails, stalls, parks, or was idle."""
        if isinstance(action, Fail):
            budget = {"budget": action.budget} if action.budget else {}
            self.record([*action.preceded_by, ("run.failed", {"reason": action.reason, **budget})])
            return self.finish()
        if isinstance(action, CheckBinding):
            first = self.ctx.runs.events(self.state.run_id, after_seq=0, limit=1)
            created = first[0].data.get("binding_document") if first else None
            stall = binding_stall(self.state, self.agent, created)
            log.warning("%s", stall.reason)
            return self.end(stall)
        if isinstance(action, Stall):
            self.record([*action.preceded_by, ("run.stalled", {"reason": action.reason})])
            self.checkpoint()
            return TurnOutcome.STALLED
        if isinstance(action, Park):
            self.checkpointed([("run.parked", action.data)])
            return TurnOutcome.PARKED
        return TurnOutcome.IDLE

    def finish(self) -> TurnOutcome:
        """A terminal run keeps its events; its snapshot has served its purpose."""
        self.ctx.forget_checkpoint(self.state.run_id)
        if not self.dropped:
            self.ctx.snapshots.delete(self.state.run_id)
        if self.state.parent is not None:
            # The fast path; the sweeper tells the parent if this process dies first.
            tell_parent_soon(self.state.run_id)
        return TurnOutcome.of(self.state.status)

    # --- persistence ----------------------------------------------------------

    def record(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        """Append events (fenced by lease and seq) and the record they produce."""
        with self._recording:
            self.state = append_events(self.ctx, self.state, items, self.owner)

    def record_replicated(self, items: list[tuple[str, dict[str, Any]]]) -> NotReplicated | None:
        """:meth:`record`, returning once the run store's replicas hold the events too: the
        journal of a call that is not idempotent, which must not start before a failover
        can no longer lose it (:meth:`~store.runs.RunStore.append_replicated`).

        The NotReplicated if they did not acknowledge it in time: the events are written,
        and this state has them, all the same.
        """
        with self._recording:
            change = transition(self.ctx, self.state, items)
            try:
                append_transition(self.ctx, self.state, change, self.owner, replicated=True)
            except NotReplicated as exc:
                self.state = change.state
                return exc
            self.state = change.state
            return None

    def checkpointed(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        """Record events and checkpoint the state they produce (:meth:`commit`)."""
        with self._recording:
            self.commit(transition(self.ctx, self.state, items))

    def commit(self, change: Transition, requesting: bool = False) -> None:
        """Write ``change`` and checkpoint the state it produces (:meth:`record`, :meth:`checkpoint`).

        One store call when both stores are one Redis: the events, the snapshot and, on
        the turn's last checkpoint, the lease's release, all written or none.
        ``change``: events folded after the current state (:func:`tasks.persistence.transition`).
        ``requesting``: the events are a model response's; the calls it asks for that may
        be journaled with it are (:func:`runtime.fsm.requested_with_response`).
        """
        with self._recording:
            if requesting:
                change = self._requesting(change)
            if self._runs_on(change.state):
                # Not the turn's last checkpoint: the events are the checkpoint, and the
                # snapshot, a cache of their fold, is saved when the turn's work is done.
                self.state = append_transition(self.ctx, self.state, change, self.owner)
                return
            if not self.ctx.runs.commits_with(self.ctx.snapshots):
                self.state = append_transition(self.ctx, self.state, change, self.owner)
                self.checkpoint()
                return
            model_calls = change.state.usage.model_turns
            observers = self.ctx.observers
            terminal = change.state.status.is_terminal
            release = not terminal and self._ends_turn(change.state)
            outbox = self._next_turn(change.state) if release else None
            if observers:  # all of the write made, none of it sent
                observers.reached("snapshot.before_save", model_calls)
            if terminal:
                self._finished(change)
                return
            if release:
                self._letting_go()
            try:
                started = time.perf_counter()
                queued = commit_checkpointed(
                    self.ctx, self.state, change, self.owner, self.snapshot_seq, release,
                    outbox.outbox if outbox is not None else None,
                )  # fmt: skip
                if observers:
                    seconds = time.perf_counter() - started
                    observers.checkpointed(seconds, self.ctx.snapshots.last_save_bytes)
            except StoreUnavailable as exc:
                # All or nothing: the run is still where it was.
                error, stall = after_store_failure(self.state.run_id, change.state.seq, str(exc))
                self._record_stall(stall)
                raise error from exc
            self.state = change.state
            self.snapshot_seq = change.state.seq
            if outbox is not None and queued:
                outbox.sent()
                self.queued = True
            if release:
                self._let_go()
            self.ctx.remember_checkpoint(self.state, change.record)
            if observers:
                observers.reached("snapshot.after_save", model_calls)

    def _finished(self, change: Transition) -> None:
        """The run finished: its events, the snapshot's deletion and the lease's release
        in one store call (its snapshot has served its purpose, :meth:`finish`)."""
        self._letting_go()
        try:
            started = time.perf_counter()
            commit_finished(self.ctx, self.state, change, self.owner)
            if self.ctx.observers:
                self.ctx.observers.checkpointed(time.perf_counter() - started, None)
        except StoreUnavailable as exc:
            error, stall = after_store_failure(self.state.run_id, change.state.seq, str(exc))
            self._record_stall(stall)
            raise error from exc
        self.state = change.state
        self.dropped = True
        self._let_go()
        if self.ctx.observers:
            self.ctx.observers.reached("snapshot.after_save", change.state.usage.model_turns)

    def _letting_go(self) -> None:
        """The write about to be sent releases the lease: the heartbeat, which may find it
        gone before :meth:`_let_go`, is told it is no lease lost."""
        if self._beat is not None:
            heartbeats().releasing(self._beat)

    def _let_go(self) -> None:
        """The lease was released with the write just made: the turn is over, its
        heartbeat stops."""
        self.released = True
        if self._beat is not None:
            heartbeats().remove(self._beat)

    def _requesting(self, change: Transition) -> Transition:
        """``change`` (a model response) with the ``tool.requested`` of the calls it asks for,
        when all of them may run again; ``change`` as it is otherwise."""
        batch = requested_early(self.decided(change.state), self.agent)
        if batch is None:
            return change
        self.requested_early = frozenset(call.id for call in batch.calls)
        return extended(self.ctx, change, [requested_event(call) for call in batch.calls])

    def _next_turn(self, state: RunState) -> Any:
        """The next turn's message, for the checkpoint that ends this turn to push (a
        transactional outbox: no crash between the checkpoint and the enqueue loses the
        run's chain, and one round trip fewer); None to send it after (tasks/turn.py)."""
        priority = limits.turn_priority(self.ctx, self.agent, state)
        return turn_outbox(self.ctx.runs, state.run_id, state.seq, priority)

    def decided(self, state: RunState) -> Action:
        """:func:`runtime.fsm.decide` on ``state``, asked once per state: the checkpoint that
        leaves a state (is it the turn's last? which calls go with it?) and the turn's next
        step (tasks/turn.py) share one answer."""
        if self._decided is None or self._decided[0] is not state:
            self._decided = (state, decide(state, self.agent, self.ctx.runs.clock()))
        return self._decided[1]

    def next_action(self) -> Action:
        """What the run does next (:meth:`decided` on its state), for the turn's loop, which
        takes it once: a loop back to a state it did not move decides again, on a fresh clock."""
        action = self.decided(self.state)
        self._decided = None
        return action

    def _runs_on(self, state: RunState) -> bool:
        """Whether this turn goes on from ``state`` to run (or probe) tool calls itself: a
        checkpoint of ``state`` is then not the turn's last, and another one follows."""
        return (
            state.status.is_live
            and not stopping()
            and isinstance(self.decided(state), (RunTool, Unresolved))
        )

    def _ends_turn(self, state: RunState) -> bool:
        """Whether the turn ends right after checkpointing ``state``, with the next model call
        (the next turn's): that checkpoint takes the lease's release along."""
        return (
            self.asked_model
            and state.status.is_live
            and not stopping()
            and ends_turn(self.decided(state), self.asked_model)
        )

    def snapshot_room(self, size: int) -> int:
        """Bytes the run's snapshot may still take before its reserve (runtime/tools.py
        ``overflow``), for deciding whether ``size`` more fit: its transcript measured as the
        snapshot encodes it, each message once in this process; the rest of the document
        bounded from above, and encoded only when ``size`` comes near that bound."""
        run_id, transcript = self.state.run_id, self.state.transcript
        known = self.ctx.transcript_size(run_id)
        if (
            known is None
            or known.messages > len(transcript)
            or (known.messages and transcript[known.messages - 1] != known.last)
        ):
            known = TranscriptSize(0, 0, None)
        if known.messages < len(transcript):
            more = sum(
                len(snapshot_format.encode_fragment(m)) + 2 for m in transcript[known.messages :]
            )
            known = TranscriptSize(len(transcript), known.bytes + more, transcript[-1])
            self.ctx.remember_transcript_size(run_id, known)
        room = self.ctx.snapshots.max_bytes - known.bytes - SNAPSHOT_RESERVE_BYTES
        # The head holds the pending calls and a suspension (its arguments and its prompt:
        # each at most the fragment of the message that asked: thrice the transcript), and the
        # run's texts, JSON-escaped (at most six bytes a character).
        state = self.state
        texts = len(state.input) + len(state.output or "") + len(state.error or "")
        if size <= room - 3 * known.bytes - 6 * texts - HEAD_BYTES:
            return room - 3 * known.bytes - 6 * texts - HEAD_BYTES
        return room - len(snapshot_format.encode_head(state))

    def checkpoint(self) -> None:
        """Save the snapshot (CAS on seq). Fail-stop: on failure the run stays where it was."""
        model_calls = self.state.usage.model_turns
        observers = self.ctx.observers
        if observers:
            observers.reached("snapshot.before_save", model_calls)
        try:
            started = time.perf_counter()
            save_snapshot(self.ctx, self.state, self.snapshot_seq, self.owner)
            if observers:
                seconds = time.perf_counter() - started
                observers.checkpointed(seconds, self.ctx.snapshots.last_save_bytes)
        except StoreUnavailable as exc:
            error, stall = after_store_failure(self.state.run_id, self.state.seq, str(exc))
            self._record_stall(stall)
            raise error from exc
        self.snapshot_seq = self.state.seq
        self.ctx.remember_checkpoint(self.state)
        if observers:
            observers.reached("snapshot.after_save", model_calls)

    def _record_stall(self, stall: Stall) -> None:
        try:
            self.record([*stall.preceded_by, ("run.stalled", {"reason": stall.reason})])
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


@contextmanager
def _beating(ctx: Context, run_id: str, owner: str) -> Iterator[None]:
    """The lease renewed while the run's agent loads (before the turn's own heartbeat)."""
    beat = heartbeats().add(ctx, run_id, owner)
    try:
        yield
    finally:
        heartbeats().remove(beat)
