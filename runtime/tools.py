"""Tools as the core knows them: what a tool declares, and what its result may be.

A tool is a plain Python function (loaded by runtime_io/tools.py, which also calls it).
Its JSON schema comes from its type hints (:func:`spec_from_function`); the model's
arguments are validated against it, and arguments that do not validate go back to the
model as an error result rather than crashing the run. ``@tool(idempotent=True)`` marks
a tool safe to run again when a crash leaves its outcome unknown; the default is not
idempotent, and such a call is parked for an operator instead of repeated — unless the
tool declares a probe, ``@tool(probe=fn)``, that can say whether it ran
(runtime/probes.py). A tool (and its probe) that declares a parameter of type
:class:`~runtime.probes.ToolContext` receives the call's stable idempotency key in it;
that parameter is not part of the JSON schema. What a tool returns is checked
(:func:`result_outcome`) and fitted to the run's snapshot (:func:`fitted`) before it
is journaled.

Four control tools are built in, ``request_user_input`` and ``blocked`` (the
run waits for a person's answer), ``wait`` (for a time, runtime/timers.py) and
``run_child`` (for a child run, runtime/children.py): the runtime never
executes them, it suspends the run.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar, overload

from pydantic import BaseModel, ConfigDict, create_model
from pydantic_core import to_jsonable_python

from runtime import json_values
from runtime.children import RUN_CHILD, ChildArguments
from runtime.errors import NotStorable, ToolError
from runtime.json_values import without_surrogates
from runtime.probes import ToolContext
from runtime.timers import WAIT, WaitArguments

F = TypeVar("F", bound=Callable[..., Any])

REQUEST_USER_INPUT = "request_user_input"
BLOCKED = "blocked"

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI-compatible APIs accept as a function name."""


def is_tool_name(name: object) -> bool:
    """Whether ``name`` is a name the model APIs accept for a tool (1-64 of ``[A-Za-z0-9_-]``)."""
    return isinstance(name, str) and _TOOL_NAME.fullmatch(name) is not None


@overload
def tool(fn: F, /) -> F: ...
@overload
def tool(
    *, idempotent: bool = False, name: str | None = None, probe: Callable[..., Any] | None = None
) -> Callable[[F], F]: ...
def tool(
    fn: F | None = None,
    /,
    *,
    idempotent: bool = False,
    name: str | None = None,
    probe: Callable[..., Any] | None = None,
) -> F | Callable[[F], F]:
    """Mark a function as a tool.

    ``idempotent=True``: re-running it after a crash is safe. ``probe``: a function
    that takes the tool's parameters (any of them, and a ``ToolContext`` one) and
    returns ``Ran(result)``, ``NotRun()`` or ``Unknown(why)`` for a call whose
    outcome a crash or a timeout left unknown. It must only ask, never act.
    """

    def mark(func: F) -> F:
        func.__ratchet_tool__ = {"idempotent": idempotent, "name": name, "probe": probe}  # type: ignore[attr-defined]
        return func

    return mark(fn) if fn is not None else mark


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the runtime knows it: declaration, argument model and callable."""

    name: str
    reference: str
    description: str
    idempotent: bool
    control: bool
    parameters: dict[str, Any]
    """The JSON schema of ``arguments_model``, as the model is told it."""
    arguments_model: type[BaseModel]
    fn: Callable[..., Any] | None
    context_parameter: str | None = None
    """The parameter that receives the call's :class:`ToolContext`, if the tool has one."""
    probe: Callable[..., Any] | None = None
    """Asks whether a call whose outcome is unknown ran (runtime/probes.py)."""
    probe_parameters: tuple[str, ...] = ()
    """The tool's parameters the probe takes."""
    probe_context_parameter: str | None = None
    remote: Callable[[dict[str, Any], ToolContext | None], Any] | None = None
    """A tool another process runs (an MCP server's, runtime_io/mcp/): called with the
    model's arguments as they are (the server validates them) and the call's context."""
    mcp: dict[str, Any] | None = None
    """An MCP tool's server, annotations and where its policy came from (in the binding)."""

    def declaration(self) -> dict[str, Any]:
        """What the model is told about the tool; part of the run's binding."""
        declaration: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "idempotent": self.idempotent,
        }
        if self.probe is not None:
            # Only when set: tools without a probe keep the binding their runs started with.
            declaration["probe"] = True
        if self.mcp is not None:
            declaration["mcp"] = self.mcp
        return declaration


