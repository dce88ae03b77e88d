"""What a process of tasks/ keeps outside its Context, listed: each with why it cannot be
the Context's (STYLE.md: "State hangs off one object the factory builds").

Module-level state is a hidden input: a reader cannot see it and a test must reset it.
tasks/context.py's :class:`~tasks.context.Context` holds what a run's work needs (settings,
stores, the limit store and its caches, loaded agents); what remains at module level
belongs to the *process* — its threads, its identity, Celery's signals, a library's own
globals — or is a cache keyed by something the Context does not own. A new piece must be listed here with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROCESS_STATE: dict[str, str] = {
    "tasks/agent_cache.py:_first_seen": "the tool modules this process imported and how their "
    "files were when first seen: sys.modules is the process's, whatever Context loads",
    "tasks/threads.py:_callers": "the caller threads of this process (made again after a fork)",
    "tasks/threads.py:_heartbeats": "the heartbeat thread of this process",
    "tasks/context.py:_context": "the process's Context itself (get_context)",
    "tasks/context.py:_context_pid": "the pid that built it: a forked child builds its own",
    "tasks/held_run.py:_stopping": "Celery's worker_shutting_down: the process is stopping",
    "tasks/liveness.py:_process_ids": "this process's identity (host:pid:nonce), anew per fork",
    "tasks/liveness.py:_beats": "this process's liveness thread: liveness is the process's",
    "tasks/messages.py:_sending_app": "the Celery app sends go through outside a task "
    "(tasks.install, send_through); the enqueue functions are called without a Context",
    "tasks/metrics.py:_on": "whether Prometheus metrics are on: its registry is process-wide",
    "tasks/metrics.py:_made_directory": "the multiprocess metrics directory this process made",
    "tasks/metrics.py:_worst_late_s": "the latest turn lateness seen, for a process gauge",
    "tasks/pool.py:_slots": "the pool's concurrency from Celery's worker_init, before any "
    "Context: it sizes the HTTP and store pools",
    "tasks/pool.py:_pending": "a worker whose concurrency Celery resolves after worker_init",
    "tasks/refusals.py:_stores": "the rejected-message store of each broker this process uses",
    "tasks/sweep_logs.py:_quiet": "the filter on Celery's loggers: logging is process-wide",
    "tasks/tracing.py:_tracing": "OpenTelemetry's tracer provider: global by OTel's design",
    "tasks/tracing.py:_tracing_pid": "the pid that set it up: a forked child sets up its own",
}
"""Module-level state in tasks/ outside the Context, and why it stays there."""

MUTABLE_CALLS = frozenset(
    {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter",
     "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "Event", "local", "PerProcess"}
)  # fmt: skip
"""Calls that make state (a Lock is not listed: it guards state listed beside it)."""


def module_state(path: Path) -> set[str]:
    """Names of ``path`` that hold state: rebound by a ``global`` statement, or bound at
    module level to a container, a mutable type or an instance of the module's own class."""
    tree = ast.parse(path.read_text(), str(path))
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name) or target.id.isupper() or target.id.startswith("__"):
            continue  # CONSTANTS by convention, __all__
        called = ast.unparse(value.func).rsplit(".", 1)[-1] if isinstance(value, ast.Call) else ""
        if (
            isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp)
            or called in MUTABLE_CALLS
            or called in classes
        ):
            found.add(target.id)
    return found


def test_the_state_tasks_keeps_outside_its_context_is_the_listed_state() -> None:
    found = {
        f"{path.relative_to(ROOT).as_posix()}:{name}"
        for path in sorted((ROOT / "tasks").glob("*.py"))
        for name in module_state(path)
    }
    assert sorted(found - set(PROCESS_STATE)) == [], "list it, with why it is not the Context's"
    assert sorted(set(PROCESS_STATE) - found) == [], "no longer there: take it off the list"


def test_the_pure_core_keeps_no_state_at_all() -> None:
    # runtime/ decides from what it is handed: nothing it remembers between calls.
    found = {
        f"{path.relative_to(ROOT).as_posix()}:{name}"
        for path in sorted((ROOT / "runtime").rglob("*.py"))
        for name in module_state(path)
    }
    assert sorted(found) == []


def test_the_finder_finds_state(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import weakref\nclass C: ...\nLIMIT = {}\n_cache = {}\n_weak = weakref.WeakKeyDictionary()\n"
        "_one = C()\n_n = None\nlog = print\n\ndef f() -> None:\n    global _n\n    _n = 1\n"
    )
    assert module_state(module) == {"_cache", "_weak", "_one", "_n"}
