"""ratchet's pure core: the run FSM, agents, budgets, binding, providers and tools.

Nothing here talks to Celery or to a store; ``tasks/`` does the I/O around it.
"""

from runtime.probes import NotRun, Ran, ToolContext, Unknown
from runtime.tools import tool

__all__ = ["NotRun", "Ran", "ToolContext", "Unknown", "tool"]
