"""Agent files: TOML that names a model, a system prompt, tools, budgets and policy.

::

    name = "refund-desk"
    model = "scripted"
    script = "refund-desk.script.json"   # relative to this file
    system = "You are a refund desk."
    tools = ["examples.refunds:lookup_order", "request_user_input"]
    [budgets]
    max_turns = 12
    [policy]
    require_approval = ["issue_refund"]

A bad file is refused with an :class:`AgentFileError` naming the file and the key,
and nothing else escapes the loader. Errors name files, keys and positions, never
what a file contains. The script must lie in the agent file's directory (after
following symlinks) unless the operator sets ``RATCHET_ALLOW_OUTSIDE_SCRIPTS=1``:
otherwise an agent file could point the worker at any file it can read.
"""

from __future__ import annotations

import os
import stat
import time
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runtime.agent import Agent, AgentSpec, binding_document, binding_of
from runtime.errors import AgentFileError, ToolError, plain_problem
from runtime.tools import ToolSpec
from runtime_io.providers.known import make_provider
from runtime_io.tools import load_tool

MAX_AGENT_FILE_BYTES = 1 << 20
MAX_SCRIPT_BYTES = 16 << 20
OUTSIDE_SCRIPTS_ENV = "RATCHET_ALLOW_OUTSIDE_SCRIPTS"
"""``1``: an agent file's ``script`` may name a file outside the agent file's directory."""


