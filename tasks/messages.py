"""Every message a ratchet task takes: one model each, and one function that sends it.

A message is a Celery task message whose keyword arguments are the fields of its
model here (:class:`Turn` for ``ratchet.turn``, …), checked strictly on both
sides: by the ``enqueue_*`` function that sends it, and by the worker
(:class:`tasks.task_base.RatchetTask`) before the task runs. The task function
takes the validated message (or, for a few short ones, the model's fields by
keyword, checked when the task is declared), and each ``enqueue_*`` function is
made from the model (:func:`enqueuer`): the model is the one definition of what a
task takes.

**Versions.** What this release sends carries the header ``ratchet_v: 1`` and
its arguments by keyword only. A message without the header is the previous
release's (``v0``): its arguments by position (in :attr:`Message.v0_order`) or by
keyword, with the same names; a worker still takes it, since messages outlive
the release that sent them on a queue. A message of a version this worker does
not know (a newer release's) is set aside unread, with a reason that names the
version, rather than guessed at. The version is a header, not an argument, so
that the previous release's workers, which ignore headers they do not know,
still run what this release sends during a rolling upgrade. A change to a
message's fields is a new version: :data:`VERSION` goes up, and :func:`decode`
keeps reading the old shapes (into the new model) for as long as they may be queued.

A message that is not a valid message of its task (an argument missing,
unknown, of the wrong type, a run id that is not an id) is refused with a
reason naming the argument and what to send (:func:`decode`).
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, ClassVar, Protocol, TypeVar

from celery import current_app
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from runtime.errors import InvalidRunId, MessageRefused
from runtime.models import validate_run_id
from runtime.recovery import OPERATOR, SWEEPER
from tasks.broker import next_turn as lean
from tasks.broker.next_turn import running_task
from tasks.broker.pools import pools_made
from tasks.queues import CONTROL_QUEUE, ROUTES, whole_seconds_on_quorum

VERSION = 1
"""The message format version this release sends and reads (besides v0)."""
VERSION_HEADER = "ratchet_v"
"""The Celery message header carrying the version; absent on the previous release's."""


def _run_id(value: str) -> str:
    try:
        return validate_run_id(value)
    except InvalidRunId as exc:
        raise ValueError(str(exc)) from None


RunId = Annotated[str, AfterValidator(_run_id)]
"""A run id from outside: letters, digits, ``-`` and ``_`` (see :func:`validate_run_id`)."""


class Message(BaseModel):
    """A task's arguments, strictly: no coercion (``"5"`` is not an int), no unknown field."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    task: ClassVar[str]
    """The task's stable name (``ratchet.turn``)."""
    v0_order: ClassVar[tuple[str, ...]]
    """The previous release's positional order of the arguments: fixed forever."""

    @classmethod
    def queue(cls) -> str:
        """The queue the task is routed to (:data:`tasks.queues.ROUTES`)."""
        return ROUTES[cls.task]


class RunMessage(Message):
    """A message about one run, named first."""

    run_id: RunId
    """The run."""


class Turn(RunMessage):
    """Take the run's next turn, if it is still where the sender saw it."""

    task = "ratchet.turn"
    v0_order = ("run_id", "expected_seq")
    expected_seq: int | None
    """The seq the run must be at; at another, the message is late or a duplicate (None: any)."""


class Resume(RunMessage):
    """Resume a stopped run from its checkpoint, if it is resume-eligible."""

    task = "ratchet.resume"
    v0_order = ("run_id", "by", "seen_seq")
    by: str = OPERATOR
    """Who resumes it: ``operator`` or ``sweeper`` (whose resumes count towards dead-lettering)."""
    seen_seq: int | None = None
    """The seq the sweeper saw; a run that moved since was not orphaned after all."""


class Continue(RunMessage):
    """One answer to a suspended run."""

    task = "ratchet.continue"
    v0_order = ("run_id", "input", "approve", "deny", "continuation_id", "suspension_seq")
    input: str | None = None
    """The answer to a question or a blocker."""
    approve: bool | None = None
    """Approve the tool call the run waits on."""
    deny: str | None = None
    """Deny it, with this reason."""
    continuation_id: str | None = None
    """The answer's id: the same id twice is applied once."""
    suspension_seq: int | None = None
    """The seq of the suspension it answers (``ratchet runs show``)."""


