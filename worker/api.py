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

import asyncio
import builtins
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kombu.exceptions import OperationalError

from runtime.continuation import check_pinned, make_continuation
from runtime.errors import (
    AnswerNotQueued,
    InvalidOption,
    RatchetError,
    RunNotFound,
    RunNotQueued,
    RunRefused,
    StoreError,
)
from runtime.models import FINISHED_STATUSES, Event, RunStatus, Suspension, validate_run_id
from runtime.numbers import finite
from runtime.recovery import OPERATOR
from store.runs import JournalEntry, RunRecord
from tasks.context import Context, get_context
from tasks.control import apply_continuation, cancel, new_continuation_id
from tasks.lease import TURN_PATIENCE_S, holding
from tasks.messages import Start, enqueue_resume, enqueue_turn, sending_app
from tasks.persistence import Loaded, load
from tasks.start import start
from worker.watch import WATCH_S, Seen, parse_watch_cursor, watch


def make_cursor(record: RunRecord) -> str:
    """Where the next page of `list_page` starts: just after this record."""
    return f"{record.created_at_ms}.{record.run_id}"


def parse_cursor(cursor: str) -> tuple[int, str]:
    created, _, run_id = cursor.partition(".")
    if not created.isdigit() or not run_id:
        raise InvalidOption(f"--cursor {cursor[:80]!r} is not a cursor a previous page printed")
    return int(created), validate_run_id(run_id)


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
        *,
        priority: int | None = None,
        concurrency_key: str | None = None,
        watch: bool = False,
    ) -> str:
        """Create a run and enqueue its first turn; returns the run id. Idempotent by key.

        ``watch``: say someone watches the run before its first turn is sent, so its first
        model call streams too (then read it with :meth:`stream`; docs/streaming.md).

        ``priority`` (0-4, higher first) overrides the agent's ``[limits] priority``;
        ``concurrency_key`` (e.g. a tenant) puts the run under the agent's
        ``max_runs_per_key`` (docs/limits.md).

        The key is ``run_id`` or ``idempotency_key`` (the run id is derived from it):
        the same key with the same agent file and input returns the existing run (and
        queues its first turn again if it has not started; a duplicate turn is fenced),
        another agent file or input under it is refused (StartConflict). The agent file
        and input are checked here, so a bad one is refused before anything is queued
        (AgentFileError, InvalidInput). RunNotQueued: the run is recorded but the broker
        could not take its first turn; the crash sweeper queues it once the broker is back.
        """
        # Unchecked here: start() checks every field and names what is wrong more
        # precisely (InvalidRunId, InvalidInput) than the message model's strict check.
        request = Start.model_construct(
            agent_file=agent_file,
            text=text,
            run_id=run_id,
            idempotency_key=idempotency_key,
            priority=priority,
            concurrency_key=concurrency_key,
        )
        from worker.senders import BrokerUnready, check_broker

        try:
            check_broker(self.ctx.settings, sending_app())
        except BrokerUnready:
            pass  # recorded all the same: RunNotQueued says so, and the sweeper queues it
        started = start(self.ctx, request)
        live = self.ctx.runs.live() if watch else None
        if live is not None:
            try:
                live.watch(started.run_id, WATCH_S)
            except StoreError:
                pass  # its first answer shows when it commits; the next ones as they form
        if started.awaits_first_turn:
            from tasks.limits import first_turn_priority

            level = first_turn_priority(self.ctx, self.ctx.agent(agent_file), priority)
            try:
                enqueue_turn(run_id=started.run_id, expected_seq=1, priority=level)
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
        (``duplicate``). Give ``continuation_id`` or ``suspension_seq`` (the seq
        :meth:`suspension` shows), or both: an answer that names neither could
        answer a later question than the one it was written for, so it is refused
        (InvalidContinuation) unless ``RATCHET_ALLOW_UNPINNED_CONTINUATIONS`` is set. Refusals name the run and the problem: InvalidContinuation,
        RunNotFound, RunRefused (and SuspensionAlreadyAnswered, SuspensionMismatch,
        SuspensionExpired), BindingChanged.
        """
        run_id = validate_run_id(run_id)
        check_pinned(
            run_id,
            continuation_id,
            suspension_seq,
            allow_unpinned=self.ctx.settings.allow_unpinned_continuations,
        )
        continuation = make_continuation(
            run_id,
            continuation_id or new_continuation_id(),
            input=input,
            approve=True if approve else None,
            deny=deny,
            suspension_seq=suspension_seq,
        )
        from worker.senders import check_broker

        # The answer is taken only when its next turn can be queued: recorded, and then
        # not queued, the run would move on and wait for the sweeper.
        check_broker(self.ctx.settings, sending_app())
        chained: list[int] = []

        def chain(run_id: str, seq: int) -> None:
            chained.append(seq)
            enqueue_turn(run_id=run_id, expected_seq=seq)

        try:
            return apply_continuation(self.ctx, continuation, enqueue=chain)
        except RatchetError:
            raise
        except Exception as exc:  # the broker's, of whatever kind (kombu's, py-amqp's, OSError)
            if not chained:
                raise
            problem = " ".join(str(exc).split()) or type(exc).__name__
            raise AnswerNotQueued(run_id, chained[-1], f"broker: {problem}") from exc

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

    def list_page(
        self,
        status: RunStatus | None = None,
        *,
        agent: str | None = None,
        since_ms: int | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[builtins.list[RunRecord], str | None]:
        """One page of runs, newest first, and the cursor of the next page (None: no more).

        ``agent`` keeps one agent's runs, ``since_ms`` those created at or after it;
        ``cursor`` is what the previous page returned.
        """
        if limit < 1:
            raise InvalidOption(f"--limit must be at least 1, not {limit}")
        after = parse_cursor(cursor) if cursor is not None else None
        scan = max(limit * 2, 100)
        while True:
            found = self.ctx.runs.list(status, scan)
            page: builtins.list[RunRecord] = []
            for record in found:
                key = (record.created_at_ms, record.run_id)
                if after is not None and key >= after:
                    continue
                if since_ms is not None and record.created_at_ms < since_ms:
                    break
                if agent is not None and record.agent != agent:
                    continue
                page.append(record)
                if len(page) > limit:
                    break
            exhausted = len(found) < scan or (
                since_ms is not None and bool(found) and found[-1].created_at_ms < since_ms
            )
            if len(page) > limit or exhausted:
                break
            scan *= 4
        more = len(page) > limit
        page = page[:limit]
        return page, (make_cursor(page[-1]) if more and page else None)

    def suspension(self, run_id: str) -> Suspension | None:
        """What the run waits for (its ``seq`` is what an answer names), or None."""
        record = self.get(run_id)
        return record.suspension if record.status.is_suspended else None

    def events(self, run_id: str, after_seq: int = 0) -> builtins.list[Event]:
        self.get(run_id)
        return self.ctx.runs.events(run_id, after_seq)

    def follow(
        self,
        run_id: str,
        poll_s: float = 0.05,
        timeout_s: float | None = None,
        until_suspended: bool = False,
    ) -> Iterator[Event]:
        """Yield the run's events as they are appended, until it is terminal.

        A suspended or parked run is followed on: a person or an operator may move it.
        ``until_suspended``: stop as soon as it is not live (suspended, parked, stalled).
        """
        finite("poll_s", poll_s)
        deadline = None if timeout_s is None else time.monotonic() + finite("timeout_s", timeout_s)
        seq = 0
        while True:
            for event in self.ctx.runs.events(run_id, after_seq=seq):
                seq = event.seq
                yield event
            record = self.get(run_id)
            stopped = record.status in FINISHED_STATUSES or (
                until_suspended and not record.status.is_live
            )
            if stopped and record.last_seq <= seq:
                return
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(poll_s)

    def stream(
        self,
        run_id: str,
        after: str | None = None,
        timeout_s: float | None = None,
        until_suspended: bool = False,
        idle_s: float | None = None,
    ) -> Iterator[Seen]:
        """Yield the run's committed events and, between them, its answer as it forms
        (``model.delta``), attempts that ended unanswered (``model.aborted``) and tools'
        progress (``tool.progress``), in order, until it is finished (worker/watch.py).

        Each item's ``cursor``, passed back as ``after``, goes on just after it: nothing
        still kept is missed, nothing is seen twice. ``after=None`` starts from the run's
        first event, then the current attempt's text so far. ``idle_s``: yield an ``idle``
        item after that long with nothing else, so a caller may stop between items.
        """
        self.get(run_id)
        if after is not None:
            parse_watch_cursor(after)
        return watch(self.ctx.runs, run_id, after, timeout_s, until_suspended, idle_s=idle_s)

    async def astream(
        self,
        run_id: str,
        after: str | None = None,
        timeout_s: float | None = None,
        until_suspended: bool = False,
    ) -> AsyncIterator[Seen]:
        """:meth:`stream` for asyncio code: each wait for the next item runs in a thread
        (``asyncio.to_thread``), so the event loop is never blocked. Yields ``idle`` items
        every 15 s of quiet, between which a task may be cancelled."""
        seen = self.stream(run_id, after, timeout_s, until_suspended, idle_s=15.0)
        done = Seen("", "end")
        while (item := await asyncio.to_thread(next, seen, done)) is not done:
            yield item

    def wait(self, run_id: str, timeout_s: float = 300, poll_s: float = 0.05) -> RunRecord:
        """Poll until the run is finished, waits for a person, or is parked; or time out.

        A run in a `wait` or waiting for a child run goes on by itself: it is waited for.
        """
        finite("poll_s", poll_s)
        deadline = time.monotonic() + finite("timeout_s", timeout_s)
        while True:
            record = self.get(run_id)
            going_on = record.status.is_live or record.status == RunStatus.WAITING
            if not going_on or time.monotonic() > deadline:
                return record
            time.sleep(poll_s)

    def load(self, run_id: str) -> Loaded:
        """The run as a worker loads it: its state, and the seq of its snapshot if usable.

        An unusable snapshot is treated as missing (the state is rebuilt from the
        events) and, unless a worker holds the run right now, moved aside with one
        WARNING, exactly as the run's next turn would. RunNotFound if there is no run.
        """
        self.get(run_id)
        with self._lease_if_free(run_id) as held:
            return load(self.ctx, run_id, set_aside=held)

    @contextmanager
    def _lease_if_free(
        self, run_id: str, recovers: bool = False, patience_s: float = 0.0
    ) -> Iterator[bool]:
        """Hold the run's lease for a moment if no live worker does; whether it is held.

        A dead worker's lease is taken over (:mod:`tasks.lease`); one that left its run
        mid-turn is not held here, and a resume of it is enqueued — unless the caller
        ``recovers`` the run itself (a resume), when it is held like any other.
        ``patience_s``: how long a worker that holds it may take to let go.
        """
        run_id = validate_run_id(run_id)
        with holding(
            self.ctx, run_id, must=False, recovers=recovers, patience_s=patience_s
        ) as held:
            yield held.taken

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
        from tasks.resumption import examine

        # A run its dead holder left mid-turn is this resume's to recover: holding it
        # here sends no sweeper resume of it besides the operator's. The turn that stalled
        # or failed the run shows its status a moment before it lets the lease go: a
        # resume sent as soon as the status shows waits for that (a turn's patience).
        with self._lease_if_free(run_id, recovers=True, patience_s=TURN_PATIENCE_S) as held:
            state, _, verdict = examine(self.ctx, run_id, set_aside=held)
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
        enqueue_resume(run_id=run_id, by=OPERATOR)
        return state.status.value

    def resume_and_wait(self, run_id: str, timeout_s: float = 10.0) -> tuple[str, Event | None]:
        """Resume the run and wait up to ``timeout_s`` for a worker's answer.

        Returns (the status it had, the worker's ``run.resumed`` event), or (status,
        None) when no worker took the resume in time. Raises RunRefused when the run
        cannot resume — refused here at once, or by the worker, which classifies again
        with what it sees (its own agent files and tool modules) and records why in a
        ``run.resume_refused`` event.
        """
        finite("timeout_s", timeout_s)
        before = self.get(run_id).last_seq
        status = self.resume(run_id)
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self.ctx.runs.events(run_id, after_seq=before):
                if event.type == "run.resumed" and event.data.get("by") == "operator":
                    return status, event
                if event.type == "run.resume_refused":
                    raise RunRefused(
                        run_id,
                        str(event.data.get("status") or status),
                        f"a worker refused to resume it: {event.data.get('reason')}",
                    )
            if time.monotonic() > deadline:
                return status, None
            time.sleep(0.05)

    def purge_candidates(self, before_ms: int, limit: int = 100_000) -> builtins.list[RunRecord]:
        """The finished runs a purge with this cutoff would delete (what `--dry-run` lists)."""
        found = [
            record
            for status in sorted(FINISHED_STATUSES)
            for record in self.ctx.runs.list(status, limit)
            if record.updated_at_ms < before_ms
        ]
        return sorted(found, key=lambda r: (r.updated_at_ms, r.run_id))

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
        events = self.ctx.runs.events(run_id)
        settled = {
            e.data["call_id"]
            for e in events
            if e.type == "tool.reconciled" and e.data.get("decision") != "retry"
        }
        open_calls = [
            e
            for e in self.ctx.runs.journal(run_id)
            if e.status == "requested" and e.call_id not in settled
        ]
        # Parallel calls may leave several open: the one the run was parked on comes first.
        parked = [e.data.get("call_id") for e in events if e.type == "run.parked"]
        for entry in open_calls:
            if parked and entry.call_id == parked[-1]:
                return entry
        return open_calls[-1] if open_calls else None

    def sweep(self) -> builtins.list[str]:
        """One crash sweep: enqueue a resume for each orphaned run; their ids."""
        from tasks.recovery import sweep_orphans

        return sweep_orphans(self.ctx)

    def fork(
        self,
        run_id: str,
        at_seq: int | None = None,
        new_run_id: str | None = None,
        *,
        rebind: bool = False,
    ) -> tuple[str, tuple[str, ...]]:
        """A new run at ``run_id``'s state at ``at_seq`` (default: its last); (new id, notes).

        The original is untouched. ``notes`` name the calls the fork will run again
        although the original already ran them (tools that are not idempotent).
        RunRefused for a seq that cannot be forked (ended there, or a call in flight),
        BindingChanged when the agent changed since and ``rebind`` is not set.
        """
        from tasks.fork import fork

        forked = fork(self.ctx, run_id, at_seq, new_run_id, rebind=rebind)
        return forked.state.run_id, forked.notes

    def raise_budgets(
        self, run_id: str, changes: dict[str, str], reason: str, by: str = "operator"
    ) -> RunRecord:
        """Give a run more: ``changes`` maps a budget to ``"+N"`` (N more) or ``"N"`` (new limit).

        Recorded as ``run.budget_raised`` with ``by`` and ``reason``; a run that had
        stopped on a budget goes on from where it stopped. RunRefused for a run that
        ended another way; InvalidRequest for a change that is not a raise.
        """
        from tasks.budget import raise_budgets

        raise_budgets(self.ctx, run_id, changes, by, reason)
        return self.get(run_id)

    def tool_policies(self, run_id: str) -> builtins.list[dict[str, Any]]:
        """How each MCP tool of the run's binding is treated, and where that came from: the
        server's annotation, the agent file, or the default (runtime_io/mcp/tools.py ``policy``)."""
        first = self.ctx.runs.events(run_id, after_seq=0, limit=1)
        document = first[0].data.get("binding_document") if first else None
        if not isinstance(document, dict):
            return []
        approving = set((document.get("policy") or {}).get("require_approval") or ())
        policies = []
        for tool in document.get("tools") or ():
            mcp = tool.get("mcp") if isinstance(tool, dict) else None
            if not isinstance(mcp, dict):
                continue
            sources = mcp.get("policy_from") or {}
            approval, approval_from = tool.get("name") in approving, sources.get("approval")
            if approval and approval_from == "default":
                # The server's default is no approval: the file's `[policy]` list asked for it.
                approval_from = "[policy] require_approval"
            policies.append(
                {
                    "tool": tool.get("name"),
                    "server": mcp.get("server"),
                    "idempotent": bool(tool.get("idempotent")),
                    "idempotent_from": sources.get("idempotent"),
                    "approval": approval,
                    "approval_from": approval_from,
                }
            )
        return policies

    def lineage(self, run_id: str) -> dict[str, Any]:
        """The runs this one is linked to: ``parent``, ``children`` (in order), ``forked_from``."""
        from runtime.children import RUN_CHILD, child_run_id

        events = self.events(run_id)
        created = events[0].data if events else {}
        children = [
            child_run_id(run_id, e.data["call_id"])
            for e in events
            if e.type == "run.suspended" and e.data.get("tool") == RUN_CHILD
        ]
        fork = created.get("fork")
        return {
            "parent": (created.get("parent") or {}).get("run_id"),
            "children": list(dict.fromkeys(children)),
            "forked_from": {"run_id": fork["run_id"], "seq": fork["seq"]} if fork else None,
        }
