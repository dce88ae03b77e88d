"""The layers, held by the suite: who may import whom, and no import cycle.

``runtime`` is the pure core and imports nothing of ours; ``store`` persists
runtime's models and knows nothing else of ratchet; ``tasks`` is the Celery shell
over both and never reaches up into ``worker`` (the process: app, CLI, API).
Every import counts, a function-level one too: an import put off until call time
is still a dependency, and a cycle of them is still a cycle.
"""

from __future__ import annotations

import ast
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
    "store": ("runtime.models", "runtime.errors", "runtime.limits", "runtime.json_values"),
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
