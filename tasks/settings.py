"""Settings, from the environment (prefix ``RATCHET_``), in one place.

Every setting and its default is documented in the README's settings table.
With nothing set, everything lives under ``RATCHET_DATA_DIR`` (``./.ratchet``):
a ``filesystem://`` broker and a SQLite run store that holds the snapshots too, so
a worker and the CLI in two terminals share one machine's state with no server.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.children import (
    DEFAULT_MAX_CHILD_DEPTH,
    DEFAULT_MAX_TREE_RUNS,
    MAX_CHILD_DEPTH,
    MAX_TREE_RUNS,
)
from runtime.errors import ConfigInvalid
from runtime.numbers import Finite
from store.cluster_url import SCHEMES as CLUSTER_SCHEMES
from store.cluster_url import ClusterUrl
from store.live import DEFAULT_KEEP_S, DEFAULT_MAXLEN
from store.private import private_dir, writable_by_others
from store.replicas import split_replica_wait
from store.sentinel import SentinelUrl

ENV_PREFIX = "RATCHET_"
EXIT_CONFIG_INVALID = 2
QueueType = Literal["classic", "quorum"]
"""How ratchet's RabbitMQ queues are declared (``RATCHET_TASK_DEFAULT_QUEUE_TYPE``)."""
"""Exit status of every command (``ratchet …``, ``celery -A worker …``) refused for a bad setting."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RATCHET_", extra="ignore")

    data_dir: Path = Path(".ratchet")
    """Where the embedded default keeps its broker folders, snapshots and run database."""
    broker_url: str | None = None
    """Celery broker; default `filesystem://` under the data dir. E.g. redis://127.0.0.1:6379/0."""
    snapshot_store: str | None = None
    """memory://, file:///dir, sqlite:///path, redis://… or s3://bucket/prefix; default: the
    SQLite run store's database when the run store is one, else file://<data_dir>/snapshots."""
    run_store: str | None = None
    """memory://, sqlite:///path or redis://…; default sqlite://<data_dir>/runs.sqlite3."""
    redis_prefix: str = Field(default="ratchet", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    """First part of every key the Redis stores write; deployments sharing a server differ here."""
    lease_s: Finite = Field(default=10.0, gt=0)
    """How long a worker's claim on a run lasts without a heartbeat."""
    visibility_timeout_s: int = Field(default=3600, gt=0)
    """Redis broker only: must exceed the longest turn, or Celery delivers a turn twice."""
    filesystem_polling_interval_s: Finite = Field(default=0.01, gt=0)
    """filesystem:// broker only: how often a worker looks for new messages."""
    continuations_queue: str = Field(default="ratchet.continuations", min_length=1)
    """Queue of plain-JSON continuation messages from non-Celery producers (same broker)."""
    turn_time_limit_s: int = Field(default=1500, gt=0)
    """Celery's hard time limit for one turn task; must stay below `visibility_timeout_s` (and,
    on RabbitMQ, `amqp_consumer_timeout_s`)."""
    task_default_queue_type: QueueType = "classic"
    """RabbitMQ only (Celery's `task_default_queue_type`): `quorum` declares ratchet's queues as
    replicated quorum queues, without message priorities on RabbitMQ 3.x (docs/broker.md)."""
    amqp_consumer_timeout_s: int = Field(default=1800, gt=0)
    """RabbitMQ only: the server's `consumer_timeout` (rabbitmq.conf; its default is 30 min).
    A delivery unacknowledged this long closes the worker's channel: every turn and every
    wake-up a worker holds must fit in it."""
    sweep_interval_s: Finite = Field(default=1.0, gt=0)
    """How often the crash sweeper (`celery -A worker beat`, `ratchet sweep`) looks for orphans."""
    liveness_s: Finite = Field(default=3.0, gt=0)
    """A worker process not heard from for this long is dead: its runs are taken at once."""
    heartbeat_interval_s: Finite = Field(default=0.5, gt=0)
    """How often each worker process renews its liveness (a thread of its own)."""
    max_clock_skew_s: Finite = Field(default=60.0, gt=0)
    """A worker whose clock is further than this from the run store's refuses to start and,
    found on a liveness round, takes no lease until they agree (docs/recovery.md)."""
    max_recovery_attempts: int = Field(default=5, ge=1)
    """Sweeper resumes in a row without progress before a run is dead-lettered."""
    retention_s: int = Field(default=604_800, gt=0)
    """How long a finished run's record and events are kept after it finished (default 7 days)."""
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """A worker serves Prometheus metrics on this port when set (needs `ratchet[metrics]`)."""
    agents: str = ""
    """Comma-separated agent files the worker checks at start (longest turn vs the broker)."""
    metrics_address: str = Field(default="127.0.0.1", min_length=1)
    """Address the metrics server binds; `0.0.0.0` (or `::`) exposes it on every interface."""
    allow_volatile_store: bool = False
    """Start although a Redis store keeps nothing durable (no AOF): a restart then rolls it back."""
    # --- observability and answers (issue 10: items 11, 15, 16) ---
    task_events: Literal["auto"] | bool = "auto"
    """Workers send Celery task events (Flower, `celery events`): 1 on, 0 off, `auto` (the
    default) off on a Redis broker, where they cost a turn most, and on elsewhere."""
    log_format: Literal["text", "json"] = "text"
    """`json`: a worker logs one JSON object per line, with a `run_id` field."""
    allow_unpinned_continuations: bool = False
    """Accept answers that name neither a continuation_id nor a suspension_seq (unsafe)."""
    mcp_relist_s: float = Field(default=10.0, ge=0, le=86_400, allow_inf_nan=False)
    """How long a process uses an agent's MCP tool listing before asking the servers again."""
    notify_task: str | None = None
    """A Celery task name a worker sends (run_id, status) to when a run stops (ends, suspends, parks)."""
    notify_queue: str = "celery"
    """The queue `notify_task` is sent to."""
    broker_start_retries: int = Field(default=10, ge=0, le=1000)
    """A worker starting tries the broker this many more times (about 1-5 s apart), then refuses."""
    max_child_depth: int = Field(default=DEFAULT_MAX_CHILD_DEPTH, ge=0, le=MAX_CHILD_DEPTH)
    """How deep a run tree may grow (root 0) when its root's agent file sets no `max_child_depth`."""
    max_tree_runs: int = Field(default=DEFAULT_MAX_TREE_RUNS, ge=1, le=MAX_TREE_RUNS)
    """The most runs a run tree may hold when its root's agent file sets no `max_tree_runs`."""
    live_maxlen: int = Field(default=DEFAULT_MAXLEN, ge=1, le=1_000_000)
    """Entries a run's live stream keeps (model deltas, tool progress): the newest ones."""
    live_keep_s: Finite = Field(default=DEFAULT_KEEP_S, gt=0, le=30 * 86_400)
    """How long a run's live stream outlives its last write (so, the run's end)."""

    @model_validator(mode="after")
    def _turn_fits_in_visibility_timeout(self) -> Settings:
        # A turn that outlives the Redis visibility timeout is delivered again while it
        # still runs (kombu's Redis transport restores unacked messages past it): the
        # time limit must end it first.
        if self.turn_time_limit_s >= self.visibility_timeout_s:
            raise ValueError(
                f"RATCHET_TURN_TIME_LIMIT_S ({self.turn_time_limit_s}) must be below "
                f"RATCHET_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}), or the broker "
                "delivers a long turn a second time while it still runs; lower the one or "
                "raise the other"
            )
        return self

    @model_validator(mode="after")
    def _quorum_queues_are_rabbitmqs(self) -> Settings:
        # Only RabbitMQ replicates a queue; kombu's other transports ignore the argument,
        # and an operator would believe the queues survive a node they do not.
        scheme = self.resolved_broker_url.split("://", 1)[0].split("+", 1)[0]
        if self.task_default_queue_type == "quorum" and scheme not in ("amqp", "amqps", "pyamqp"):
            raise ValueError(
                "RATCHET_TASK_DEFAULT_QUEUE_TYPE=quorum is a RabbitMQ queue type, and "
                f"RATCHET_BROKER_URL is a {scheme}:// broker; point RATCHET_BROKER_URL at "
                "RabbitMQ (amqp://…), or unset RATCHET_TASK_DEFAULT_QUEUE_TYPE"
            )
        return self

    @model_validator(mode="after")
    def _liveness_outlasts_its_heartbeat(self) -> Settings:
        # Two beats must fit in a liveness period, or one late beat declares a live
        # process dead (a liveness longer than the lease is harmless: the lease ends first).
        if self.liveness_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"RATCHET_LIVENESS_S ({self.liveness_s:g}) must be at least twice "
                f"RATCHET_HEARTBEAT_INTERVAL_S ({self.heartbeat_interval_s:g}): a process "
                "that stalls longer than the liveness minus one heartbeat is declared dead; "
                "raise the one or lower the other"
            )
        return self

    @property
    def redelivery_horizon_s(self) -> float | None:
        """How long the broker lets a worker hold a message unacknowledged before it gives it
        to another (Redis: the visibility timeout; RabbitMQ: the consumer timeout, which
        closes the channel); None for a broker that never does (``filesystem://``)."""
        scheme = self.resolved_broker_url.split("://", 1)[0].split("+", 1)[0]
        if scheme in ("redis", "rediss", "sentinel"):
            return float(self.visibility_timeout_s)
        if scheme in ("amqp", "amqps", "pyamqp"):
            return float(self.amqp_consumer_timeout_s)
        return None

    @property
    def resolved_data_dir(self) -> Path:
        return self.data_dir.expanduser().resolve()

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or "filesystem://localhost//"

    @property
    def resolved_snapshot_store(self) -> str:
        if self.snapshot_store:
            return self.snapshot_store
        # Beside a SQLite run store, in its database: a checkpoint is then one transaction.
        if urlsplit(self.resolved_run_store).scheme == "sqlite":
            return self.resolved_run_store
        return f"file://{self.resolved_data_dir / 'snapshots'}"

    @property
    def resolved_run_store(self) -> str:
        return self.run_store or f"sqlite://{self.resolved_data_dir / 'runs.sqlite3'}"

    @property
    def agent_files(self) -> list[Path]:
        return [Path(part.strip()) for part in self.agents.split(",") if part.strip()]

    @property
    def broker_folders(self) -> dict[str, Path]:
        base = self.resolved_data_dir / "broker"
        return {"queue": base / "queue", "control": base / "control"}


