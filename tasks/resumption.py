"""Resuming a run under its lease: one path for ``ratchet.resume`` and for a turn.

A resume (the operator's, the sweeper's) and a turn that took its run's lease from a
dead holder (tasks/turn.py) both come here: :func:`recover` takes (or renews) the lease,
loads and classifies the run (:func:`examine`, :mod:`runtime.recovery`), and then
refuses, dead-letters, or records ``run.resumed`` and hands the still-held lease back
as :class:`Resumed`, for the caller to take the turn with. It takes no turn itself, so
it sits below both tasks/turn.py and tasks/recovery.py and imports neither.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from runtime.actions import Advanced, TurnOutcome
from runtime.agent import describe_binding_change
from runtime.errors import (
    LeaseLost,
    RatchetError,
    RunStateLost,
    StaleWrite,
    ToolModuleChanged,
)
from runtime.models import Event, RunState, validate_run_id
from runtime.recovery import (
    DeadLetter,
    Verdict,
    classify,
    consecutive_recoveries,
    dead_letter,
)
from tasks import lease
from tasks.context import Context
from tasks.persistence import append_ending, append_events, load

log = logging.getLogger("ratchet.recovery")
"""The logger tasks/recovery.py logs under: a resume's lines keep the name operators filter on."""


class Resumed(NamedTuple):
    """``run.resumed`` was recorded: the turn goes on from ``seq``, under ``owner``'s lease."""

    seq: int
    owner: str


def examine(
    ctx: Context, run_id: str, set_aside: bool = True
) -> tuple[RunState | None, list[Event], Verdict]:
    """Load the run (:func:`tasks.persistence.load`) and classify it for resume.

    ``set_aside``: move an unusable snapshot aside (callers that hold the lease).
    RunNotFound if there is no such run; a run whose events cannot give a state
    is classified with ``state`` None (restart-required).
    """
    run_id = validate_run_id(run_id)
    state: RunState | None
    try:
        loaded = load(ctx, run_id, whole_log=True, set_aside=set_aside)
        state, events = loaded.state, loaded.log()
    except RunStateLost as exc:
        log.warning("%s", exc)
        state, events = None, ctx.runs.events(run_id)
    binding, change, problem = None, "binding", None
    if state is not None:
        try:
            agent = ctx.agent(state.agent_file)
            binding = agent.binding
            created = events[0].data.get("binding_document") if events else None
            if created:
                change = describe_binding_change(created, agent.binding_document)
        except ToolModuleChanged as exc:
            problem = exc.for_run(run_id)  # the file is fine; this worker's module is not
            log.warning("run %s: %s", run_id, problem)
        except (RatchetError, OSError) as exc:
            log.warning("run %s: agent file cannot be loaded: %s", run_id, exc)
            problem = (
                f"its agent file {state.agent_file} cannot be loaded ({exc}); restore it and "
                "resume, or start the run again"
            )
    verdict = classify(
        run_id,
        state,
        agent_binding=binding,
        binding_change=change,
        now_ms=ctx.runs.clock(),
        agent_problem=problem,
    )
    return state, events, verdict


def recover(
    ctx: Context, run_id: str, by: str, seen_seq: int | None = None, owner: str | None = None
) -> Advanced | Resumed:
    """Classify and record ``run.resumed``, or refuse, or dead-letter; takes no turn.

    The lease is taken also from a holder whose process is dead (:mod:`tasks.lease`);
    ``owner``: a turn that already took it so passes its owner id. :class:`Resumed`
    leaves the lease held for the caller's turn; anything else has let it go.
    """
    # Patience 0: a holder that is alive is advancing the run, which is then not orphaned.
    with lease.holding(ctx, run_id, owner, must=False, recovers=True) as held:
        if not held.taken:
            reason = held.busy.reason if held.busy is not None else "lease held"
            log.info("run %s: %s, so it is not orphaned; no resume", run_id, reason)
            return Advanced(TurnOutcome.LEASED, -1, 0)
        took_over = owner is not None or held.took_from is not None
        resumed = _resume_holding(ctx, run_id, by, seen_seq, held.owner, took_over)
        if isinstance(resumed, Advanced):
            return resumed
        held.released = True  # the caller's turn holds it on and lets it go
    return Resumed(resumed, held.owner)


