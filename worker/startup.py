"""What ``import worker`` checks before it imports any other package of ratchet's.

``celery -A worker`` imports this package with the current directory first on
``sys.path``: a team's Celery first-steps ``tasks.py`` or a ``store.py`` there
would be imported instead of ratchet's ``tasks`` and ``store`` packages, and the
worker would die in an ImportError traceback. The check runs first and says so
in one line. Nothing here imports ratchet's other packages.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from celery.utils.imports import cwd_in_path

RATCHET_PACKAGES = ("tasks", "store", "runtime", "runtime_io", "worker")
"""Ratchet's top-level packages: a module of the same name earlier on sys.path shadows them."""
RATCHET_ROOT = Path(__file__).resolve().parents[1]

COMMANDS = ("celery", "ratchet", "worker", "-m")
"""How a command line shows in ``__main__`` or ``sys.argv[0]`` (``-m``: a package's import)."""


def on_a_command_line() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = spec.name.split(".")[0] if spec is not None and spec.name else ""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name in COMMANDS or program in COMMANDS


def shadowing_modules(*, with_cwd: bool = True) -> list[str]:
    """Modules that would be imported instead of ratchet's own packages, by path.

    Celery puts the current directory first on ``sys.path`` while it imports task
    modules, so a team's ``tasks.py`` or ``store.py`` there wins over ratchet's;
    ``with_cwd=False`` looks at ``sys.path`` as it is now.
    """
    found = []
    for name in RATCHET_PACKAGES:
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None) if module is not None else None
        if module is None:
            origin = _origin(name, with_cwd)
        if origin and not Path(origin).resolve().is_relative_to(RATCHET_ROOT):
            found.append(f"{origin} shadows ratchet's `{name}` package")
    return found


def _origin(name: str, with_cwd: bool) -> str | None:
    try:
        if with_cwd:
            with cwd_in_path():
                spec = importlib.util.find_spec(name)
        else:
            spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def shadow_problem(*, with_cwd: bool = True) -> str | None:
    shadows = shadowing_modules(with_cwd=with_cwd)
    if not shadows:
        return None
    return (
        "ratchet: refusing to start: " + "; ".join(shadows) + " (the current directory comes "
        "first on sys.path); rename that module or start the worker from another directory"
    )


def refuse_if_shadowed() -> None:
    """On a command line: one line and exit status 2; elsewhere ImportError naming the module."""
    problem = shadow_problem(with_cwd=False)
    if problem is None:
        return
    if not on_a_command_line():
        raise ImportError(problem.removeprefix("ratchet: "))
    print(problem, file=sys.stderr, flush=True)
    raise SystemExit(2)
