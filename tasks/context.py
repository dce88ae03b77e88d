"""What a task needs around the pure core: settings, the two stores, loaded agents.

Opened lazily, once per process (after Celery's prefork pool has forked), and
reopened if the process id changes.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from runtime.agent import Agent, load_agent
from runtime.models import RunState
from store import RunStore, SnapshotStore, open_run_store, open_snapshot_store
from tasks.pool import connections_per_process as connections
from worker.settings import Settings, get_settings


@dataclass
class Context:
    settings: Settings
    snapshots: SnapshotStore
    runs: RunStore
    _agents: dict[str, tuple[tuple[int, int], Agent]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _checkpoints: OrderedDict[str, RunState] = field(default_factory=OrderedDict)

    CHECKPOINTS_KEPT = 256
    """Runs whose last checkpoint this process remembers (least recently used dropped)."""

    def remember_checkpoint(self, state: RunState) -> None:
        """Keep the state this process just saved as the run's snapshot."""
        with self._lock:
            self._checkpoints[state.run_id] = state
            self._checkpoints.move_to_end(state.run_id)
            while len(self._checkpoints) > self.CHECKPOINTS_KEPT:
                self._checkpoints.popitem(last=False)

    def recall_checkpoint(self, run_id: str, last_seq: int) -> RunState | None:
        """The remembered snapshot of ``run_id`` if the run is still exactly there.

        The event log is the truth: a state whose seq is the log's last seq is the fold
        of that log, whoever saved the snapshot, so reading the snapshot again would
        return the same state.
        """
        with self._lock:
            state = self._checkpoints.get(run_id)
        return state if state is not None and state.seq == last_seq else None

    def forget_checkpoint(self, run_id: str) -> None:
        with self._lock:
            self._checkpoints.pop(run_id, None)

    def agent(self, path: str | Path) -> Agent:
        """The agent at ``path``, reloaded when the file changes (a deploy may edit it)."""
        key = str(Path(path).resolve())
        stat = os.stat(key)
        version = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._agents.get(key)
            if cached is not None and cached[0] == version:
                return cached[1]
        agent = load_agent(key)
        with self._lock:
            self._agents[key] = (version, agent)
        return agent

    def close(self) -> None:
        self.snapshots.close()
        self.runs.close()


_context: Context | None = None
_context_pid: int | None = None
_context_lock = threading.Lock()


def get_context() -> Context:
    global _context, _context_pid
    with _context_lock:
        if _context is None or _context_pid != os.getpid():
            settings = get_settings()
            prefix, sized = settings.redis_prefix, connections()  # sized by tasks.pool
            _context = Context(
                settings=settings,
                snapshots=open_snapshot_store(
                    settings.resolved_snapshot_store, redis_prefix=prefix, max_connections=sized
                ),
                runs=open_run_store(
                    settings.resolved_run_store, redis_prefix=prefix, max_connections=sized
                ),
            )
            _context_pid = os.getpid()
        return _context


def set_context(context: Context | None) -> None:
    """Install a context for this process (tests use memory or per-test stores)."""
    global _context, _context_pid
    with _context_lock:
        _context, _context_pid = context, os.getpid() if context else None
