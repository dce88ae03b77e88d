"""``ratchet.start``: create a run and take its first turn.

Applications usually call :func:`create_run` through the Python API (the run
exists, and a bad agent file is refused, before the call returns) and then
enqueue ``ratchet.turn``. ``ratchet.start`` is the same for clients that only
speak Celery: it creates the run on the worker and goes straight into turn 1.

**A start is idempotent by its key**: the run id, or an idempotency key the run id
is derived from (``ratchet runs start --idempotency-key``, ``Ratchet.start(...,
idempotency_key=)``, the ``ratchet.start`` task's ``idempotency_key``; a task
message with neither is keyed by its Celery task id, which a redelivery keeps).
The same key with the same agent file and input gives the existing run; another
agent file or input under the same key is refused (StartConflict), so a client
that retries a start it believes failed never starts the work twice.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from runtime.agent import Agent
from runtime.children import is_child_run_id, root_tree
from runtime.errors import InvalidInput, InvalidRequest, StaleWrite, StartConflict
from runtime.fsm import apply, created_event
from runtime.limits import check_key
from runtime.models import Event, RunState, RunStatus, validate_run_id
from store.runs import RunRecord
from tasks.context import Context, get_context
from tasks.messages import Start
from tasks.task_base import ratchet_task
from tasks.turn import advance, enqueue_next

MAX_INPUT_BYTES = 1024 * 1024
MAX_KEY_BYTES = 1024
log = logging.getLogger("ratchet.start")


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
    ctx: Context,
    agent_file: str | Path,
    text: str,
    run_id: str | None = None,
    *,
    priority: int | None = None,
    concurrency_key: str | None = None,
) -> RunState:
    """Record a new run (its `run.created` event, record and first snapshot).

    Raises AgentFileError for a bad agent file, InvalidInput for bad input (also a
    priority outside 0-4 or a malformed concurrency key), StaleWrite if ``run_id``
    is already taken.
    """
    run_id = check_new_run_id(run_id or uuid.uuid4().hex)
    agent = ctx.agent(agent_file)
    text = check_input(text)
    check_limits(priority, concurrency_key)
    now = ctx.runs.clock()
    data = created_event(run_id, agent, text, now, priority, concurrency_key, tree_for(ctx, agent))
    first = Event(seq=1, type="run.created", at_ms=now, data=data)
    state = apply(None, first)
    due = now + int(ctx.settings.lease_s * 1000)
    ctx.runs.create(RunRecord.from_state(state, now, due), first)
    ctx.snapshots.save(state, None)
    # Remembered as any checkpoint this process saved: the label of the first turn's
    # message (worker/observe.py) and a first turn taken here need not read it back. No
    # record goes with it: the one written is the store's to keep.
    ctx.remember_checkpoint(state)
    return state


def check_new_run_id(run_id: object) -> str:
    """The id a start or a fork from outside names: valid, and not one reserved for children
    (a run squatting on a child's id would stand where the parent's call expects its own
    child). Raises InvalidRunId, InvalidRequest."""
    run_id = validate_run_id(run_id)
    if is_child_run_id(run_id):
        raise InvalidRequest(
            f"run id {run_id} is reserved: ids of the shape child-<40 hex digits> are the ids "
            "child runs get; choose another id"
        )
    return run_id


def tree_for(ctx: Context, agent: Agent) -> dict[str, Any] | None:
    """A root's run tree limits: its agent file's, else the fleet's; None for an agent that
    starts no children (a run pays for what it uses)."""
    if not agent.spec.children:
        return None
    spec, settings = agent.spec, ctx.settings
    return root_tree(
        settings.max_child_depth if spec.max_child_depth is None else spec.max_child_depth,
        settings.max_tree_runs if spec.max_tree_runs is None else spec.max_tree_runs,
    )


def check_limits(priority: object, concurrency_key: object) -> None:
    """A start's priority and concurrency key, as given from outside; InvalidInput if not."""
    if priority is not None and (
        not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 4
    ):
        raise InvalidInput(f"priority must be a whole number from 0 to 4, not {priority!r}")
    if concurrency_key is not None:
        try:
            check_key(concurrency_key, "the concurrency key")
        except InvalidRequest as exc:
            raise InvalidInput(exc.problem) from None


def run_id_for(run_id: str | None, idempotency_key: str | None) -> str:
    """The id a start creates: ``run_id``, else one derived from the key, else a new one."""
    if run_id is not None and idempotency_key is not None:
        raise InvalidInput("give a run id or an idempotency key, not both (the run id is a key)")
    if idempotency_key is None:
        return validate_run_id(run_id or uuid.uuid4().hex)
    if not isinstance(idempotency_key, str) or not idempotency_key.strip():
        raise InvalidInput("the idempotency key is empty or blank")
    size = len(idempotency_key.encode("utf-8", errors="surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise InvalidInput(f"the idempotency key is {size} bytes, over {MAX_KEY_BYTES}")
    digest = hashlib.sha256(idempotency_key.encode("utf-8", errors="surrogatepass"))
    return "key-" + digest.hexdigest()[:40]


class Started(NamedTuple):
    run_id: str
    created: bool
    """False: the key named a run that already existed (with the same agent and input)."""
    awaits_first_turn: bool
    """Nothing has happened to the run yet: its first turn should be (re)queued."""


def start(ctx: Context, request: Start) -> Started:
    """Create the run the key names, or find it: the one path every start takes.

    ``request`` may come unchecked (``Start.model_construct``, from Python callers):
    every field is checked here. Raises StartConflict when the key's run exists with
    another agent file or input, AgentFileError, InvalidInput (also for a run id and
    a key both given).
    """
    run_id = run_id_for(request.run_id, request.idempotency_key)
    agent_file, text = request.agent_file, request.text
    try:
        create_run(
            ctx,
            agent_file,
            text,
            run_id,
            priority=request.priority,
            concurrency_key=request.concurrency_key,
        )
    except StaleWrite:
        record = _matching_run(ctx, run_id, agent_file, text)
        fresh = record.status == RunStatus.QUEUED and record.last_seq == 1
        return Started(run_id, False, fresh)
    return Started(run_id, True, True)


def _matching_run(ctx: Context, run_id: str, agent_file: str | Path, text: str) -> RunRecord:
    record = ctx.runs.get(run_id)
    first = ctx.runs.events(run_id, after_seq=0, limit=1)
    if record is None or not first:
        raise StartConflict(run_id, "history (it is being purged)")
    data = first[0].data
    if data.get("agent_file") != str(Path(agent_file).resolve()):
        raise StartConflict(run_id, f"agent file ({data.get('agent_file')})")
    if data.get("input") != text:
        raise StartConflict(run_id, "input")
    return record


@ratchet_task(name="ratchet.start", bind=True)
def start_run(self: Any, request: Start) -> str:
    """Create the run (unless its key's run exists) and take its first turn. Idempotent.

    With neither ``run_id`` nor ``idempotency_key`` the message's task id is the key,
    so a redelivery finds the run its first delivery created.
    """
    ctx = get_context()
    if request.run_id is None and request.idempotency_key is None:
        key = f"celery-task:{self.request.id}"
        request = request.model_copy(update={"idempotency_key": key})
    try:
        run_id = start(ctx, request).run_id
    except StartConflict as exc:
        log.warning("ratchet.start refused: %s", exc)
        return "conflict"
    done = advance(ctx, run_id, expected_seq=1)
    if done.outcome == "next":
        enqueue_next(ctx, run_id, done)
    return done.outcome.value