class Cancel(RunMessage):
    """Stop the run at its next boundary, for good."""

    task = "ratchet.cancel"
    v0_order = ("run_id", "reason")
    reason: str | None = None
    """Why, recorded with the cancellation."""


class Reconcile(RunMessage):
    """An operator's outcome for the open call of a run parked as needs_reconciliation."""

    task = "ratchet.reconcile"
    v0_order = ("run_id", "call_id", "decision", "result", "reason")
    call_id: str
    """The parked run's open call."""
    decision: str
    """``result`` (it ran: here is its result), ``retry`` or ``fail``."""
    result: Any = None
    """With ``result``: the call's result (JSON), as if the tool had returned it."""
    reason: str | None = None
    """With ``fail``: why, which the model reads as the call's error."""


class Sweep(Message):
    """One crash sweep, then retention."""

    task = "ratchet.sweep"
    v0_order = ()


class Wake(RunMessage):
    """End a run's ``wait``, once its time has come."""

    task = "ratchet.wake"
    v0_order = ("run_id", "seq")
    seq: int
    """The seq the run waits at; another means it has moved on."""


class Deliver(Message):
    """Tell an ended child run's parent how it ended."""

    task = "ratchet.deliver"
    v0_order = ("child_id",)
    child_id: RunId
    """The child run that ended; its parent is told."""


MessageT = TypeVar("MessageT", bound=Message)


class Start(Message):
    """Create a run (once per key) and take its first turn: the one message whose run may
    not have an id yet (it may be derived from the idempotency key)."""

    task = "ratchet.start"
    v0_order = ("agent_file", "text", "run_id", "idempotency_key", "priority", "concurrency_key")
    agent_file: str
    """The agent file, a path the workers can read."""
    text: str
    """The run's input."""
    run_id: RunId | None = None
    """The run's id, and its start's idempotency key; default: derived from the key."""
    idempotency_key: str | None = None
    """Starts the run once however often it is sent; default: the Celery task id."""
    priority: int | None = None
    """The run's priority (0-4, higher first); default: the agent's ``[limits] priority``."""
    concurrency_key: str | None = None
    """Puts the run under the agent's ``max_runs_per_key`` (a tenant, a user)."""


MESSAGES: dict[str, type[Message]] = {
    cls.task: cls
    for cls in (Start, Turn, Resume, Continue, Cancel, Reconcile, Sweep, Wake, Deliver)
}
"""Each ratchet task's message, by task name."""


# --- the worker's side: what a message says, or why it cannot be read --------------


def _type_text(annotation: Any) -> str:
    """``int | None``, ``str``, ``Any``: a field's type as a sender would write it."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(arg) for arg in typing.get_args(annotation))
    name = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return (name or str(annotation)).replace("typing.", "").replace("NoneType", "None")


def call_form(task: str) -> str:
    """``ratchet.turn(run_id: str, expected_seq: int | None)``: what a message must carry."""
    cls = MESSAGES[task]
    hints = typing.get_type_hints(cls)
    parts = []
    for name, field in cls.model_fields.items():
        part = f"{name}: {_type_text(hints[name])}"
        if not field.is_required():
            part += f" = {field.default!r}"
        parts.append(part)
    return f"{task}({', '.join(parts)})"


def decode(task: str, args: Any, kwargs: Any, version: object = None) -> Message:
    """The message ``args``/``kwargs`` make for ``task`` at ``version`` (None: v0).

    Raises MessageRefused naming the argument at fault, or the version.
    """
    problem = _version_problem(version, args)
    if problem is not None:
        raise MessageRefused(task, problem)
    cls = MESSAGES[task]
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    names = cls.v0_order
    if len(args) > len(names):
        plural = "s" if len(args) != 1 else ""
        raise MessageRefused(
            task, f"{len(args)} positional argument{plural}, but it takes at most {len(names)}"
        )
    given = dict(zip(names, args, strict=False))
    for name in kwargs:
        if name not in cls.model_fields:
            raise MessageRefused(task, f"unexpected argument `{name}`")
        if name in given:
            raise MessageRefused(task, f"argument `{name}` given twice (by position and by name)")
    return build(cls, **given, **kwargs)


def _version_problem(version: object, args: Any) -> str | None:
    if version is None:
        return None  # the previous release's: by position or by keyword
    if type(version) is not int or version < 1:
        return f"header `{VERSION_HEADER}` must be a positive int, not {version!r}"
    if version > VERSION:
        return (
            f"message format version {version} is newer than this worker reads "
            f"(0 to {VERSION}): a newer ratchet sent it; upgrade this worker"
        )
    if args:
        return f"a version-{version} message carries its arguments by keyword, not by position"
    return None


def build(cls: type[MessageT], **fields: Any) -> MessageT:
    """``cls(**fields)``; MessageRefused naming the field at fault if they are not its."""
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise MessageRefused(cls.task, _problem(cls, exc)) from None


def _problem(cls: type[Message], exc: ValidationError) -> str:
    error = exc.errors()[0]
    loc = error["loc"]
    name = str(loc[0]) if loc else "?"
    if error["type"] == "missing":
        return f"argument `{name}` is missing"
    if error["type"] == "value_error":
        return f"argument `{name}`: {error['ctx']['error']}"
    got = type(error.get("input")).__name__
    if len(loc) > 1:
        where = ".".join(str(part) for part in loc)
        return f"argument `{where}`: {error['msg'].lower()} (got {got})"
    wanted = _type_text(typing.get_type_hints(cls)[name])
    return f"argument `{name}` must be {wanted}, not {got}"


def fields_of(task: str, args: Any, kwargs: Any) -> dict[str, Any]:
    """A message's arguments by name, as far as they can be told, unchecked (for labels)."""
    cls = MESSAGES.get(task)
    if cls is None:
        return {}
    found = dict(kwargs) if isinstance(kwargs, dict) else {}
    if isinstance(args, list | tuple):
        found.update(zip(cls.v0_order, args, strict=False))
    return found