def masked(url: str) -> str:
    """``url`` without its password (``user:***@host``), fit for a message or a log line."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}" if ":" in userinfo else netloc
    # password=, and sentinel_password= of a redis+sentinel:// URL.
    query = "&".join(q for q in parts.query.split("&") if "password=" not in q)
    rest = f"{parts.path}" + (f"?{query}" if query else "")
    return f"{parts.scheme}://{netloc}{rest}" if "://" in url else url


# Shown with a refused value: what an accepted one looks like.
_FIXES = {
    "redis_prefix": "use 1-64 letters, digits or `_ . : -`, e.g. RATCHET_REDIS_PREFIX=ratchet",
    "metrics_port": "use a TCP port from 1 to 65535, e.g. RATCHET_METRICS_PORT=9808",
}
_URL_FIELDS = ("broker_url", "snapshot_store", "run_store")
SNAPSHOT_STORE_SCHEMES = (
    "memory", "file", "sqlite", "redis", "rediss", "unix", "redis+sentinel", "redis+cluster",
    "rediss+cluster", "s3",
)  # fmt: skip
RUN_STORE_SCHEMES = (
    "memory", "sqlite", "redis", "rediss", "unix", "redis+sentinel", "redis+cluster",
    "rediss+cluster",
)  # fmt: skip
# kombu transports whose dependencies come with an extra of kombu's.
_TRANSPORT_EXTRAS = {"redis": "redis", "rediss": "redis", "sentinel": "redis"}


def _shown(field: str, value: Any) -> str:
    text = str(value)
    return masked(text) if field in _URL_FIELDS else text


def _validation_error(exc: ValidationError) -> ConfigInvalid:
    error = exc.errors(include_url=False)[0]
    if not error["loc"]:
        # A check across fields (model validator): its message names the variables.
        message = str(error["msg"]).removeprefix("Value error, ")
        variable = message.split(" ", 1)[0] if message.startswith(ENV_PREFIX) else ENV_PREFIX
        return ConfigInvalid(variable, f"{message}")
    field = str(error["loc"][0])
    variable = ENV_PREFIX + field.upper()
    default = Settings.model_fields[field].default if field in Settings.model_fields else None
    problem = str(error["msg"])
    problem = problem[:1].lower() + problem[1:]
    fix = _FIXES.get(field) or (
        f"set a valid value, or unset it for the default ({default})"
        if default is not None
        else "set a valid value, or unset it"
    )
    return ConfigInvalid(
        variable, f"{variable}={_shown(field, error.get('input'))} is refused: {problem}; {fix}"
    )


def _check_broker(settings: Settings) -> None:
    url = settings.resolved_broker_url
    variable = "RATCHET_BROKER_URL"
    scheme = url.split("://", 1)[0] if "://" in url else ""
    base = scheme.split("+", 1)[0]
    from kombu.transport import TRANSPORT_ALIASES, resolve_transport

    if base not in TRANSPORT_ALIASES:
        raise ConfigInvalid(
            variable,
            f"{variable}={masked(url)} is not a broker URL Celery knows; use "
            "redis://host:6379/0, amqp://user:password@host:5672/vhost, or unset it for the "
            "embedded filesystem broker",
        )
    if scheme in CLUSTER_SCHEMES:
        raise ConfigInvalid(
            variable,
            f"{variable}={masked(url)}: a Redis Cluster cannot be the broker (kombu has no "
            "Redis Cluster transport); keep the stores on the cluster and give the broker a "
            "Redis of its own (redis://host:6379/0) or RabbitMQ (amqp://…)",
        )
    if base == "sentinel":
        raise ConfigInvalid(
            variable,
            f"{variable}={masked(url)}: kombu's sentinel:// form cannot name the service the "
            "sentinels monitor; write it as redis+sentinel://host:port,host:port/service/db",
        )
    if scheme == "redis+sentinel":
        try:
            SentinelUrl.parse(url)
        except ValueError as exc:
            raise ConfigInvalid(variable, f"{variable}={masked(url)}: {exc}") from None
    try:
        resolve_transport(base)
    except ImportError as exc:
        extra = _TRANSPORT_EXTRAS.get(base)
        install = f"pip install 'kombu[{extra}]'" if extra else "install what it names"
        raise ConfigInvalid(
            variable,
            f"{variable}={masked(url)}: kombu's {base} transport cannot be imported ({exc}); "
            f"{install}",
        ) from None


def _check_store(variable: str, url: str, schemes: tuple[str, ...]) -> None:
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme not in schemes:
        accepted = ", ".join(f"{s}://" for s in schemes)
        raise ConfigInvalid(
            variable,
            f"{variable}={masked(url)} is not a store URL ratchet opens; use one of {accepted} "
            "(README, Settings), or unset it for the default under RATCHET_DATA_DIR",
        )
    if scheme in CLUSTER_SCHEMES:
        try:
            # min_replicas and replica_timeout_ms are ratchet's (store/replicas.py), checked
            # there; the rest is the cluster's
            ClusterUrl.parse(split_replica_wait(url)[0])
        except ValueError as exc:
            raise ConfigInvalid(variable, f"{variable}={masked(url)}: {exc}") from None
    if scheme == "s3" and importlib.util.find_spec("boto3") is None:
        raise ConfigInvalid(
            variable,
            f"{variable}={masked(url)} needs boto3, which is not installed; "
            "pip install 'ratchet[s3]'",
        )


def _uses_data_dir(settings: Settings) -> bool:
    return (
        settings.resolved_broker_url.startswith("filesystem")
        or settings.snapshot_store is None
        or settings.run_store is None
    )


def _check_data_dir(settings: Settings) -> None:
    path = settings.resolved_data_dir
    if writable_by_others(path):
        # Another user could have put files there already (messages, links, a database).
        raise ConfigInvalid(
            "RATCHET_DATA_DIR",
            f"RATCHET_DATA_DIR={settings.data_dir}: {path} can be written by other users "
            f"(mode {path.stat().st_mode & 0o777:o}), who could plant messages or runs in it; "
            f"`chmod 700 {path}` (ratchet makes its data dir 0700), or point it elsewhere",
        )
    try:
        private_dir(path)
        writable = os.access(path, os.W_OK | os.X_OK)
    except OSError as exc:
        problem = exc.strerror or type(exc).__name__
    else:
        if writable:
            return
        problem = "not writable by this user"
    raise ConfigInvalid(
        "RATCHET_DATA_DIR",
        f"RATCHET_DATA_DIR={settings.data_dir}: cannot use {path} ({problem}); point it at a "
        "directory this user can create and write",
    )


def load_settings() -> Settings:
    """The settings from the environment, checked.

    Raises ConfigInvalid, one line naming the variable, what is wrong and the fix, for a
    value pydantic refuses, a broker URL kombu cannot use (or whose transport's
    dependencies are missing), a store URL no backend opens (or whose extra is missing),
    and a data dir that cannot be created or written while something uses it.
    """
    try:
        settings = Settings()
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _check_broker(settings)
    _check_store("RATCHET_SNAPSHOT_STORE", settings.resolved_snapshot_store, SNAPSHOT_STORE_SCHEMES)
    _check_store("RATCHET_RUN_STORE", settings.resolved_run_store, RUN_STORE_SCHEMES)
    if _uses_data_dir(settings):
        _check_data_dir(settings)
    return settings


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings (checked once; ConfigInvalid, see :func:`load_settings`)."""
    return load_settings()
