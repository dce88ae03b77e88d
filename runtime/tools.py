"""Tools: plain Python functions the model may call.

A tool is named ``module:function``. Its JSON schema comes from its type
hints; pydantic validates the model's arguments, and arguments that do not
validate go back to the model as an error result rather than crashing the run.
A tool that raises does the same. ``@tool(idempotent=True)`` marks a tool safe
to run again when a crash leaves its outcome unknown; the default is not
idempotent, and such a call is parked for an operator instead of repeated.

Four control tools are built in, ``request_user_input`` and ``blocked`` (the
run waits for a person's answer), ``wait`` (for a time, runtime/timers.py) and
``run_child`` (for a child run, runtime/children.py): the runtime never
executes them, it suspends the run.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import to_jsonable_python

from runtime.children import RUN_CHILD, ChildArguments
from runtime.errors import ToolError
from runtime.timers import WAIT, WaitArguments

INVALID_ARGUMENTS_KEY = "__invalid_json__"
"""Mirrors runtime.providers.INVALID_ARGUMENTS_KEY (tools must not import providers)."""

F = TypeVar("F", bound=Callable[..., Any])

REQUEST_USER_INPUT = "request_user_input"
BLOCKED = "blocked"


@overload
def tool(fn: F, /) -> F: ...
@overload
def tool(*, idempotent: bool = False, name: str | None = None) -> Callable[[F], F]: ...
def tool(
    fn: F | None = None, /, *, idempotent: bool = False, name: str | None = None
) -> F | Callable[[F], F]:
    """Mark a function as a tool; ``idempotent=True`` means re-running it after a crash is safe."""

    def mark(func: F) -> F:
        func.__ratchet_tool__ = {"idempotent": idempotent, "name": name}  # type: ignore[attr-defined]
        return func

    return mark(fn) if fn is not None else mark


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the runtime knows it: declaration, argument model and callable."""

    name: str
    reference: str
    description: str
    parameters: dict[str, Any]
    idempotent: bool
    control: bool
    arguments_model: type[BaseModel]
    fn: Callable[..., Any] | None

    def declaration(self) -> dict[str, Any]:
        """What the model is told about the tool; part of the run's binding."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "idempotent": self.idempotent,
        }


@dataclass(frozen=True)
class ToolOutcome:
    ok: bool
    result: Any
    """JSON-compatible result on success; an error message (str) otherwise."""


def _arguments_model(name: str, fn: Callable[..., Any]) -> type[BaseModel]:
    signature = inspect.signature(fn)
    hints = inspect.get_annotations(fn, eval_str=True)
    fields: dict[str, Any] = {}
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolError(name, f"parameter `{param.name}`: *args and **kwargs are not allowed")
        annotation = hints.get(param.name)
        if annotation is None:
            raise ToolError(name, f"parameter `{param.name}` needs a type hint")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, default)
    config = ConfigDict(extra="forbid")
    model: type[BaseModel] = create_model(f"{name}_arguments", __config__=config, **fields)
    return model


def spec_from_function(fn: Callable[..., Any], reference: str) -> ToolSpec:
    marks = getattr(fn, "__ratchet_tool__", {})
    name = marks.get("name") or fn.__name__
    model = _arguments_model(reference, fn)
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return ToolSpec(
        name=name,
        reference=reference,
        description=inspect.cleandoc(fn.__doc__ or "").strip(),
        parameters=schema,
        idempotent=bool(marks.get("idempotent", False)),
        control=False,
        arguments_model=model,
        fn=fn,
    )


class _PromptArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str


class _ReasonArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str


def _control(name: str, description: str, model: type[BaseModel]) -> ToolSpec:
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return ToolSpec(
        name=name,
        reference=name,
        description=description,
        parameters=schema,
        idempotent=True,
        control=True,
        arguments_model=model,
        fn=None,
    )


CONTROL_TOOLS: dict[str, ToolSpec] = {
    REQUEST_USER_INPUT: _control(
        REQUEST_USER_INPUT,
        "Ask the user a question and wait for the answer before going on.",
        _PromptArguments,
    ),
    BLOCKED: _control(
        BLOCKED,
        "Say the task cannot go on without outside help, and wait until it is given.",
        _ReasonArguments,
    ),
    RUN_CHILD: _control(
        RUN_CHILD,
        "Start one of this agent's child agents with an input, and wait until it ends; "
        "its output (or its failure) is the result.",
        ChildArguments,
    ),
    WAIT: _control(
        WAIT,
        "Wait for a while (seconds) or until a time, then go on. Nothing runs meanwhile.",
        WaitArguments,
    ),
}


def load_tool(reference: str) -> ToolSpec:
    """Resolve ``module:function`` (or a control tool's name) to a :class:`ToolSpec`."""
    if reference in CONTROL_TOOLS:
        return CONTROL_TOOLS[reference]
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ToolError(
            reference,
            "expected `module:function` (or a built-in control tool: "
            + ", ".join(sorted(CONTROL_TOOLS))
            + ")",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolError(reference, f"module `{module_name}` cannot be imported: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ToolError(reference, f"module `{module_name}` has no function `{attr}`")
    return spec_from_function(fn, reference)


def invoke(spec: ToolSpec, arguments: dict[str, Any]) -> ToolOutcome:
    """Run a tool; never raises for the tool's own failures (they become error results)."""
    if spec.fn is None:
        raise ToolError(spec.name, "control tools suspend the run; they are never invoked")
    if INVALID_ARGUMENTS_KEY in arguments:
        raw = str(arguments[INVALID_ARGUMENTS_KEY])[:200]
        return ToolOutcome(False, f"arguments for `{spec.name}` were not valid JSON: {raw}")
    try:
        parsed = spec.arguments_model.model_validate(arguments)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(arguments)'}: {err['msg']}"
            for err in exc.errors()
        )
        return ToolOutcome(False, f"invalid arguments for `{spec.name}`: {problems}")
    try:
        value = spec.fn(**{k: getattr(parsed, k) for k in type(parsed).model_fields})
    except Exception as exc:  # a tool's failure is the model's to handle, not the run's
        return ToolOutcome(False, f"`{spec.name}` raised {type(exc).__name__}: {exc}")
    try:
        return ToolOutcome(True, to_jsonable_python(value))
    except Exception as exc:
        return ToolOutcome(False, f"`{spec.name}` returned a value that is not JSON: {exc}")