# --- the sender's side --------------------------------------------------------------
#
# Each enqueue_* function takes its message's fields by keyword, ``app`` (default:
# sending_app()) and send()'s options (``countdown_s=``, Celery's ``connection=``, …),
# and returns the Celery task id. MessageRefused before anything is sent if the fields
# are not the message's (a required one missing, one of the wrong type).

_sending_app: Any = None
"""The app ratchet's messages are sent through outside a running task (:func:`send_through`)."""


def send_through(app: Any, *, unless_set: bool = False) -> None:
    """Send ratchet's messages through ``app`` when no ratchet task is running in the thread.

    ``tasks.install(app)`` sets it; ratchet's own app (``worker.app``) sets it only
    ``unless_set``, so importing ratchet's worker package into an application that
    installed ratchet on its own app does not take the sends over. Without it, the
    sends would follow Celery's current app, which is whichever app was built last
    in the thread (a client's, a test's).
    """
    global _sending_app
    if not unless_set or _sending_app is None:
        _sending_app = app


def sending_app() -> Any:
    """The app a send goes through: the running task's, else :func:`send_through`'s."""
    task = running_task()
    if task is not None:
        return task.app
    return _sending_app if _sending_app is not None else current_app._get_current_object()


def send(
    message: Message,
    *,
    app: Any = None,
    queue: str | None = None,
    priority: int | None = None,
    countdown_s: float = 0.0,
    **options: Any,
) -> str:
    """Put ``message`` on its queue (or ``queue``) through ``app``; the Celery task id.

    The one place a ratchet message is published. ``app``: default
    :func:`sending_app`. ``priority``: the broker priority (default: the app's
    route for the task). ``countdown_s``: held by the broker until then.
    ``options``: Celery's other ``send_task`` options.
    """
    if priority is not None:
        options["priority"] = priority
    options["queue"] = queue or options.get("queue") or message.queue()
    headers = {**(options.pop("headers", None) or {}), VERSION_HEADER: VERSION}
    app = pools_made(app or sending_app())
    if countdown_s > 0:
        options["countdown"] = whole_seconds_on_quorum(app, options["queue"], countdown_s)
    if app.conf.task_serializer != "json":
        # ratchet's messages are JSON whatever an application's own tasks are sent as.
        options.setdefault("serializer", "json")
    kwargs = message.model_dump()
    if message.task == lean.TASK and set(options) <= {"queue", "priority"}:
        # A turn chained from a running turn: the same message, less of Celery's work.
        sent = lean.lean_turns(app).publish(kwargs, options["queue"], priority, headers)
        if sent is not None:
            return sent
    result = app.send_task(message.task, kwargs=kwargs, headers=headers, **options)
    return str(result.id)


