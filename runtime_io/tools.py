"""Tools carried out: a tool's module imported, the tool and its probe called.

A tool is named ``module:function``, and it must be a plain Python function
(``def`` in a module, not a class, a builtin, a C function or another callable).
Functions of the standard library and of ratchet's own packages are refused
unless the operator allowlists them by reference in ``RATCHET_STDLIB_TOOLS``
(comma-separated ``module:function``): ``os:abort`` or ``os:fork`` as a "tool"
would let an agent file take a worker down. Loading a tool imports its module,
which runs the module's top-level code in the worker: only people trusted to run
code on the workers may write agent files (README, "Trust model").

What a tool declares, and what its result may be, is runtime/tools.py's; here the
model's arguments are validated against the declaration and the tool is called
(:func:`invoke`). A tool that raises becomes an error result for the model, as do
arguments that do not validate. A probe (:func:`ask_probe`) is called the same way.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from runtime.errors import CallNotSent, ToolError
from runtime.models import INVALID_ARGUMENTS_KEY, UNUSABLE_ARGUMENTS_KEY
from runtime.probes import Answer, NotRun, Probed, Ran, ToolContext, Unknown
from runtime.tools import (
    CONTROL_TOOLS,
    ToolOutcome,
    ToolSpec,
    callable_kind,
    error_text,
    result_outcome,
    short_error,
    spec_from_function,
)

STDLIB_TOOLS_ENV = "RATCHET_STDLIB_TOOLS"
"""Comma-separated ``module:function`` references allowed although they are refused by default."""
OUR_PACKAGES = frozenset({"runtime", "runtime_io", "store", "tasks", "worker"})
REFUSED_PACKAGES = frozenset(sys.stdlib_module_names) | OUR_PACKAGES
"""Top-level packages whose functions are not tools: the standard library and ratchet itself."""
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
WHAT_A_TOOL_IS = (
    "a tool must be a plain Python function (`def`) in a module of your own, "
    "named `module:function`"
)


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
        raise ToolError(
            reference, f"`{attr}` is {callable_kind(fn)}, not a function; {WHAT_A_TOOL_IS}"
        )
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
    where = "ratchet's own" if top in OUR_PACKAGES else "the standard"
    return (
        f"`{module_name}` is part of {where} library, whose functions are not tools "
        f"({WHAT_A_TOOL_IS}); wrap what you need in a function of your own, or, if the "
        f"operator accepts it, add the reference to {STDLIB_TOOLS_ENV}"
    )


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
        # thread (tasks/threads.py), so its `sys.exit()` or KeyboardInterrupt is its own
        # failure, never a signal to this worker: re-raised, it would end the pool process
        # and the tool, whose call is journaled, would run again on the retry.
        return ToolOutcome(False, error_text(f"`{spec.name}` raised {type(exc).__name__}: {exc}"))
    return result_outcome(spec.name, value)


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
        return Probed(Answer.FAILED, detail=error_text(f"raised {short_error(exc)}"))
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
