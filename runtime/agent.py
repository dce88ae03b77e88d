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

import hashlib
import json
import os
import stat
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.children import MAX_CHILD_DEPTH, MAX_TREE_RUNS
from runtime.errors import AgentFileError, ToolError, plain_problem
from runtime.limits import LimitsTable
from runtime.models import Budgets, Policy
from runtime.numbers import Finite
from runtime.providers import Provider
from runtime.providers.known import make_provider
from runtime.tools import ToolSpec, load_tool

SNAPSHOT_FORMAT_VERSION = 1
"""The format version every binding names. It stays 1 while this build reads every format-1
snapshot (format 2 adds parallel tool calls, store/snapshots/format.py): raising it would
refuse every live run after an upgrade as a changed agent."""

MAX_TIMEOUT_S = 7 * 86_400.0
"""The longest timeout an agent may set: finite, and far below what the OS's waits accept."""
MAX_AGENT_FILE_BYTES = 1 << 20
MAX_SCRIPT_BYTES = 16 << 20
OUTSIDE_SCRIPTS_ENV = "RATCHET_ALLOW_OUTSIDE_SCRIPTS"
"""``1``: an agent file's ``script`` may name a file outside the agent file's directory."""


class AgentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1)
    """Provider: `scripted`, or `provider:model-name`."""
    script: str | None = None
    """Scripted provider only: the JSON script, relative to the agent file."""
    provider: dict[str, Any] = {}
    """Provider settings, e.g. `base_url`, `api_key_env` (the name of a variable, never a key)."""
    system: str = ""
    tools: list[str] = []
    budgets: Budgets = Budgets()
    policy: Policy = Policy()
    model_timeout_s: Finite = Field(default=120.0, gt=0, le=MAX_TIMEOUT_S)
    """Longest wait for one model call (with its retries); then the attempt is abandoned."""
    tool_timeout_s: Finite = Field(default=300.0, gt=0, le=MAX_TIMEOUT_S)
    """Longest wait for one tool call; then its outcome is unknown (runtime/actions.py)."""
    max_parallel_tools: int = Field(default=4, ge=1, le=64)
    """Tool calls of one model response run at the same time, at most (tasks/tools_parallel.py)."""
    probe_timeout_s: Finite = Field(default=30.0, gt=0, le=MAX_TIMEOUT_S)
    """Longest wait for a tool's outcome probe; then the call's outcome stays unknown."""
    # The timeouts and max_parallel_tools stay out of the binding on purpose: they bound how long a worker
    # waits, not what the run does, and raising one is how an operator lets a slow
    # run go on — that must not make its resume refused as a changed agent.
    max_suspended_s: int | None = Field(default=None, ge=1, le=10 * 365 * 86_400)
    """How long a suspended run may wait for an answer before it expires; ``None``: forever."""
    children: dict[str, str] = {}
    """Agents this one may start with `run_child`: a name for the model, a file (relative)."""
    max_child_depth: int | None = Field(default=None, ge=0, le=MAX_CHILD_DEPTH)
    """As a root: how deep its run tree may grow (root 0); ``None``: the fleet's default."""
    max_tree_runs: int | None = Field(default=None, ge=1, le=MAX_TREE_RUNS)
    """As a root: the most runs its run tree may hold, itself included; ``None``: the fleet's."""
    # The tree limits stay out of the binding: they are fixed in each run's run.created
    # (runtime/children.py), so editing them changes new trees, never a live one.
    wake_on_input: bool = False
    """A run in a `wait` may be woken early by an answer (`runs continue --input`)."""
    limits: LimitsTable = LimitsTable()
    """Fleet-wide rate limits, concurrency caps and priority (runtime/limits.py). Not in the
    binding: they decide when a run's calls go, not what the run does."""
    mcp: dict[str, Any] = {}
    """MCP servers by name (runtime/mcp/): their tools are named `mcp:<server>/<tool>`. How
    a server is reached is not in the binding; each tool's schema and policy are."""


@dataclass(frozen=True)
class Agent:
    """A loaded agent: its spec, resolved tools, provider and binding."""

    spec: AgentSpec
    path: Path
    tools: dict[str, ToolSpec]
    provider: Provider
    binding: str
    binding_document: dict[str, Any]
    listed_at_s: float | None = None
    """When its MCP servers listed their tools (``time.monotonic()``); None without MCP.
    A cached copy is listed again after ``RATCHET_MCP_RELIST_S`` (tasks/context.py): a server's
    tools can change with no file changing."""

    @property
    def name(self) -> str:
        return self.spec.name

    def declarations(self) -> tuple[dict[str, Any], ...]:
        return tuple(spec.declaration() for spec in self.tools.values())


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _binding_document(
    spec: AgentSpec, provider: Provider, tools: dict[str, ToolSpec]
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "provider": provider.identity(),
        "model": spec.model,
        "system": spec.system,
        "tools": [t.declaration() for t in tools.values()],
        "policy": spec.policy.model_dump(mode="json"),
        "budgets": spec.budgets.model_dump(mode="json"),
        "format_version": SNAPSHOT_FORMAT_VERSION,
    }
    if spec.max_suspended_s is not None:
        # Only when set: agents without it keep the binding their runs started with.
        document["max_suspended_s"] = spec.max_suspended_s
    if spec.wake_on_input:
        document["wake_on_input"] = True
    if spec.children:
        document["children"] = dict(sorted(spec.children.items()))
    return document


def describe_binding_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Name the parts of a binding document that differ, for an operator's message."""
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if "tools" in changed:
        # Name the tools, not just `tools`: an MCP server's tool can change under a run.
        old = {t.get("name"): t for t in before.get("tools", ()) if isinstance(t, dict)}
        new = {t.get("name"): t for t in after.get("tools", ()) if isinstance(t, dict)}
        names = sorted(str(n) for n in set(old) | set(new) if old.get(n) != new.get(n))
        if names:
            changed[changed.index("tools")] = "tools (" + ", ".join(f"`{n}`" for n in names) + ")"
    return "changed: " + ", ".join(changed) if changed else "changed"


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
    document = _binding_document(spec, provider, tools)
    binding = "sha256:" + hashlib.sha256(canonical_json(document)).hexdigest()
    listed = time.monotonic() if any(t.mcp is not None for t in tools.values()) else None
    return Agent(spec, path, tools, provider, binding, document, listed)


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
                str(path), f"tools[{index}]", f"tool `{exc.reference}`: {exc.problem}", ToolError.FIX
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
    from runtime.mcp import Server, parse_servers

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
    from runtime.mcp import parse_reference
    from runtime.mcp.sessions import ServerUnavailable
    from runtime.mcp.tools import specs

    name, wanted = parse_reference(reference)
    server = servers.get(name)
    if server is None:
        raise ToolError(reference, f"no `[mcp.{name}]` table in the agent file names the server")
    try:
        return specs(server, wanted, spec.tool_timeout_s)
    except ServerUnavailable as exc:
        raise ToolError(reference, f"{exc}; start the server, or fix `[mcp.{name}]`") from None