def turn_outbox(runs: Any, run_id: str, seq: int, priority: int | None) -> Any:
    """The next turn of ``run_id`` at ``seq`` as an outbox message for ``runs`` to push with
    the checkpoint that ends this turn (:meth:`tasks.broker.next_turn.LeanTurns.outbox`); None when
    it must be sent as every other message is, after the checkpoint (:func:`send`)."""
    message = build(Turn, run_id=run_id, expected_seq=seq)
    app = sending_app()
    headers = {VERSION_HEADER: VERSION}
    return lean.lean_turns(app).outbox(
        runs, message.model_dump(), message.queue(), priority, headers
    )


class Enqueue(Protocol):
    """An ``enqueue_*`` function: its message's fields and send options, by keyword."""

    def __call__(self, *, app: Any = None, **fields_and_options: Any) -> str: ...


def enqueuer(cls: type[Message], doc: str) -> Enqueue:
    """The ``enqueue_*`` function of ``cls``: the model is the one list of its fields.

    A keyword that is one of the model's fields goes into the message (``priority``
    is the run's for ``ratchet.start``, which has such a field, and the broker's for
    the others); every other keyword is a :func:`send` option.
    """

    def enqueue(*, app: Any = None, **fields_and_options: Any) -> str:
        fields = {
            name: fields_and_options.pop(name)
            for name in list(fields_and_options)
            if name in cls.model_fields
        }
        return send(build(cls, **fields), app=app, **fields_and_options)

    enqueue.__name__ = enqueue.__qualname__ = f"enqueue_{cls.__name__.lower()}"
    enqueue.__doc__ = f"Send ``{cls.task}``: {doc}"
    return enqueue


enqueue_start = enqueuer(Start, "a worker creates the run and takes its first turn.")
enqueue_turn = enqueuer(
    Turn,
    "the run's next turn, which acts only at ``expected_seq``. ``countdown_s``: after "
    "waiting on a limit (a broker-held countdown, no worker slot); ``priority``: the broker "
    "priority (runs under way go before new ones).",
)
_enqueue_resume = enqueuer(Resume, "resume a stopped run from its checkpoint.")
enqueue_continue = enqueuer(Continue, "one answer (input, approve or deny) to a suspended run.")
enqueue_cancel = enqueuer(Cancel, "the run stops at its next boundary, for good.")
enqueue_reconcile = enqueuer(Reconcile, "an operator's outcome for a parked run's open call.")
enqueue_sweep = enqueuer(Sweep, "one crash sweep, then retention.")
enqueue_wake = enqueuer(
    Wake, "end a run's wait, held by the broker ``countdown_s`` (until the wake-up time)."
)
enqueue_deliver = enqueuer(Deliver, "tell an ended child's parent how it ended.")


def enqueue_resume(*, urgent: bool = False, **fields_and_options: Any) -> str:
    """Send ``ratchet.resume``; ``urgent`` puts it on the control queue, ahead of the turns.

    Urgent only for a run whose lease holder's process is dead: certainly stopped, and
    it already waited through the crash. A run merely overdue may be a turn waiting in
    a long queue (every run of a backlog deeper than one lease is), and a resume of each
    on the control queue would bury the sweeps and continuations behind them.
    """
    if urgent:
        fields_and_options["queue"] = CONTROL_QUEUE
    return _enqueue_resume(**fields_and_options)


# The (run_id, seq) and (child_id) forms the injectable ``enqueue=`` / ``tell=`` seams take.


def chain_turn(run_id: str, seq: int) -> None:
    """:func:`enqueue_turn` of ``run_id`` at ``seq``."""
    enqueue_turn(run_id=run_id, expected_seq=seq)


def tell_parent_soon(child_id: str) -> None:
    """:func:`enqueue_deliver` of ``child_id``."""
    enqueue_deliver(child_id=child_id)


def sweeper_resume(run_id: str, seen_seq: int) -> None:
    """:func:`enqueue_resume` by the sweeper of a run it saw at ``seen_seq``."""
    enqueue_resume(run_id=run_id, by=SWEEPER, seen_seq=seen_seq)


def urgent_sweeper_resume(run_id: str, seen_seq: int) -> None:
    """:func:`sweeper_resume` on the control queue: the run's lease holder is dead."""
    enqueue_resume(run_id=run_id, by=SWEEPER, seen_seq=seen_seq, urgent=True)
