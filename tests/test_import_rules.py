"""The layers, held by the suite: who may import whom, no I/O in the core, and no import cycle.

``runtime`` is the pure core and imports nothing of ours, nor anything that does I/O;
``runtime_io`` is the runtime's I/O (providers, MCP, agent files, tool calls) over it;
``store`` persists runtime's models and knows nothing else of ratchet; ``tasks`` is the
Celery shell over them and never reaches up into ``worker`` (the process: app, CLI, API).
Every import counts, a function-level one too: an import put off until call time
is still a dependency, and a cycle of them is still a cycle.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "runtime_io", "store", "tasks", "worker")

ALLOWED: dict[str, tuple[str, ...]] = {
    "runtime": (),
    "runtime_io": ("runtime",),
    # runtime.limits: the limit stores carry out the pure limiter's arithmetic (GCRA)
    # inside their own transaction, so the SQLite and memory stores share it.
    # runtime.memo: the snapshot's encoding of a message is remembered as a model request's
    # form of it is (runtime_io), by one class.
    "store": (
        "runtime.models",
        "runtime.errors",
        "runtime.limits",
        "runtime.json_values",
        "runtime.memo",
    ),
    "tasks": ("runtime", "runtime_io", "store", "tasks"),
    "worker": ("runtime", "runtime_io", "store", "tasks", "worker"),
}
"""What each package may import of ours (itself aside for runtime and store)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def imported(path: Path, name: str, modules: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, module) for each of our modules ``path`` imports, resolved to a module we have."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from tasks import failpoints` imports the module tasks.failpoints;
            # `from tasks.turn import chain`, the module tasks.turn.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield node.lineno, target


def graph() -> dict[str, set[str]]:
    modules = our_modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, target in imported(path, name, modules):
            edges[name].add(target)
    return edges


def is_within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    modules = our_modules()
    allowed = (package, *ALLOWED[package])
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: imports {target}"
        for name, path in modules.items()
        if is_within(name, package)
        for line, target in imported(path, name, modules)
        if not any(is_within(target, prefix) for prefix in allowed)
    ]
    assert not wrong, "\n".join(wrong)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


# --- the pure core ------------------------------------------------------------

CORE = "runtime"
"""The pure core: the fold, the decision, the actions and the rules (docs/architecture.md)."""
BANNED_IN_CORE = frozenset(
    {
        # The list: the clock, threads, the environment and the filesystem, code
        # loaded by name, an event loop, processes, the network.
        "os", "time", "threading", "importlib", "asyncio", "subprocess", "httpx",
        # The same things by other names.
        "sys", "socket", "ssl", "signal", "select", "selectors", "multiprocessing",
        "concurrent", "shutil", "tempfile", "urllib", "http", "sqlite3", "logging",
        "anyio", "mcp", "celery", "kombu", "redis", "gevent", "certifi", "tenacity",
        "boto3", "botocore",
        # Chance: the same events folded twice must give the same state.
        "random", "uuid", "secrets",
    }
)  # fmt: skip
"""What no module of the core may import: the core decides, ``runtime_io`` and ``tasks`` do."""


def outside_imports(path: Path, modules: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, top-level name) of each import of ``path`` that is not one of our modules."""
    ours = {name.split(".")[0] for name in modules}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in ours and top != "__future__":
                yield node.lineno, top


def with_parents(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """``edges`` plus what Python runs first on every import: each module's parent packages
    (``import tasks.lease`` runs tasks/__init__.py, and with it whatever that imports)."""
    full = {name: set(targets) for name, targets in edges.items()}
    for name in full:
        parts = name.split(".")
        full[name].update(".".join(parts[:i]) for i in range(1, len(parts)))
    return full


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in edges[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_pure_core_imports_nothing_that_does_io() -> None:
    # Every module an import of a core module runs — its own imports, theirs, and the
    # packages' __init__ files on the way — is of the core and imports nothing banned.
    modules = our_modules()
    edges = with_parents(graph())
    core = sorted(name for name in modules if is_within(name, CORE))
    assert len(core) >= 15
    run_by: dict[str, str] = {}
    for name in core:
        for module in reachable(edges, name):
            run_by.setdefault(module, name)
    wrong = []
    for module, importer in sorted(run_by.items()):
        how = "" if module == importer else f" (run by importing {importer})"
        if not is_within(module, CORE):
            wrong.append(f"{module} is not the core{how}")
            continue
        path = modules[module]
        wrong.extend(
            f"{path.relative_to(ROOT)}:{line}: imports {top}{how}"
            for line, top in outside_imports(path, modules)
            if top in BANNED_IN_CORE
        )
    assert not wrong, "\n".join(wrong)


def test_the_ban_finds_a_banned_import(tmp_path: Path) -> None:
    module = tmp_path / "clock.py"
    module.write_text("import os.path\nfrom time import monotonic\nimport json\nfrom . import x\n")
    found = [top for _, top in outside_imports(module, {})]
    assert found == ["os", "time", "json"]
    assert {"os", "time"} <= BANNED_IN_CORE and "json" not in BANNED_IN_CORE


IO_LIBRARIES = ("httpx", "anyio", "mcp", "celery", "kombu", "redis", "asyncio", "subprocess")


def test_importing_the_whole_core_loads_no_io_library_and_nothing_else_of_ours() -> None:
    # What the static check cannot see: a library the core imports that imports one of these.
    core = sorted(name for name in our_modules() if is_within(name, CORE))
    others = sorted({name.split(".")[0] for name in our_modules()} - {CORE})
    code = (
        "import importlib, json, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        f"tops = {{m.split('.')[0] for m in sys.modules}}\n"
        f"print(json.dumps(sorted(tops & set({[*IO_LIBRARIES, *others]!r}))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


# --- cycles through a package's __init__ ------------------------------------------

EAGER_PACKAGES: dict[str, str] = {
    "runtime": "`from runtime import tool, ToolContext, NotRun, Ran, Unknown`, the API a "
    "tool's module uses (docs/tools.md), re-exports runtime.tools and runtime.probes",
    "store": "`open_run_store`/`open_snapshot_store` and the contracts (`from store import "
    "RunStore`) are the store's front door",
    "store.conformance": "`from store.conformance import RunStoreContract, ...`: the "
    "conformance suite a backend's author imports (docs/conformance.md)",
    "tasks": "`tasks.install(app)` and the task objects: a shared task exists only once its "
    "module is imported, so importing `tasks` registers them all",
    "worker": "`celery -A worker` finds the app as `worker.app`: importing the package "
    "builds it (after refusing a shadowed package, worker/startup.py)",
}
"""The packages whose ``__init__`` imports their own modules, and why it must.

