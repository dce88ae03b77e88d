"""MCP servers as durable tools: the agent file's ``[mcp.<server>]`` tables and their tools.

::

    tools = ["mcp:billing/issue_refund", "mcp:billing/lookup_order", "mcp:docs/*"]

    [mcp.billing]                          # a stdio server: an argv, never a shell line
    command = ["python", "-m", "billing_mcp"]
    env = ["BILLING_MCP_TOKEN"]            # passed from the worker's environment, if allowed
    [mcp.billing.tools.issue_refund]       # overrides what the server's annotations say
    idempotent = true                      # the server deduplicates on the idempotency key
    approval = false

    [mcp.docs]                             # a streamable-HTTP server: loopback or https
    url = "https://docs.example.com/mcp"
    headers = { Authorization = "Bearer ${DOCS_MCP_TOKEN}" }

A tool named ``mcp:<server>/<tool>`` (or ``mcp:<server>/*``, every tool the server
lists) is declared to the model with the schema the server's ``tools/list`` gives,
and that declaration — with the policy below and where it came from — goes into the
run's binding: a server whose tool changed makes a resume refused as a changed agent,
naming the tool.

**What the annotations decide** (MCP calls them hints; ratchet takes them as the
server's word, and the agent file has the last one):

- ``readOnlyHint`` or ``idempotentHint`` → idempotent: a call whose outcome a crash
  left unknown runs again on the next worker;
- ``destructiveHint: true`` (said, not the protocol's default) → the call awaits an
  operator's approval (``policy.require_approval``);
- otherwise not idempotent: an unknown outcome parks the run for an operator.

Each call carries its idempotency key in the request's ``_meta``
(``ratchet/idempotency_key``, with ``ratchet/run_id`` and ``ratchet/call_id``), the same on
every attempt, so a server can deduplicate. A result the server marks ``isError`` goes
back to the model as an error result, as a local tool's exception does.

**Which variables**: ``env`` names and ``${VAR}`` in ``headers`` may only be
variables ``RATCHET_MCP_VARIABLES`` allows (names or ``fnmatch`` patterns,
comma-separated; default ``RATCHET_MCP_*,*_MCP_TOKEN``); a stdio server gets those and
the SDK's short safe list (``PATH``, ``HOME``, ``USER``, ``SHELL``, ``TERM``, ``LOGNAME``)
and nothing else of the worker's environment. Header values are never logged, and
never sent over plain ``http://`` beyond loopback.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from runtime.errors import ToolError

VARIABLES_ENV = "RATCHET_MCP_VARIABLES"
DEFAULT_VARIABLES = "RATCHET_MCP_*,*_MCP_TOKEN"
SAFE_ENVIRONMENT = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")
META_KEY = "ratchet/idempotency_key"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TEMPLATE = re.compile(r"\$\{([^}]*)\}")


class McpToolPolicy(BaseModel):
    """``[mcp.<server>.tools.<tool>]``: the agent file's word over the annotations."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idempotent: bool | None = None
    """Safe to run again after a crash left its outcome unknown."""
    approval: bool | None = None
    """Awaits an operator's approval before it runs."""


