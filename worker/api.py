"""The Python API applications import; the ``ratchet`` CLI is a thin layer over it.

::

    from worker.api import Ratchet

    ratchet = Ratchet()                       # settings from the environment
    run_id = ratchet.start("examples/refund-desk.toml", "Refund order B2")
    record = ratchet.wait(run_id, timeout_s=60)
    print(record.status, record.output)
    for event in ratchet.events(run_id):
        print(event.seq, event.type)
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kombu.exceptions import OperationalError

from runtime.continuation import make_continuation
from runtime.errors import RunNotFound, RunNotQueued, RunRefused
from runtime.models import Event, RunStatus, validate_run_id
from store.runs import JournalEntry, RunRecord
from tasks.context import Context, get_context
from tasks.control import apply_continuation, cancel, new_continuation_id
from tasks.start import start
from tasks.turn import run_turn


class Ratchet:
    """Start runs and read them. Every method validates ids at the edge."""

    def __init__(self, context: Context | None = None) -> None:
        self.ctx = context or get_context()

    def start(
        self,
        agent_file: str | Path,
        text: str,
        run_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        """Create a run and enqueue its first turn; returns the run id. Idempotent by key.

        The key is ``run_id`` or ``idempotency_key`` (the run id is derived from it):
        the same key with the same agent file and input returns the existing run (and
        queues its first turn again if it has not started; a duplicate turn is fenced),
        another agent file or input under it is refused (StartConflict). The agent file
        and input are checked here, so a bad one is refused before anything is queued
        (AgentFileError, InvalidInput). RunNotQueued: the run is recorded but the broker
        could not take its first turn; the crash sweeper queues it once the broker is back.
        """
        started = start(self.ctx, agent_file, text, run_id, idempotency_key)
        if started.awaits_first_turn:
            try:
                run_turn.apply_async((started.run_id, 1))
            except (OperationalError, OSError) as exc:
                problem = " ".join(str(exc).split()) or type(exc).__name__
                raise RunNotQueued(started.run_id, f"broker: {problem}") from exc
        return started.run_id

    def continue_run(
        self,
        run_id: str,
        input: str | bytes | None = None,
        approve: bool | None = None,
        deny: str | None = None,
        continuation_id: str | None = None,
        suspension_seq: int | None = None,
    ) -> str:
        """Answer a suspended run now and queue its next turn; ``continued`` or ``duplicate``.

        ``input`` answers a question or a blocker; ``approve=True`` or ``deny=REASON``
        a tool awaiting approval. The same ``continuation_id`` twice is applied once
        (``duplicate``). Refusals name the run and the problem: InvalidContinuation,
        RunNotFound, RunRefused (and SuspensionAlreadyAnswered, SuspensionMismatch,
        SuspensionExpired), BindingChanged.
        """
        continuation = make_continuation(
            validate_run_id(run_id),
            continuation_id or new_continuation_id(),
            input=input,
            approve=True if approve else None,
            deny=deny,
            suspension_seq=suspension_seq,
        )
        return apply_continuation(self.ctx, continuation)

    def cancel(self, run_id: str, reason: str | None = None) -> RunRecord:
        """Stop a live, suspended or parked run at its next boundary; returns its record.

        RunRefused if it has already finished. A turn in progress stops at its next write.
        """
        return cancel(self.ctx, run_id, reason)

    def get(self, run_id: str) -> RunRecord:
        """The run's record; RunNotFound if there is none."""
        record = self.ctx.runs.get(validate_run_id(run_id))
        if record is None:
            raise RunNotFound(run_id)
        return record

    def list(self, status: RunStatus | None = None, limit: int = 100) -> list[RunRecord]:
        return self.ctx.runs.list(status, limit)

    def events(self, run_id: str, after_seq: int = 0) -> builtins.list[Event]:
        self.get(run_id)
        return self.ctx.runs.events(run_id, after_seq)

    def follow(
        self, run_id: str, poll_s: float = 0.05, timeout_s: float | None = None
    ) -> Iterator[Event]:
        """Yield the run's events as they are appended, until it stops being live."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seq = 0
        while True:
            for event in self.ctx.runs.events(run_id, after_seq=seq):
                seq = event.seq
                yield event
            record = self.get(run_id)
            if not record.status.is_live and record.last_seq <= seq:
                return
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(poll_s)

    def wait(self, run_id: str, timeout_s: float = 300, poll_s: float = 0.05) -> RunRecord:
        """Poll until the run is no longer live (finished, suspended or parked), or time out."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.get(run_id)
            if not record.status.is_live or time.monotonic() > deadline:
                return record
            time.sleep(poll_s)

    def snapshot_document(self, run_id: str) -> bytes | None:
        """The run's snapshot exactly as stored, or None (finished runs have none)."""
        self.get(run_id)
        return self.ctx.snapshots.load_document(run_id)

    # --- recovery (tasks/recovery.py) -----------------------------------------

    def resume(self, run_id: str) -> str:
        """Enqueue a resume of a stopped run; returns the status it had.

        Classified here first, so a run that cannot resume is refused at once:
        RunRefused (complete, suspended, parked, no checkpoint, budget or
        deadline exhausted, a worker holds it) or BindingChanged, each naming
        the next step. The worker classifies again before it acts.
        """
        from tasks.recovery import examine, resume_run

        state, _, verdict = examine(self.ctx, run_id)
        if verdict.refusal is not None:
            raise verdict.refusal
        assert state is not None
        lease = self.ctx.runs.lease(run_id)
        if lease is not None:
            raise RunRefused(
                run_id,
                state.status.value,
                f"worker {lease.owner} holds its lease and is advancing it; nothing to resume "
                f"(follow it with `ratchet runs events {run_id} --follow`)",
            )
        resume_run.apply_async((run_id, "operator", None))
        return state.status.value

    def reconcile(
        self,
        run_id: str,
        call_id: str,
        decision: str,
        result: Any = None,
        reason: str | None = None,
    ) -> RunRecord:
        """Decide the open call of a parked run (`result`, `retry` or `fail`); the run goes on.

        RunRefused unless the run is needs_reconciliation and ``call_id`` is its open call.
        """
        from tasks.recovery import reconcile

        self.get(run_id)
        reconcile(self.ctx, run_id, call_id, decision, result, reason)
        return self.get(run_id)

    def open_call(self, run_id: str) -> JournalEntry | None:
        """The journal's call with no recorded outcome, if any (what a parked run waits on)."""
        self.get(run_id)
        settled = {
            e.data["call_id"]
            for e in self.ctx.runs.events(run_id)
            if e.type == "tool.reconciled" and e.data.get("decision") != "retry"
        }
        open_calls = [
            e
            for e in self.ctx.runs.journal(run_id)
            if e.status == "requested" and e.call_id not in settled
        ]
        return open_calls[-1] if open_calls else None

    def sweep(self) -> builtins.list[str]:
        """One crash sweep: enqueue a resume for each orphaned run; their ids."""
        from tasks.recovery import sweep_orphans

        return sweep_orphans(self.ctx)