@dataclass(frozen=True)
class ToolOutcome:
    ok: bool
    result: Any
    """JSON-compatible result on success; an error message (str) otherwise."""


def _parameters(name: str, fn: Callable[..., Any]) -> tuple[dict[str, Any], str | None]:
    """The function's parameters as pydantic fields, and the one that takes a ToolContext."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ToolError(name, f"its signature cannot be read ({type(exc).__name__})") from exc
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception as exc:  # evaluating a string hint runs arbitrary expressions
        raise ToolError(
            name, f"its type hints cannot be evaluated ({short_error(exc)}); import what they name"
        ) from exc
    fields: dict[str, Any] = {}
    context: str | None = None
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolError(name, f"parameter `{param.name}`: *args and **kwargs are not allowed")
        annotation = hints.get(param.name)
        if annotation is None:
            raise ToolError(name, f"parameter `{param.name}` needs a type hint")
        if annotation is ToolContext:
            if context is not None:
                raise ToolError(name, "only one parameter may take the ToolContext")
            context = param.name
            continue
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, default)
    return fields, context


def _arguments_model(name: str, fields: dict[str, Any]) -> type[BaseModel]:
    config = ConfigDict(extra="forbid")
    try:
        model: type[BaseModel] = create_model(f"{name}_arguments", __config__=config, **fields)
    except Exception as exc:  # pydantic refuses a type it cannot validate
        raise ToolError(
            name, f"its parameter types cannot be validated ({short_error(exc)})"
        ) from exc
    return model


def _probe(
    reference: str, probe: object, tool_fields: dict[str, Any]
) -> tuple[Callable[..., Any] | None, tuple[str, ...], str | None]:
    """The probe, the tool parameters it takes and its ToolContext parameter; ToolError if unfit."""
    if probe is None:
        return None, (), None
    if not inspect.isfunction(probe):
        raise ToolError(reference, f"its probe is {callable_kind(probe)}, not a plain function")
    fields, context = _parameters(f"{reference} (probe)", probe)
    foreign = sorted(set(fields) - set(tool_fields))
    if foreign:
        raise ToolError(
            reference,
            f"its probe takes `{foreign[0]}`, which is not a parameter of the tool; a probe "
            "takes the tool's parameters (any of them) and a ToolContext",
        )
    return probe, tuple(fields), context


def short_error(exc: BaseException) -> str:
    """The exception's type and first line, cut short: enough to fix, never a page."""
    lines = str(exc).strip().splitlines()
    first = lines[0][:160] if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def spec_from_function(fn: Callable[..., Any], reference: str) -> ToolSpec:
    """The :class:`ToolSpec` of a plain function; ToolError if it cannot be a tool."""
    marks = getattr(fn, "__ratchet_tool__", None)
    if not isinstance(marks, dict):
        marks = {}
    name = marks.get("name") or fn.__name__
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ToolError(reference, "its name must be 1-64 letters, digits, `_` or `-`")
    fields, context = _parameters(reference, fn)
    model = _arguments_model(reference, fields)
    probe, probe_parameters, probe_context = _probe(reference, marks.get("probe"), fields)
    spec = _spec(
        reference,
        name,
        inspect.cleandoc(fn.__doc__ if isinstance(fn.__doc__, str) else "").strip(),
        model,
        idempotent=bool(marks.get("idempotent", False)),
        fn=fn,
    )
    return replace(
        spec,
        context_parameter=context,
        probe=probe,
        probe_parameters=probe_parameters,
        probe_context_parameter=probe_context,
    )


