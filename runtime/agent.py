"""An agent as the core knows it: its spec (the agent file's TOML, validated), its tools,
its provider, and its binding — the sha256 of what decides its behaviour.

Reading an agent file, building its provider and loading its tools is I/O, done by
:func:`runtime_io.agent_files.load_agent`; what an :class:`Agent` is, and what goes
into its binding, is decided here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runtime.children import MAX_CHILD_DEPTH, MAX_TREE_RUNS
from runtime.limits import LimitsTable
from runtime.models import Budgets, Policy
from runtime.numbers import Finite
from runtime.provider import Provider
from runtime.tools import ToolSpec

SNAPSHOT_FORMAT_VERSION = 1
"""The format version every binding names. It stays 1 while this build reads every format-1
snapshot (format 2 adds parallel tool calls, store/snapshots/format.py): raising it would
refuse every live run after an upgrade as a changed agent."""

MAX_TIMEOUT_S = 7 * 86_400.0
"""The longest timeout an agent may set: finite, and far below what the OS's waits accept."""


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
    """MCP servers by name (runtime_io/mcp/): their tools are named `mcp:<server>/<tool>`. How
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


def binding_document(
    spec: AgentSpec, provider: Provider, tools: dict[str, ToolSpec]
) -> dict[str, Any]:
    """What of the agent decides a run's behaviour, as the run's ``run.created`` records it."""
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


def binding_of(document: dict[str, Any]) -> str:
    """The binding a run is resumed and continued against: the document's canonical sha256."""
    return "sha256:" + hashlib.sha256(canonical_json(document)).hexdigest()


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