Each closes a cycle with those modules, since importing any of them runs the ``__init__``
first. Python resolves it because the modules import only their siblings, never a name the
``__init__`` defines: such an import is an edge to the package itself, and the test above
(:func:`test_no_module_imports_itself_through_others`) fails on the cycle it closes. So a
package's eager imports may run only downwards, into the package; this test holds that and
names the packages that do it."""


def test_a_packages_eager_imports_cycle_only_through_its_own_modules() -> None:
    found = cycles(with_parents(graph()))
    packages = {}
    for group in found:
        package = min(group, key=len)
        strays = [m for m in group if not is_within(m, package)]
        assert not strays, f"a cycle through {package}/__init__.py leaves it: {strays}"
        packages[package] = group
    assert sorted(packages) == sorted(EAGER_PACKAGES), (
        f"packages whose __init__ imports their own modules: {sorted(packages)}; "
        "EAGER_PACKAGES lists each with the reason it must"
    )


# --- Celery's and kombu's internals: tasks/broker/ only ------------------------------

BROKER_SEAM = "tasks.broker"
CELERY_PUBLIC: dict[str, str] = {
    "celery": "the app, shared_task, current_app",
    "celery.signals": "the documented signals",
    "celery.exceptions": "the documented exceptions (Retry, Reject, ...)",
    "celery.beat": "PersistentScheduler, the documented default of beat_scheduler",
    "kombu": "Connection, Exchange, Queue",
    "kombu.exceptions": "OperationalError, the documented connection error",
    "kombu.common": "maybe_declare and ignore_errors, kombu's documented utilities",
    # Used outside the seam, each as Celery's own command line uses it, read-only: none
    # reaches into a message, a channel or a transport.
    "celery.app.defaults": "the settings' defaults table (tasks/delivery.py: which options "
    "an application left as Celery's default)",
    "celery.app.utils": "find_app, as `celery -A` finds an app (worker/senders.py)",
    "celery.utils.imports": "cwd_in_path, as `celery -A` imports an app (worker/startup.py)",
    "celery.local": "Proxy, the lazy task object `shared_task` returns (tasks/task_base.py)",
    "kombu.transport": "TRANSPORT_ALIASES, to refuse a broker URL kombu has no transport "
    "for before a worker starts (tasks/settings.py)",
}
"""What of Celery and kombu the project imports outside :mod:`tasks.broker`, and why."""


def celery_and_kombu_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for each Celery or kombu module ``path`` imports."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("celery", "kombu"):
                yield node.lineno, name


def test_celery_and_kombu_internals_are_reached_only_from_the_broker_seam() -> None:
    reached = {
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for name, path in our_modules().items()
        if not is_within(name, BROKER_SEAM)
        for line, module in celery_and_kombu_imports(path)
        if module not in CELERY_PUBLIC
    }
    assert not reached, (
        "Celery's and kombu's internals belong in tasks/broker/ (its __init__ says why):\n"
        + "\n".join(sorted(reached))
    )
    # and the seam does reach them: the list above is not vacuous
    inside = {
        module
        for name, path in our_modules().items()
        if is_within(name, BROKER_SEAM)
        for _, module in celery_and_kombu_imports(path)
    }
    assert inside - set(CELERY_PUBLIC) >= {"celery.app.amqp", "kombu.utils.json"}
