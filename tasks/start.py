"""``ratchet.start``: create a run and take its first turn.

Applications usually call :func:`create_run` through the Python API (the run
exists, and a bad agent file is refused, before the call returns) and then
enqueue ``ratchet.turn``. ``ratchet.start`` is the same for clients that only
speak Celery: it creates the run on the worker and goes straight into turn 1.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from runtime.errors import RatchetError, StaleWrite
from runtime.fsm import apply, created_event
from runtime.models import Event, RunState, validate_run_id
from store.runs import RunRecord
from tasks.context import Context, get_context
from tasks.turn import advance, chain
from worker.app import app

MAX_INPUT_BYTES = 1024 * 1024


class InvalidInput(RatchetError):
    def __init__(self, problem: str) -> None:
        super().__init__(f"run input refused: {problem}", problem)


def check_input(text: object) -> str:
    if not isinstance(text, str):
        raise InvalidInput("input must be text")
    if not text.strip():
        raise InvalidInput("input is empty or blank; say what the agent should do")
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_INPUT_BYTES:
        raise InvalidInput(f"input is {size} bytes, over the {MAX_INPUT_BYTES}-byte limit")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput("input is not valid UTF-8") from exc
    return text


def create_run(
    ctx: Context, agent_file: str | Path, text: str, run_id: str | None = None
) -> RunState:
    """Record a new run (its `run.created` event, record and first snapshot).

    Raises AgentFileError for a bad agent file, InvalidInput for bad input,
    StaleWrite if ``run_id`` is already taken.
    """
    run_id = validate_run_id(run_id or uuid.uuid4().hex)
    agent = ctx.agent(agent_file)
    text = check_input(text)
    now = ctx.runs.clock()
    first = Event(
        seq=1, type="run.created", at_ms=now, data=created_event(run_id, agent, text, now)
    )
    state = apply(None, first)
    due = now + int(ctx.settings.lease_s * 1000)
    ctx.runs.create(RunRecord.from_state(state, now, due), first)
    ctx.snapshots.save(state, None)
    return state


@app.task(name="ratchet.start", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def start_run(agent_file: str, text: str, run_id: str) -> str:
    """Create ``run_id`` (if it does not exist yet) and take its first turn. Idempotent."""
    ctx = get_context()
    run_id = validate_run_id(run_id)
    try:
        create_run(ctx, agent_file, text, run_id)
    except StaleWrite:
        pass  # a redelivery of this message: the run exists; the turn below is fenced
    done = advance(ctx, run_id, expected_seq=1)
    if done.outcome == "next":
        chain(run_id, done)
    return done.outcome