def _read_regular_file(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file; OSError or ValueError (said in words) if not.

    Opened non-blocking and checked with fstat: a FIFO or a device named as an agent
    file or a script must not hang or flood the worker.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def _load_toml(path: Path) -> dict[str, Any]:
    where = str(path)
    try:
        data = _read_regular_file(path, MAX_AGENT_FILE_BYTES)
    except FileNotFoundError as exc:
        raise AgentFileError(where, "", "no such file") from exc
    except OSError as exc:
        raise AgentFileError(where, "", f"cannot be read: {exc.strerror}") from exc
    except ValueError as exc:
        raise AgentFileError(where, "", str(exc)) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AgentFileError(
            where, "", f"not UTF-8 text (invalid byte at offset {exc.start})"
        ) from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's messages name a position (and at most one offending character).
        raise AgentFileError(where, "", f"not valid TOML: {exc}") from exc
    except RecursionError as exc:
        raise AgentFileError(where, "", "not valid TOML: nested too deeply") from exc
    except ValueError as exc:  # e.g. an integer over Python's digit limit
        raise AgentFileError(where, "", f"not valid TOML: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:160] if lines else type(exc).__name__


def _resolve(path: str | Path) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte
        raise AgentFileError(str(path)[:200], "", f"not a usable path: {exc}") from exc


def _script_path(path: Path, script: str) -> Path:
    """The script's absolute path, refused if it leaves the agent file's directory."""
    where = str(path)
    try:
        resolved = (path.parent / script).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise AgentFileError(where, "script", f"not a usable path ({type(exc).__name__})") from exc
    inside = resolved.is_relative_to(path.parent)
    if not inside and os.environ.get(OUTSIDE_SCRIPTS_ENV) != "1":
        raise AgentFileError(
            where,
            "script",
            f"{resolved} is outside the agent file's directory {path.parent}; move the "
            f"script beside the agent file, or set {OUTSIDE_SCRIPTS_ENV}=1 on the workers "
            "to allow any readable file",
        )
    try:
        _read_regular_file(resolved, MAX_SCRIPT_BYTES)
    except OSError as exc:
        raise AgentFileError(where, "script", f"{resolved} cannot be read: {exc.strerror}") from exc
    except ValueError as exc:
        raise AgentFileError(where, "script", f"{resolved}: {exc}") from exc
    return resolved


def _validation_problem(exc: ValidationError) -> tuple[str, str]:
    """The key and the problem of pydantic's first error, never quoting the value."""
    err = exc.errors(include_input=False, include_url=False)[0]
    key = ".".join(str(p) for p in err["loc"]) or ""
    problem = "unknown key" if err["type"] == "extra_forbidden" else plain_problem(err["msg"])
    return key, problem


def child_agent_path(agent_path: Path, relative: str) -> Path:
    """Where a child agent's file is: beside (or under) the parent's."""
    return (agent_path.parent / relative).resolve()


def _check_children(path: Path, spec: AgentSpec, tools: dict[str, ToolSpec]) -> None:
    if spec.children and "run_child" not in tools:
        raise AgentFileError(str(path), "children", "list `run_child` in `tools` to start them")
    for name, relative in spec.children.items():
        key = f"children.{name}"
        if not name.replace("_", "").replace("-", "").isalnum() or len(name) > 64:
            raise AgentFileError(str(path), key, "a child's name is letters, digits, - and _")
        if not relative.endswith(".toml") or not child_agent_path(path, relative).is_file():
            raise AgentFileError(str(path), key, f"no agent file {relative!r} beside this one")


def load_agent(path: str | Path) -> Agent:
    """Load and check an agent file; every problem names the file and the key.

    Raises AgentFileError and nothing else.
    """
    path = _resolve(path)
    try:
        return _load(path)
    except AgentFileError:
        raise
    except RecursionError as exc:
        raise AgentFileError(str(path), "", "nested too deeply") from exc


def _load(path: Path) -> Agent:
    raw = _load_toml(path)
    try:
        spec = AgentSpec.model_validate(raw)
    except ValidationError as exc:
        key, problem = _validation_problem(exc)
        if problem == "unknown key" and "key" in key.rsplit(".", 1)[-1].lower():
            problem += (
                "; a secret never goes in an agent file: export it where the workers run "
                "(RATCHET_OPENAI_API_KEY, or name your variable with `[provider] api_key_env`)"
            )
        raise AgentFileError(str(path), key, problem) from exc
    tools, approvals = _load_tools(path, spec)
    if approvals:
        # MCP tools whose annotations (or the file) ask for approval join the file's list.
        wanted = (
            *spec.policy.require_approval,
            *sorted(approvals - set(spec.policy.require_approval)),
        )
        spec = spec.model_copy(
            update={"policy": spec.policy.model_copy(update={"require_approval": wanted})}
        )
    for name in spec.policy.require_approval:
        if name not in tools:
            raise AgentFileError(
                str(path), "policy.require_approval", f"`{name}` is not one of the agent's tools"
            )
        if name not in approvals and _waived(tools[name]):
            mcp = tools[name].mcp or {}
            raise AgentFileError(
                str(path),
                "policy.require_approval",
                f"`{name}` is listed here, but `[mcp.{mcp.get('server')}.tools.{name}] "
                "approval = false` says it runs without one; keep one of the two",
            )
    _check_children(path, spec, tools)
    settings = dict(raw)
    if spec.script and spec.model == "scripted":
        settings["script"] = str(_script_path(path, spec.script))
    try:
        provider = make_provider(spec.model, path, settings)
    except ValueError as exc:
        key = _provider_key(str(exc))
        raise AgentFileError(str(path), key, str(exc)) from exc
    if spec.script is not None and spec.model != "scripted":
        raise AgentFileError(str(path), "script", "only the `scripted` provider plays a script")
    document = binding_document(spec, provider, tools)
    binding = binding_of(document)
    listed = time.monotonic() if any(t.mcp is not None for t in tools.values()) else None
    return Agent(spec, path, tools, provider, binding, document, listed)


def _waived(tool: ToolSpec) -> bool:
    """Whether the agent file's own MCP table said this tool needs no approval."""
    sources = (tool.mcp or {}).get("policy_from") or {}
    return sources.get("approval") == "agent file"


def _provider_key(problem: str) -> str:
    """The key a provider's ValueError is about: each names its part of the file first."""
    if problem.startswith("`[provider]"):
        return "provider"
    return "script" if problem.startswith("script ") else "model"


def _load_tools(path: Path, spec: AgentSpec) -> tuple[dict[str, ToolSpec], set[str]]:
    """The agent's tools by name, and the MCP tools that await approval."""
    tools: dict[str, ToolSpec] = {}
    approvals: set[str] = set()
    servers = (
        _mcp_servers(path, spec)
        if spec.mcp or any(r.startswith("mcp:") for r in spec.tools)
        else {}
    )
    for index, reference in enumerate(spec.tools):
        try:
            if reference.startswith("mcp:"):
                loaded = _mcp_tools(path, spec, servers, reference)
            else:
                loaded = [(load_tool(reference), False)]
        except ToolError as exc:
            raise AgentFileError(
                str(path),
                f"tools[{index}]",
                f"tool `{exc.reference}`: {exc.problem}",
                ToolError.FIX,
            ) from exc
        for tool_spec, approval in loaded:
            if tool_spec.name in tools:
                raise AgentFileError(
                    str(path), f"tools[{index}]", f"two tools named `{tool_spec.name}`"
                )
            tools[tool_spec.name] = tool_spec
            if approval:
                approvals.add(tool_spec.name)
    return tools, approvals


def _mcp_servers(path: Path, spec: AgentSpec) -> dict[str, Any]:
    from runtime_io.mcp import Server, parse_servers

    try:
        import mcp  # noqa: F401
    except ImportError:
        raise AgentFileError(
            str(path), "mcp", "MCP tools need the `mcp` extra: pip install 'ratchet[mcp]'"
        ) from None

    try:
        tables = parse_servers(spec.mcp)
    except ValueError as exc:
        raise AgentFileError(str(path), "mcp", str(exc)) from exc
    return {name: Server(name, table, path.parent) for name, table in tables.items()}


def _mcp_tools(
    path: Path, spec: AgentSpec, servers: dict[str, Any], reference: str
) -> list[tuple[ToolSpec, bool]]:
    from runtime_io.mcp import parse_reference
    from runtime_io.mcp.sessions import ServerUnavailable
    from runtime_io.mcp.tools import specs

    name, wanted = parse_reference(reference)
    server = servers.get(name)
    if server is None:
        raise ToolError(reference, f"no `[mcp.{name}]` table in the agent file names the server")
    try:
        return specs(server, wanted, spec.tool_timeout_s)
    except ServerUnavailable as exc:
        raise ToolError(reference, f"{exc}; start the server, or fix `[mcp.{name}]`") from None
