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

A bad file is refused with an :class:`AgentFileError` naming the file and the key.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.errors import AgentFileError, ToolError
from runtime.models import Budgets, Policy
from runtime.providers import Provider, make_provider
from runtime.tools import ToolSpec, load_tool

SNAPSHOT_FORMAT_VERSION = 1
"""The snapshot format this build writes; part of every binding."""


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
    model_timeout_s: float = Field(default=120.0, gt=0)
    """Longest wait for one model call (with its retries); then the attempt is abandoned."""
    tool_timeout_s: float = Field(default=300.0, gt=0)
    """Longest wait for one tool call; then its outcome is unknown (see tasks/turn.py)."""
    # The timeouts stay out of the binding on purpose: they bound how long a worker
    # waits, not what the run does, and raising one is how an operator lets a slow
    # run go on — that must not make its resume refused as a changed agent.
    max_suspended_s: int | None = Field(default=None, ge=1)
    """How long a suspended run may wait for an answer before it expires; ``None``: forever."""


@dataclass(frozen=True)
class Agent:
    """A loaded agent: its spec, resolved tools, provider and binding."""

    spec: AgentSpec
    path: Path
    tools: dict[str, ToolSpec]
    provider: Provider
    binding: str
    binding_document: dict[str, Any]

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
    return document


def describe_binding_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Name the parts of a binding document that differ, for an operator's message."""
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return "changed: " + ", ".join(changed) if changed else "changed"


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as exc:
        raise AgentFileError(str(path), "(file)", "no such file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise AgentFileError(str(path), "(file)", f"not valid TOML: {exc}") from exc


def load_agent(path: str | Path) -> Agent:
    """Load and check an agent file; every problem names the file and the key."""
    path = Path(path).resolve()
    raw = _load_toml(path)
    try:
        spec = AgentSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(file)"
        problem = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "extra_forbidden" and "key" in key.rsplit(".", 1)[-1].lower():
            problem += (
                "; a secret never goes in an agent file: export it where the workers run "
                "(RATCHET_OPENAI_API_KEY, or name your variable with `[provider] api_key_env`)"
            )
        raise AgentFileError(str(path), key, problem) from exc
    tools: dict[str, ToolSpec] = {}
    for index, reference in enumerate(spec.tools):
        try:
            tool_spec = load_tool(reference)
        except ToolError as exc:
            raise AgentFileError(str(path), f"tools[{index}]", str(exc)) from exc
        if tool_spec.name in tools:
            raise AgentFileError(
                str(path), f"tools[{index}]", f"two tools named `{tool_spec.name}`"
            )
        tools[tool_spec.name] = tool_spec
    for name in spec.policy.require_approval:
        if name not in tools:
            raise AgentFileError(
                str(path), "policy.require_approval", f"`{name}` is not one of the agent's tools"
            )
    try:
        provider = make_provider(spec.model, path, raw)
    except ValueError as exc:
        raise AgentFileError(str(path), "model", str(exc)) from exc
    if spec.script is not None and spec.model != "scripted":
        raise AgentFileError(str(path), "script", "only the `scripted` provider plays a script")
    document = _binding_document(spec, provider, tools)
    binding = "sha256:" + hashlib.sha256(canonical_json(document)).hexdigest()
    return Agent(spec, path, tools, provider, binding, document)
