"""Tools: plain Python functions the model may call.

A tool is named ``module:function``, and it must be a plain Python function
(``def`` in a module, not a class, a builtin, a C function or another callable).
Functions of the standard library and of ratchet's own packages are refused
unless the operator allowlists them by reference in ``RATCHET_STDLIB_TOOLS``
(comma-separated ``module:function``): ``os:abort`` or ``os:fork`` as a "tool"
would let an agent file take a worker down. Loading a tool imports its module,
which runs the module's top-level code in the worker: only people trusted to run
code on the workers may write agent files (README, "Trust model").

Its JSON schema comes from its type
hints; pydantic validates the model's arguments, and arguments that do not
validate go back to the model as an error result rather than crashing the run.
A tool that raises does the same. ``@tool(idempotent=True)`` marks a tool safe
to run again when a crash leaves its outcome unknown; the default is not
idempotent, and such a call is parked for an operator instead of repeated —
unless the tool declares a probe, ``@tool(probe=fn)``, that can say whether it
ran (runtime/probes.py). A tool (and its probe) that declares a parameter of
type :class:`~runtime.probes.ToolContext` receives the call's stable
idempotency key in it; that parameter is not part of the JSON schema.

Four control tools are built in, ``request_user_input`` and ``blocked`` (the
run waits for a person's answer), ``wait`` (for a time, runtime/timers.py) and
``run_child`` (for a child run, runtime/children.py): the runtime never
executes them, it suspends the run.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import to_jsonable_python

from runtime import json_values
from runtime.children import RUN_CHILD, ChildArguments
from runtime.errors import CallNotSent, NotStorable, ToolError
from runtime.json_values import without_surrogates
from runtime.models import INVALID_ARGUMENTS_KEY, UNUSABLE_ARGUMENTS_KEY
from runtime.probes import Answer, NotRun, Probed, Ran, ToolContext, Unknown
from runtime.timers import WAIT, WaitArguments

F = TypeVar("F", bound=Callable[..., Any])

REQUEST_USER_INPUT = "request_user_input"
BLOCKED = "blocked"

STDLIB_TOOLS_ENV = "RATCHET_STDLIB_TOOLS"
"""Comma-separated ``module:function`` references allowed although they are refused by default."""
REFUSED_PACKAGES = frozenset(sys.stdlib_module_names) | {"runtime", "store", "tasks", "worker"}
"""Top-level packages whose functions are not tools: the standard library and ratchet itself."""
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI-compatible APIs accept as a function name."""


def is_tool_name(name: object) -> bool:
    """Whether ``name`` is a name the model APIs accept for a tool (1-64 of ``[A-Za-z0-9_-]``)."""
    return isinstance(name, str) and _TOOL_NAME.fullmatch(name) is not None