class McpServerTable(BaseModel):
    """``[mcp.<server>]``: how to reach one MCP server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: tuple[str, ...] | None = None
    """A stdio server: the argv to start it with (relative paths from the agent file's folder)."""
    env: tuple[str, ...] = ()
    """Variables of the worker's environment the stdio server gets."""
    url: str | None = None
    """A streamable-HTTP server's endpoint: https, or http on loopback."""
    headers: dict[str, str] = {}
    """HTTP headers; ``${VAR}`` in a value is the variable's value."""
    connect_timeout_s: float = Field(default=30.0, gt=0, le=600, allow_inf_nan=False)
    """Longest wait to start (or reach) the server and list its tools."""
    tools: dict[str, McpToolPolicy] = {}

    @model_validator(mode="after")
    def _one_way_in(self) -> McpServerTable:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (a stdio server) or `url` (HTTP)")
        if self.command is not None and (not self.command or not self.command[0].strip()):
            raise ValueError("`command` is an argv: a list of strings, the program first")
        if self.url is None and self.headers:
            raise ValueError("`headers` go with `url`; a stdio server takes `env`")
        if self.url is not None and self.env:
            raise ValueError("`env` goes with `command`; an HTTP server takes `headers`")
        for name in self.env:
            _check_variable(name, "env")
        for value in self.headers.values():
            for name in _TEMPLATE.findall(value):
                _check_variable(name, "headers")
        if self.url is not None:
            _check_url(self.url)
        return self


def _check_variable(name: str, key: str) -> None:
    if not _VARIABLE.fullmatch(name):
        raise ValueError(f"`{key}` names `{name[:40]}`, which is not a variable name")
    if not variable_allowed(name):
        raise ValueError(
            f"`{key}` names the variable {name}, which the operator does not allow "
            f"({VARIABLES_ENV}={allowed_variables()}); name an allowed variable, or ask "
            f"the operator to add it to {VARIABLES_ENV}"
        )


def _check_url(url: str) -> None:
    import httpx

    from runtime_io.providers.openai import is_loopback  # one definition of loopback

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError("`url` is not an http(s) URL with a host")  # not quoted: credentials
    if parsed.scheme == "http" and not is_loopback(parsed.host):
        raise ValueError(
            f"`url`: plain http to {parsed.host} is refused (headers and results would "
            "travel in the clear); use https, or a loopback address"
        )


def allowed_variables() -> str:
    return os.environ.get(VARIABLES_ENV) or DEFAULT_VARIABLES


def variable_allowed(name: str) -> bool:
    patterns = [p.strip() for p in allowed_variables().split(",")]
    return any(fnmatch.fnmatchcase(name, p) for p in patterns if p)


def parse_servers(raw: Any) -> dict[str, McpServerTable]:
    """The agent file's ``[mcp]`` tables; ``ValueError`` names the server and key."""
    if not isinstance(raw, dict):
        raise ValueError("`[mcp]` must hold one table per server")
    servers: dict[str, McpServerTable] = {}
    for name, table in raw.items():
        if not _NAME.fullmatch(name):
            raise ValueError(f"`[mcp.{name[:40]}]`: a server's name is letters, digits, - and _")
        try:
            servers[name] = McpServerTable.model_validate(table)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            problem = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            problem = problem.removeprefix("Value error, ")
            raise ValueError(f"`[mcp.{name}]{' ' + key if key else ''}`: {problem}") from None
    return servers


def parse_reference(reference: str) -> tuple[str, str]:
    """``mcp:<server>/<tool>`` (or ``/*``) as (server, tool); ``ToolError`` if malformed."""
    server, sep, tool = reference.removeprefix("mcp:").partition("/")
    if not sep or not _NAME.fullmatch(server) or not (tool == "*" or _NAME.fullmatch(tool)):
        raise ToolError(reference, "an MCP tool is named `mcp:<server>/<tool>` or `mcp:<server>/*`")
    return server, tool


@dataclass(frozen=True)
class Server:
    """One configured server, as the sessions key it: its name and how it is reached."""

    name: str
    table: McpServerTable
    folder: Path
    """The agent file's folder: a stdio server starts there."""

    @property
    def key(self) -> str:
        """Two agents that name a server alike share its session in a process."""
        identity = {"name": self.name, "table": self.table.model_dump(mode="json")}
        identity["folder"] = str(self.folder)
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        return f"{self.name}:{digest[:16]}"

    def describe(self) -> str:
        if self.table.url is not None:
            from httpx import URL

            url = URL(self.table.url)  # the host and port: never its path, query or user
            return f"MCP server `{self.name}` at {url.host}{f':{url.port}' if url.port else ''}"
        return f"MCP server `{self.name}` (`{self.table.command[0] if self.table.command else ''}`)"

    def environment(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in SAFE_ENVIRONMENT if k in os.environ}
        env.update({k: os.environ[k] for k in self.table.env if k in os.environ})
        return env

    def headers(self) -> dict[str, str]:
        def value(match: re.Match[str]) -> str:
            name = match.group(1)
            if not variable_allowed(name):  # the operator's list may have changed since load
                raise ServerRefused(f"{self.describe()}: header variable {name} is not allowed")
            found = os.environ.get(name)
            if found is None:
                raise ServerRefused(
                    f"{self.describe()}: variable {name} (named in `headers`) is not set on "
                    "this worker; export it where the worker runs"
                )
            return found

        return {k: _TEMPLATE.sub(value, v) for k, v in self.table.headers.items()}


class ServerRefused(Exception):
    """A server's configuration cannot be used on this worker (a variable missing)."""