def _resume_holding(
    ctx: Context, run_id: str, by: str, seen_seq: int | None, owner: str, took_over: bool
) -> Advanced | int:
    """:func:`resume`'s decision under the lease: the seq of the recorded ``run.resumed``
    to take the turn from, or what it did instead (refused, stale, dead-lettered, fenced)."""
    try:
        state, events, verdict = examine(ctx, run_id)
        seq = state.seq if state is not None else _last_seq(ctx, run_id)
        # A run that moved since the sweep saw it is in a live worker's hands, unless its
        # lease was just taken from a dead process: then nobody moves it but this resume
        # (the moves were the dead worker's last writes), and refusing would leave it
        # with no lease and no turn queued until it is overdue, a whole lease later.
        if seen_seq is not None and seq != seen_seq and not took_over:
            log.info(
                "run %s moved from seq %s to %s since the sweep; no resume", run_id, seen_seq, seq
            )
            return Advanced(TurnOutcome.STALE, seq, 0)
        turns = state.usage.model_turns if state is not None else 0
        ending = dead_letter(
            run_id, by, verdict, consecutive_recoveries(events), ctx.settings.max_recovery_attempts
        )
        if ending is not None:
            return _dead_letter(ctx, run_id, state, ending, verdict.reason, owner)
        if not verdict.eligible:
            log.warning("%s", verdict.reason)
            if state is not None and not state.status.is_terminal:
                # Recorded, so the operator who asked (`ratchet runs resume`) is told.
                data = {"by": by, "status": state.status.value, "reason": verdict.reason}
                seq = append_events(ctx, state, [("run.resume_refused", data)], owner).seq
            return Advanced(TurnOutcome.REFUSED, seq, turns)
        assert state is not None
        attempt = state.recovery_attempts + 1
        resumed = append_events(
            ctx, state, [("run.resumed", {"by": by, "attempt": attempt})], owner
        )
        log.info("run %s: resumed by %s at seq %s (attempt %s)", run_id, by, state.seq, attempt)
        return resumed.seq
    except (LeaseLost, StaleWrite) as exc:
        log.warning("%s", exc)
        return Advanced(TurnOutcome.FENCED, -1, 0)


def _last_seq(ctx: Context, run_id: str) -> int:
    """The seq the run's record shows (what the sweeper saw), for a run with no state."""
    record = ctx.runs.get(run_id)
    return record.last_seq if record is not None else -1


def _dead_letter(
    ctx: Context,
    run_id: str,
    state: RunState | None,
    ending: DeadLetter,
    verdict_reason: str,
    owner: str,
) -> Advanced:
    """Carry out ``ending`` on a run still live; a run that is not is only refused."""
    data = ending.data
    record = ctx.runs.get(run_id)
    live = state.status.is_live if state is not None else bool(record and record.status.is_live)
    if record is None or not live:
        log.warning("run %s: not resumed: %s", run_id, verdict_reason)
        return Advanced(TurnOutcome.REFUSED, state.seq if state else -1, 0)
    if state is None:
        # Nothing to fold onto, but left live the run would be found every sweep.
        ended = append_ending(ctx, record, "run.dead_lettered", data, owner)
        log.error("run %s: dead-lettered: %s", run_id, data["reason"])
        return Advanced(TurnOutcome.DEAD_LETTERED, ended.last_seq, ended.usage.model_turns)
    state = append_events(ctx, state, [("run.dead_lettered", data)], owner)
    log.error("run %s: dead-lettered: %s", run_id, data["reason"])
    return Advanced(TurnOutcome.DEAD_LETTERED, state.seq, state.usage.model_turns)