def _spec(
    reference: str,
    name: str,
    description: str,
    model: type[BaseModel],
    *,
    idempotent: bool,
    fn: Callable[..., Any] | None,
) -> ToolSpec:
    """The tool declaring ``model``'s JSON schema as its parameters; without ``fn``, a
    control tool (the worker carries it out). ToolError if there is no such schema."""
    try:
        schema = model.model_json_schema()
    except Exception as exc:  # e.g. PydanticInvalidForJsonSchema for a TypeVar or a callable
        raise ToolError(
            reference,
            f"its parameters cannot be described as JSON schema ({short_error(exc)}); "
            "use str, int, float, bool, lists, dicts or pydantic models",
        ) from exc
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return ToolSpec(
        name=name,
        reference=reference,
        description=description,
        parameters=schema,
        idempotent=idempotent,
        control=fn is None,
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
    return _spec(name, name, description, model, idempotent=True, fn=None)


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


def callable_kind(value: object) -> str:
    """What ``value`` is, for a message saying why it cannot be a tool (or a probe)."""
    if inspect.isclass(value):
        return "a class"
    if inspect.isbuiltin(value) or type(value).__name__ in {"method-wrapper", "wrapper_descriptor"}:
        return "a builtin or C function"
    if inspect.ismethod(value):
        return "a bound method"
    if inspect.ismodule(value):
        return "a module"
    return "a callable object" if callable(value) else "not callable"


MAX_ERROR_CHARS = 4000
"""The longest error message a tool result holds (a tool's exception can be any size)."""


def error_text(text: str) -> str:
    """An error result as it is journaled: no lone surrogate, at most MAX_ERROR_CHARS."""
    text = without_surrogates(text)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def result_outcome(name: str, value: Any) -> ToolOutcome:
    """What tool ``name`` returned, checked where it crosses into ratchet (runtime/json_values.py):
    a value that cannot be stored and folded becomes an error result the model reads, so the
    call is journaled once and never run again for it. A lone surrogate is replaced by U+FFFD."""
    try:
        # Surrogates first: to_jsonable_python refuses them in an object's keys.
        checked, _ = json_values.checked(to_jsonable_python(json_values.replaced(value)))
    except NotStorable as exc:
        return ToolOutcome(False, error_text(f"`{name}` ran, but its result {exc.problem}"))
    except Exception as exc:  # to_jsonable_python refuses types it does not know
        return ToolOutcome(
            False,
            error_text(f"`{name}` ran, but returned a value that is not JSON: {short_error(exc)}"),
        )
    return ToolOutcome(True, checked)


SNAPSHOT_RESERVE_BYTES = 64 * 1024
"""What a run's snapshot keeps free for error results: a result or a model's answer that
would take the snapshot into it is refused; the error result that says so is not."""
MESSAGE_BYTES = 512
"""What a tool message takes in a snapshot besides its content, at most."""


def overflow(what: str, size: int, room_bytes: int) -> str | None:
    """Why ``what`` of ``size`` bytes cannot join the run's transcript, whose snapshot has
    ``room_bytes`` left before its reserve; None if it fits."""
    if size <= room_bytes:
        return None
    return (
        f"{what} ({size} bytes in the run's snapshot) does not fit: the snapshot has "
        f"{max(room_bytes, 0)} bytes left of what it may hold; the run's transcript is full — "
        "start a new run"
    )


def fitted(outcome: ToolOutcome, name: str, room: Callable[[int], int]) -> ToolOutcome:
    """``outcome``, or an error result if its result does not fit in the run's snapshot
    (:func:`overflow`): saved, the next checkpoint would fail, and the call run again.
    ``room(size)``: the bytes the snapshot has left, told exactly when ``size`` is near it."""
    if not outcome.ok:
        return outcome
    result = outcome.result
    content = result if isinstance(result, str) else json.dumps(result, sort_keys=True)
    size = len(json.dumps(content, ensure_ascii=False).encode()) + MESSAGE_BYTES
    why = overflow(f"`{name}` ran, but its result", size, room(size))
    return outcome if why is None else ToolOutcome(False, why)