WHAT_A_TOOL_IS = (
    "a tool must be a plain Python function (`def`) in a module of your own, "
    "named `module:function`"
)


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
    """A tool another process runs (an MCP server's, runtime/mcp/): called with the
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
            name, f"its type hints cannot be evaluated ({_short(exc)}); import what they name"
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
        raise ToolError(name, f"its parameter types cannot be validated ({_short(exc)})") from exc
    return model


def _probe(
    reference: str, probe: object, tool_fields: dict[str, Any]
) -> tuple[Callable[..., Any] | None, tuple[str, ...], str | None]:
    """The probe, the tool parameters it takes and its ToolContext parameter; ToolError if unfit."""
    if probe is None:
        return None, (), None
    if not inspect.isfunction(probe):
        raise ToolError(reference, f"its probe is {_kind(probe)}, not a plain function")
    fields, context = _parameters(f"{reference} (probe)", probe)
    foreign = sorted(set(fields) - set(tool_fields))
    if foreign:
        raise ToolError(
            reference,
            f"its probe takes `{foreign[0]}`, which is not a parameter of the tool; a probe "
            "takes the tool's parameters (any of them) and a ToolContext",
        )
    return probe, tuple(fields), context


def _short(exc: BaseException) -> str:
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
            f"its parameters cannot be described as JSON schema ({_short(exc)}); "
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


def load_tool(reference: str) -> ToolSpec:
    """Resolve ``module:function`` (or a control tool's name) to a :class:`ToolSpec`.

    Raises ToolError (and nothing else) saying what a tool must be. Importing the
    module runs its top-level code; a module of the standard library or of ratchet
    is not imported at all unless ``RATCHET_STDLIB_TOOLS`` names the reference.
    """
    if reference in CONTROL_TOOLS:
        return CONTROL_TOOLS[reference]
    module_name, sep, attr = reference.partition(":")
    if not sep or not _MODULE.fullmatch(module_name) or not _IDENTIFIER.fullmatch(attr):
        raise ToolError(
            reference,
            "expected `module:function` (an absolute module path and a function name) "
            "or a built-in control tool: " + ", ".join(sorted(CONTROL_TOOLS)),
        )
    allowed = reference in allowlisted_references()
    if not allowed and _refused_package(module_name):
        raise ToolError(reference, _refused_message(module_name))
    module = _import(reference, module_name)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ToolError(reference, f"module `{module_name}` has no function `{attr}`")
    if not inspect.isfunction(fn):
        raise ToolError(reference, f"`{attr}` is {_kind(fn)}, not a function; {WHAT_A_TOOL_IS}")
    defined_in = str(getattr(fn, "__module__", None) or "")
    if not allowed and _refused_package(defined_in):
        # A module of one's own may re-export `os.path.join`: where it is defined counts.
        raise ToolError(reference, _refused_message(defined_in))
    key = (fn, reference)
    spec = _specs.get(key)
    if spec is None:
        spec = _specs[key] = spec_from_function(fn, reference)
    return spec


_specs: dict[tuple[Callable[..., Any], str], ToolSpec] = {}
"""The spec of each tool function this process loaded (its arguments model and JSON schema
cost a few ms to build, measured, and an agent file is loaded again whenever it changes).
A function object does not change its signature or marks; a module imported afresh makes
new function objects."""


def allowlisted_references() -> frozenset[str]:
    """The references ``RATCHET_STDLIB_TOOLS`` allows although their package is refused."""
    raw = os.environ.get(STDLIB_TOOLS_ENV, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _refused_package(module_name: str) -> bool:
    return module_name.split(".", 1)[0] in REFUSED_PACKAGES or module_name == "__main__"


def _refused_message(module_name: str) -> str:
    top = module_name.split(".", 1)[0]
    where = "ratchet's own" if top in {"runtime", "store", "tasks", "worker"} else "the standard"
    return (
        f"`{module_name}` is part of {where} library, whose functions are not tools "
        f"({WHAT_A_TOOL_IS}); wrap what you need in a function of your own, or, if the "
        f"operator accepts it, add the reference to {STDLIB_TOOLS_ENV}"
    )


def _kind(value: object) -> str:
    if inspect.isclass(value):
        return "a class"
    if inspect.isbuiltin(value) or type(value).__name__ in {"method-wrapper", "wrapper_descriptor"}:
        return "a builtin or C function"
    if inspect.ismethod(value):
        return "a bound method"
    if inspect.ismodule(value):
        return "a module"
    return "a callable object" if callable(value) else "not callable"


def _import(reference: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolError(reference, f"module `{module_name}` cannot be imported: {exc}") from exc
    except SyntaxError as exc:
        raise ToolError(
            reference,
            f"module `{module_name}` cannot be imported: a syntax error at "
            f"{exc.filename}:{exc.lineno}",
        ) from exc
    except (Exception, SystemExit) as exc:  # the module's top-level code raised
        raise ToolError(
            reference,
            f"module `{module_name}` raised {type(exc).__name__} while being imported; "
            f"import it in Python on the worker to see why",
        ) from exc


def _refused_arguments(spec: ToolSpec, arguments: dict[str, Any]) -> str | None:
    """Why arguments the provider marked as unusable cannot reach the tool, or None."""
    if INVALID_ARGUMENTS_KEY in arguments:
        raw = error_text(str(arguments[INVALID_ARGUMENTS_KEY])[:200])
        return f"arguments for `{spec.name}` were not valid JSON: {raw}"
    if UNUSABLE_ARGUMENTS_KEY in arguments:
        why = error_text(str(arguments[UNUSABLE_ARGUMENTS_KEY])[:300])
        return f"arguments for `{spec.name}` cannot be used: they {why}; the tool did not run"
    return None


def _parsed(spec: ToolSpec, arguments: dict[str, Any]) -> dict[str, Any] | str:
    """The validated arguments by name, or why they do not validate (for the model)."""
    refused = _refused_arguments(spec, arguments)
    if refused is not None:
        return refused
    try:
        parsed = spec.arguments_model.model_validate(arguments)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(arguments)'}: {err['msg']}"
            for err in exc.errors()
        )
        return f"invalid arguments for `{spec.name}`: {problems}"
    return {k: getattr(parsed, k) for k in type(parsed).model_fields}


def invoke(
    spec: ToolSpec, arguments: dict[str, Any], context: ToolContext | None = None
) -> ToolOutcome:
    """Run a tool; never raises for the tool's own failures (they become error results).
    Raises :class:`~runtime.errors.CallNotSent` when a remote tool's server could not be
    reached before the call was sent: nothing ran.

    ``context`` goes to the tool's ToolContext parameter, if it has one (required then).
    """
    if spec.remote is not None:
        return _invoke_remote(spec, arguments, context)
    if spec.fn is None:
        raise ToolError(spec.name, "control tools suspend the run; they are never invoked")
    parsed = _parsed(spec, arguments)
    if isinstance(parsed, str):
        return ToolOutcome(False, parsed)
    if spec.context_parameter is not None:
        if context is None:
            raise ToolError(spec.name, "it takes a ToolContext and none was given")
        parsed[spec.context_parameter] = context
    try:
        value = spec.fn(**parsed)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:
        # A tool's failure is the model's to handle, not the run's. A tool runs on a caller
        # thread (tasks/calls.py), so its `sys.exit()` or KeyboardInterrupt is its own
        # failure, never a signal to this worker: re-raised, it would end the pool process
        # and the tool, whose call is journaled, would run again on the retry.
        return ToolOutcome(False, error_text(f"`{spec.name}` raised {type(exc).__name__}: {exc}"))
    return result_outcome(spec.name, value)


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
            False, error_text(f"`{name}` ran, but returned a value that is not JSON: {_short(exc)}")
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


def _invoke_remote(
    spec: ToolSpec, arguments: dict[str, Any], context: ToolContext | None
) -> ToolOutcome:
    assert spec.remote is not None
    refused = _refused_arguments(spec, arguments)
    if refused is not None:
        return ToolOutcome(False, refused)
    try:
        value = spec.remote(arguments, context)
    except CallNotSent:
        raise  # nothing ran: the run stalls naming the server, and a resume sends it
    except Exception as exc:  # the server's failure is the model's to handle, not the run's
        return ToolOutcome(False, error_text(f"`{spec.name}` failed: {exc}"))
    return result_outcome(spec.name, value)


def ask_probe(spec: ToolSpec, arguments: dict[str, Any], context: ToolContext) -> Probed:
    """Ask the tool's probe whether the call ran; never raises (a failure is ``failed``).

    The caller bounds how long it waits (tasks/tools_parallel.py): a probe that
    does not answer in time is ``timed_out``.
    """
    if spec.probe is None:
        raise ToolError(spec.name, "it has no probe")
    parsed = _parsed(spec, arguments)
    if isinstance(parsed, str):
        # Arguments that do not validate never reach the tool: running the call "again"
        # gives the model the same error and calls nothing.
        return Probed(Answer.NOT_RUN)
    kwargs = {k: v for k, v in parsed.items() if k in spec.probe_parameters}
    if spec.probe_context_parameter is not None:
        kwargs[spec.probe_context_parameter] = context
    try:
        answer = spec.probe(**kwargs)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # the outcome stays unknown
        return Probed(Answer.FAILED, detail=error_text(f"raised {_short(exc)}"))
    if isinstance(answer, Ran):
        # The call ran: a result that cannot be stored is its outcome as an error result.
        outcome = result_outcome(spec.name, answer.result)
        if outcome.ok:
            return Probed(Answer.RAN, outcome.result)
        return Probed(Answer.RAN, detail=str(outcome.result))
    if isinstance(answer, NotRun):
        return Probed(Answer.NOT_RUN)
    if isinstance(answer, Unknown):
        return Probed(Answer.UNKNOWN, detail=error_text(" ".join(str(answer.why).split())[:300]))
    return Probed(
        Answer.FAILED, detail=f"returned {type(answer).__name__}, not Ran, NotRun or Unknown"
    )
