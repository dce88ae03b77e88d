"""What a worker's agent cache follows: every file an agent's binding covers.

A binding covers the agent file, its script (the scripted provider's model) and the
declarations of its tools, which come from the tool modules' source. A cached agent
is used only while the stats (inode, size, mtime in ns) of all these files are the
ones it was loaded from, so editing any of them, the script alone included, loads
the agent again on the next use: a worker never refuses a run for its own stale copy.

A tool module is the exception: Python cannot re-import a module safely (other code
holds references to its functions), so a module whose source changed after this
process imported it makes :func:`check_tool_modules` raise ToolModuleChanged, which
says that the worker must be restarted.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import tomllib

from runtime.agent import Agent
from runtime.errors import ToolModuleChanged

FileStat = tuple[int, int, int] | None
"""(inode, size, mtime_ns) of a file, or None when it is missing."""
Version = tuple[tuple[str, FileStat], ...]

_first_seen: dict[str, tuple[str, FileStat]] = {}
"""module name -> (source path, stat) when this process first saw the module imported."""
_lock = threading.Lock()


def _stat(path: str) -> FileStat:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_ino, found.st_size, found.st_mtime_ns)


def _tool_modules(agent: Agent) -> list[str]:
    return sorted({ref.partition(":")[0] for ref in agent.spec.tools if ":" in ref})


def _module_source(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None) if module is not None else None
    return str(path) if path else None


def covered_files(agent: Agent) -> list[str]:
    """The files whose content decides the agent's binding (the agent file first)."""
    files = [str(agent.path)]
    if agent.spec.script is not None:
        files.append(str((agent.path.parent / agent.spec.script).resolve()))
    files.extend(p for p in (_module_source(m) for m in _tool_modules(agent)) if p)
    return files


def version_of(files: list[str]) -> Version:
    return tuple((path, _stat(path)) for path in files)


def note_tool_modules(agent: Agent) -> None:
    """Remember each tool module's source stat the first time this process sees it."""
    # A forked pool child inherits this: its modules are the ones its parent imported.
    with _lock:
        for name in _tool_modules(agent):
            path = _module_source(name)
            if path is not None and name not in _first_seen:
                _first_seen[name] = (path, _stat(path))


def check_tool_modules(names: list[str] | None = None) -> None:
    """ToolModuleChanged if a tool module (of ``names``, default all seen) changed on disk."""
    with _lock:
        seen = dict(_first_seen)
    for name in sorted(seen if names is None else set(names) & set(seen)):
        path, stat = seen[name]
        if _stat(path) != stat:
            worker = f"{socket.gethostname()} (pid {os.getpid()})"
            raise ToolModuleChanged(name, path, worker)


def tool_modules_of(agent: Agent) -> list[str]:
    return _tool_modules(agent)


def tool_modules_named_in(agent_file: str) -> list[str]:
    """The tool modules an agent file names, read raw (for a file that does not load)."""
    try:
        with open(agent_file, "rb") as handle:
            tools = tomllib.load(handle).get("tools", [])
    except (OSError, tomllib.TOMLDecodeError):
        return []
    if not isinstance(tools, list):
        return []
    return sorted({str(ref).partition(":")[0] for ref in tools if ":" in str(ref)})
