"""The base class of every ratchet task: its message is checked before it runs.

A Celery message names a task and carries its arguments as JSON; a client that
gets them wrong (a missing argument, an extra keyword, a string where the seq
goes) used to meet a ``TypeError`` deep in the task and a nine-line
traceback in the worker log. :class:`RatchetTask` reads the message first, as
its task's model in :mod:`tasks.messages` (strict: no coercion, ``"5"`` is not
an int, ``true`` is not an int; no unknown keyword; a run id that is an id; a
version this worker knows). A message that fails is set aside in the
rejected-message store (:mod:`store.rejected`) with one WARNING line naming the
task, the argument and the signature to send, and Celery records the task as
ignored (the message is acknowledged: sending it again would fail the same way).
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

from celery import Task, shared_task
from celery.exceptions import Ignore
from celery.local import Proxy

from runtime.errors import InvalidRunId, MessageRefused
from tasks.messages import MESSAGES, VERSION_HEADER, call_form, decode, sending_app
from tasks.queues import CONTROL_QUEUE, ROUTES
from tasks.refusals import set_aside, store_for_app
from tasks.task_options import TABLE_OPTIONS, declared


class RatchetTask(Task):  # type: ignore[misc]
    """A Celery task whose arguments are validated at the edge (see the module docstring)."""

    takes_message = False
    """The task function takes the validated message itself, not its fields by keyword."""

    def message_version(self) -> object:
        """The version the message in progress says it is (None: the previous release's)."""
        headers = self.request.headers or {}
        return headers.get(VERSION_HEADER, getattr(self.request, VERSION_HEADER, None))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.name not in MESSAGES:
            # A task of the app's own that is not ratchet's (Celery's built-in
            # `celery.*` tasks take RatchetTask as base on ratchet's app): no contract.
            return super().__call__(*args, **kwargs)
        version = self.message_version()
        try:
            message = decode(self.name, args, kwargs, version)
        except MessageRefused as exc:
            problem = exc.problem
        else:
            try:
                if self.takes_message:
                    return super().__call__(message)
                return super().__call__(**dict(message))
            except InvalidRunId as exc:
                problem = str(exc)
        self._refuse(problem, args, kwargs, version)
        raise Ignore()

    def _refuse(
        self, problem: str, args: tuple[Any, ...], kwargs: dict[str, Any], version: object
    ) -> None:
        request = self.request
        delivery = request.delivery_info or {}
        queue = str(delivery.get("routing_key") or "")
        # The pool process never sees the broker's bytes: keep what the message said.
        raw = json.dumps(
            {
                "task": self.name,
                "id": request.id,
                VERSION_HEADER: version,
                "args": list(args),
                "kwargs": kwargs,
            },
            sort_keys=True,
            default=repr,
        ).encode()
        set_aside(
            raw,
            f"task {self.name}[{request.id}]: {problem}; send {call_form(self.name)} by keyword",
            queue or self.name,
            lambda: store_for_app(self.app),
        )


def ratchet_task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Declare a ratchet task: ``@ratchet_task(name="ratchet.turn", ...)``.

    It takes its message (:data:`tasks.messages.MESSAGES`), validated: either as one
    parameter annotated with the message's model (``def start_run(self, message:
    Start)``), or as keyword-only parameters that are the model's fields, with the same
    types and defaults. Checked here, so the two cannot drift.
    The task is a Celery shared task: it is registered on every Celery app that is
    finalised in the process, ratchet's own (``celery -A worker``) or an application's
    (``tasks.install(app)``), and always with :class:`RatchetTask` as its base, whatever
    the app's own task class. What the decorator returns stands for the task of
    :func:`sending_app`: calling or sending it goes through that app.
    Its acknowledgement, result and retry options are the table's
    (:func:`tasks.task_options.declared`), never the declaration's: one spelled here
    is a TypeError.
    """
    name = options["name"]
    spelled = sorted(TABLE_OPTIONS.intersection(options))
    if spelled:
        raise TypeError(f"{name}: {', '.join(spelled)} are tasks.task_options' to set, not its own")

    def declare(fun: Callable[..., Any]) -> Any:
        takes_message = _check_parameters(name, fun, bound=bool(options.get("bind")))
        shared_task(base=RatchetTask, takes_message=takes_message, **declared(name), **options)(fun)
        return Proxy(lambda: sending_app().tasks[name])

    return declare


def _check_parameters(name: str, fun: Callable[..., Any], *, bound: bool) -> bool:
    """Whether ``fun`` takes ``name``'s message itself (else: its fields, by keyword).

    Raises TypeError unless it takes exactly that message, one way or the other.
    """
    message = MESSAGES[name]
    types = typing.get_type_hints(message)
    parameters = list(inspect.signature(fun).parameters.values())[1 if bound else 0 :]
    hints = typing.get_type_hints(fun)
    found = {p.name: (p.kind, hints.get(p.name), p.default) for p in parameters}
    whole = (inspect.Parameter.POSITIONAL_OR_KEYWORD, message, inspect.Parameter.empty)
    if list(found.values()) == [whole]:
        return True
    wanted = {
        field_name: (
            inspect.Parameter.KEYWORD_ONLY,
            types[field_name],
            inspect.Parameter.empty if field.is_required() else field.default,
        )
        for field_name, field in message.model_fields.items()
    }
    if found != wanted:
        raise TypeError(f"{name}: the task's parameters {found} are not its message's {wanted}")
    return False


def control_task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Declare a task of the control queue: :func:`ratchet_task` (with the table's
    :data:`~tasks.task_options.CONTROL_RETRIES`), for a name :data:`ROUTES` sends to
    ``ratchet.control``."""
    name = options["name"]
    if ROUTES.get(name) != CONTROL_QUEUE:
        raise ValueError(f"{name} is not routed to {CONTROL_QUEUE}: add it to ROUTES first")
    return ratchet_task(**options)
