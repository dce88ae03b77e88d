"""What a task needs around the pure core: settings, the two stores and the limit store,
loaded agents, and the observers that watch its turns.

Opened lazily, once per process (after Celery's prefork pool has forked), and
reopened if the process id changes.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from runtime.actions import RequestOrder
from runtime.agent import Agent
from runtime.errors import AgentFileError
from runtime.models import Message, RunState
from runtime_io.agent_files import load_agent
from store import RunStore, SnapshotStore, open_limit_store, open_run_store, open_snapshot_store
from store.limits import LimitStore
from store.runs import RunRecord
from tasks import agent_cache, failpoints, liveness, tracing
from tasks.agent_cache import Version
from tasks.live import LiveWriter
from tasks.metrics import MetricsObserver
from tasks.observers import Observer, Observers
from tasks.pool import connections_per_process as connections
from tasks.settings import Settings, get_settings

T = TypeVar("T")


class TranscriptSize(NamedTuple):
    """The bytes the first ``messages`` messages of a run's transcript take in its snapshot."""

    messages: int
    bytes: int
    last: Message | None
    """The last of them: a transcript that does not hold it there is another one."""


SETTLED_NS = 2_000_000_000
"""A file last modified this long before a read began was not written during it (the
coarsest timestamps a file system keeps are 2 s apart)."""


@dataclass
class Overrides:
    """The run-time limits and caps (``ratchet limits set`` / ``cap``) as last read."""

    read_at: float = -1e9
    """time.monotonic() of the read."""
    limits: dict[str, dict[str, Any]] = field(default_factory=dict)
    caps: dict[str, int] = field(default_factory=dict)


@dataclass
class HeldOff:
    """Whether a 429 holds a limit key off, as last read or seen here."""

    read_at: float
    until: float
    """time.monotonic() until which a 429 holds the key off."""


@dataclass
class Limits:
    """A context's limit store (store/limits/) and what this process last read of it;
    tasks/limits.py reads through them, each at most every ``OVERRIDES_TTL_S``."""

    store: LimitStore
    overrides: Overrides = field(default_factory=Overrides)
    held_off: dict[str, HeldOff] = field(default_factory=dict)
    """By limit key."""


