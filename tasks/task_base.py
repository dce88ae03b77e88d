"""The base class of every ratchet task: its arguments are checked before it runs.

A Celery message names a task and carries its arguments as JSON; a client that
gets them wrong (a missing argument, an extra keyword, a string where the seq
goes) used to meet a ``TypeError`` deep in the task and a nine-line
traceback in the worker log. :class:`RatchetTask` checks the arguments first,
against a strict pydantic model built from the task function's signature and
type hints: no coercion (``"5"`` is not an int, ``true`` is not an int), no
unknown keyword. A message that fails is set aside in the dead-letter store
(:mod:`tasks.rejected`) with one WARNING line naming the task, the argument
and the signature to send, and Celery records the task as ignored (the
message is acknowledged: sending it again would fail the same way).

A run id that is not a valid id (:class:`runtime.errors.InvalidRunId`) is
refused the same way.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from functools import cached_property
from typing import Any

from celery import Task, current_app, shared_task
from celery._state import get_current_task
from celery.exceptions import Ignore
from celery.local import Proxy
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from runtime.errors import InvalidRunId
from tasks.rejected import set_aside, store_for_app


class RatchetTask(Task):  # type: ignore[misc]
    """A Celery task whose arguments are validated at the edge (see the module docstring)."""

    @cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self.run)

    @cached_property
    def _arguments_model(self) -> type[BaseModel]:
        hints = typing.get_type_hints(self.run)
        fields: dict[str, Any] = {}
        for name, parameter in self._signature.parameters.items():
            default = ... if parameter.default is inspect.Parameter.empty else parameter.default
            fields[name] = (hints.get(name, Any), default)
        model: type[BaseModel] = create_model(
            f"{self.name}.arguments",
            __config__=ConfigDict(strict=True, extra="forbid"),
            **fields,
        )
        return model

    @cached_property
    def _hints(self) -> dict[str, Any]:
        return typing.get_type_hints(self.run)

    def _type_text(self, name: str) -> str:
        hint = self._hints.get(name, Any)
        text = getattr(hint, "__name__", None) if not typing.get_args(hint) else None
        return text or str(hint).replace("typing.", "")

    def call_form(self) -> str:
        """``ratchet.turn(run_id: str, expected_seq: int | None)``: what a message must carry."""
        parts = []
        for name, parameter in self._signature.parameters.items():
            part = f"{name}: {self._type_text(name)}"
            if parameter.default is not inspect.Parameter.empty:
                part += f" = {parameter.default!r}"
            parts.append(part)
        return f"{self.name}({', '.join(parts)})"

    def arguments_problem(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why these arguments cannot be this task's, naming the argument; None if they can."""
        names = list(self._signature.parameters)
        if len(args) > len(names):
            plural = "s" if len(args) != 1 else ""
            return f"{len(args)} positional argument{plural}, but it takes at most {len(names)}"
        given = dict(zip(names, args, strict=False))
        for name in kwargs:
            if name not in self._signature.parameters:
                return f"unexpected argument `{name}`"
            if name in given:
                return f"argument `{name}` given twice (by position and by name)"
        given.update(kwargs)
        for name, parameter in self._signature.parameters.items():
            if name not in given and parameter.default is inspect.Parameter.empty:
                return f"argument `{name}` is missing"
        try:
            self._arguments_model.model_validate(given)
        except ValidationError as exc:
            error = exc.errors()[0]
            name = str(error["loc"][0]) if error["loc"] else "?"
            got = type(error.get("input")).__name__
            if len(error["loc"]) > 1:
                where = ".".join(str(part) for part in error["loc"])
                return f"argument `{where}`: {error['msg'].lower()} (got {got})"
            return f"argument `{name}` must be {self._type_text(name)}, not {got}"
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        problem = self.arguments_problem(args, kwargs)
        if problem is None:
            try:
                return super().__call__(*args, **kwargs)
            except InvalidRunId as exc:
                problem = str(exc)
        self._refuse(problem, args, kwargs)
        raise Ignore()

    def _refuse(self, problem: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = self.request
        delivery = request.delivery_info or {}
        queue = str(delivery.get("routing_key") or "")
        # The pool process never sees the broker's bytes: keep what the message said.
        raw = json.dumps(
            {"task": self.name, "id": request.id, "args": list(args), "kwargs": kwargs},
            sort_keys=True,
            default=repr,
        ).encode()
        set_aside(
            raw,
            f"task {self.name}[{request.id}]: {problem}; send {self.call_form()}",
            queue or self.name,
            lambda: store_for_app(self.app),
        )


_sending_app: Any = None
"""The app ratchet's tasks are sent through outside a running task (:func:`send_through`)."""


def send_through(app: Any, *, unless_set: bool = False) -> None:
    """Send ratchet's tasks through ``app`` when no ratchet task is running in the thread.

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
    task = get_current_task()
    if task is not None:
        return task.app
    return _sending_app if _sending_app is not None else current_app._get_current_object()


def ratchet_task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Declare a ratchet task: ``@ratchet_task(name="ratchet.turn", ...)``.

    The task is a Celery shared task: it is registered on every Celery app that is
    finalised in the process, ratchet's own (``celery -A worker``) or an application's
    (``tasks.install(app)``), and always with :class:`RatchetTask` as its base, whatever
    the app's own task class. What the decorator returns stands for the task of
    :func:`sending_app`: calling or sending it goes through that app.
    """
    name = options["name"]

    def declare(fun: Callable[..., Any]) -> Any:
        shared_task(base=RatchetTask, **options)(fun)
        return Proxy(lambda: sending_app().tasks[name])

    return declare
