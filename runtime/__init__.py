"""ratchet's pure core: the run FSM, agents, budgets, binding, the provider's contract and tools.

Nothing here does I/O: ``runtime_io/`` reaches models, MCP servers, agent files and
tools, and ``tasks/`` loads, persists and enqueues around it (tests/test_import_rules.py).
"""

from runtime.probes import NotRun, Ran, ToolContext, Unknown
from runtime.tools import tool

__all__ = ["NotRun", "Ran", "ToolContext", "Unknown", "tool"]