@dataclass
class Context:
    settings: Settings
    snapshots: SnapshotStore
    runs: RunStore
    _agents: dict[str, tuple[Version, Agent]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _checkpoints: OrderedDict[str, tuple[RunState, RunRecord | None]] = field(
        default_factory=OrderedDict
    )
    _request_orders: OrderedDict[str, RequestOrder] = field(default_factory=OrderedDict)
    _transcript_sizes: OrderedDict[str, TranscriptSize] = field(default_factory=OrderedDict)
    _agent_names: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _live: LiveWriter | None = None
    _limits: Limits | None = None
    observers: Observers = field(init=False)
    """What watches this context's turns (tasks/observers.py): :func:`observers_for`."""

    def __post_init__(self) -> None:
        self.observers = observers_for(self.settings, self.runs)

    CHECKPOINTS_KEPT = 256
    """Runs whose last checkpoint (and last request order) this process remembers (least
    recently used dropped)."""

    def remember_checkpoint(self, state: RunState, record: RunRecord | None = None) -> None:
        """Keep the state this process just saved as the run's snapshot, and ``record``, the
        run's record as written with it, if this process wrote that too."""
        _keep(self._lock, self._checkpoints, state.run_id, (state, record), self.CHECKPOINTS_KEPT)
        self.remember_agent(state)

    def remember_agent(self, state: RunState) -> None:
        """Keep the run's agent name: a turn that holds the run, whose checkpoints may
        not all be snapshots this process saved, labels the message that chains its next
        turn by it (worker/observe.py) without a read of the run store."""
        _keep(self._lock, self._agent_names, state.run_id, state.agent, self.CHECKPOINTS_KEPT)

    def last_checkpoint(self, run_id: str) -> tuple[RunState, RunRecord] | None:
        """The state this process last saved as the run's snapshot, with the record it wrote
        in the same step; None if it wrote no record with it, or remembers neither."""
        with self._lock:
            kept = self._checkpoints.get(run_id)
        if kept is None or kept[1] is None:
            return None
        return kept[0], kept[1]

    def remember_request_order(self, run_id: str, order: RequestOrder) -> None:
        """Keep the messages this process last sent the run's model, for its next call to
        extend (runtime.actions.extend_request_order checks that it does)."""
        _keep(self._lock, self._request_orders, run_id, order, self.CHECKPOINTS_KEPT)

    def request_order(self, run_id: str) -> RequestOrder | None:
        with self._lock:
            return self._request_orders.get(run_id)

    def remember_transcript_size(self, run_id: str, size: TranscriptSize) -> None:
        """Keep what the run's transcript takes in its snapshot, as far as it was measured
        (tasks/held_run.py ``snapshot_room``): a turn measures only the messages after it."""
        _keep(self._lock, self._transcript_sizes, run_id, size, self.CHECKPOINTS_KEPT)

    def transcript_size(self, run_id: str) -> TranscriptSize | None:
        with self._lock:
            return self._transcript_sizes.get(run_id)

    def recall_checkpoint(self, record: RunRecord) -> RunState | None:
        """The remembered snapshot of the run ``record`` shows, if the run is still exactly there.

        The event log is the truth: a state whose seq is the log's last seq is the fold
        of that log, whoever saved the snapshot, so reading the snapshot again would
        return the same state. But a run id names more than one run over time (a
        finished run may be purged and its id used again), so seq alone does not say
        it is the same log: the remembered state must produce exactly the stored
        record (creation time, input, agent, status, usage, …), else it is another
        run's past and is not used.
        """
        with self._lock:
            kept = self._checkpoints.get(record.run_id)
        state = None if kept is None else kept[0]
        if state is None or state.seq != record.last_seq:
            return None
        if state.created_at_ms != record.created_at_ms or (
            RunRecord.from_state(state, record.updated_at_ms, record.due_at_ms) != record
        ):
            return None
        return state

    def remembered_seq(self, run_id: str) -> int | None:
        """The seq of the run's state this process remembers (:meth:`recall_checkpoint`
        may serve it), if any: a turn that finds the log there need not read the snapshot."""
        with self._lock:
            kept = self._checkpoints.get(run_id)
        return None if kept is None else kept[0].seq

    def remembered_agent(self, run_id: str) -> str | None:
        """The agent name of the run this process remembers, if any (a label for the
        message that chains its next turn, without reading the run store)."""
        with self._lock:
            return self._agent_names.get(run_id)

    def forget_checkpoint(self, run_id: str) -> None:
        with self._lock:
            self._checkpoints.pop(run_id, None)
            self._request_orders.pop(run_id, None)
            self._transcript_sizes.pop(run_id, None)
            self._agent_names.pop(run_id, None)

    def agent(
        self,
        path: str | Path,
        while_loading: Callable[[], AbstractContextManager[object]] | None = None,
    ) -> Agent:
        """The agent at ``path``, loaded again when any file its binding covers changes.

        Covered: the agent file, its script and its tool modules' source
        (tasks/agent_cache.py). Raises ToolModuleChanged when a tool module changed on
        disk after this process imported it (only a restart loads it), else what
        load_agent raises. ``while_loading()`` is entered around a load (not around a
        cached lookup): a turn renews its lease there, since a first load imports tool
        modules and lists MCP servers' tools, which can take longer than a short lease.
        """
        # Looked up first by the path as given, whose version stats that path: a stat
        # follows every link on the way, so a file edited, replaced or re-linked there
        # changes it, and the path is not resolved again (most of a cached lookup's cost).
        given = os.fspath(path)
        with self._lock:
            cached = self._agents.get(given)
        if (
            cached is not None
            and cached[0] == agent_cache.version_of([f for f, _ in cached[0]])
            and _listing_fresh(cached[1], self.settings.mcp_relist_s)
        ):
            return cached[1]
        key = os.path.realpath(given)  # what str(Path(path).resolve()) gives, without the objects
        with self._lock:
            cached = self._agents.get(key)
        if (
            cached is not None
            and cached[0] == agent_cache.version_of([f for f, _ in cached[0]])
            and _listing_fresh(cached[1], self.settings.mcp_relist_s)
        ):
            self._keep_agent(given, cached[0], cached[1])
            return cached[1]
        files = [f for f, _ in cached[0]] if cached is not None else [key]
        for _ in range(3):
            before = agent_cache.version_of(files)
            started_ns = time.time_ns()
            try:
                with while_loading() if while_loading is not None else nullcontext():
                    agent = load_agent(key)
            except AgentFileError:
                # A stale module explains "has no function …" better than the file does.
                agent_cache.check_tool_modules(agent_cache.tool_modules_named_in(key))
                raise
            agent_cache.note_tool_modules(agent)
            agent_cache.check_tool_modules(agent_cache.tool_modules_of(agent))
            files = agent_cache.covered_files(agent)
            after = agent_cache.version_of(files)
            # Cached only if nothing it was read from changed while it was read: its
            # files' versions are those from before the read, or (the first time, when
            # only the agent file's was known) the agent file's is, and every other file
            # was last written well before the read began. Without that second case each
            # new agent file was read twice (a start of a run of a new agent: ~2 ms).
            if after == before or (
                after[:1] == before
                and all(
                    stat is not None and stat[2] < started_ns - SETTLED_NS for _, stat in after[1:]
                )
            ):
                with self._lock:
                    self._agents[key] = (after, agent)
                self._keep_agent(given, after, agent)
                break
        return agent

    def _keep_agent(self, given: str, version: Version, agent: Agent) -> None:
        """Cache ``agent`` under the path it was asked for too, its version stating that path
        in place of the resolved one (the same file, as a stat sees it)."""
        if version and version[0][0] != given:
            version = ((given, version[0][1]), *version[1:])
        with self._lock:
            self._agents[given] = (version, agent)

    def live(self) -> LiveWriter | None:
        """This process's writer to the runs' live streams (tasks/live.py); None when the
        run store keeps none."""
        with self._lock:
            if self._live is None:
                stream = self.runs.live()
                if stream is None:
                    return None
                settings = self.settings
                self._live = LiveWriter(
                    stream, settings.live_maxlen, settings.live_keep_s, self.observers
                )
            return self._live

    def limits(self) -> Limits:
        """This context's limit store, beside its run store (its Redis, a SQLite file beside
        it, or memory: store.open_limit_store), opened on first use, with its caches."""
        held = self._limits
        if held is None:
            with self._lock:
                if self._limits is None:
                    opened = open_limit_store(self.runs, self.settings.redis_prefix)
                    self._limits = Limits(opened)
                held = self._limits
        return held

    def use_limit_store(self, store: LimitStore) -> None:
        """Give this context ``store`` as its limit store, with empty caches (tests: one with
        a clock of their own)."""
        with self._lock:
            self._limits = Limits(store)

    def close(self) -> None:
        liveness.forget(self.runs)
        self.snapshots.close()
        self.runs.close()


def observers_for(settings: Settings, runs: RunStore) -> Observers:
    """The observers a context built now with ``settings`` carries, each only when switched
    on, in this order: failpoints (``RATCHET_FAILPOINT`` armed a point: read at import),
    metrics (``RATCHET_METRICS_PORT``: they count once ``worker_init`` enabled them), tracing
    (``RATCHET_OTEL_EXPORTER``, read now). None on: the empty list, which costs a turn
    nothing."""
    on: list[Observer] = []
    if failpoints.armed():
        on.append(failpoints.FailpointObserver())
    if settings.metrics_port is not None:
        on.append(MetricsObserver())
    if tracing.configured():
        on.append(tracing.TracingObserver(runs))
    return Observers(on)


def _keep(lock: threading.Lock, kept: OrderedDict[str, T], key: str, value: T, most: int) -> None:
    with lock:
        kept[key] = value
        kept.move_to_end(key)
        while len(kept) > most:
            kept.popitem(last=False)


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


def _listing_fresh(agent: Agent, relist_s: float) -> bool:
    """Whether a cached agent's MCP tool listing (if it has one) is recent enough to use."""
    listed = agent.listed_at_s
    return listed is None or time.monotonic() - listed < relist_s
