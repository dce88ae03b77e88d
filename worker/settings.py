"""Settings, from the environment (prefix ``RATCHET_``), in one place.

Every setting and its default is documented in the README's settings table.
With nothing set, everything lives under ``RATCHET_DATA_DIR`` (``./.ratchet``):
a ``filesystem://`` broker, a file snapshot store and a SQLite run store, so
a worker and the CLI in two terminals share one machine's state with no server.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RATCHET_", extra="ignore")

    data_dir: Path = Path(".ratchet")
    """Where the embedded default keeps its broker folders, snapshots and run database."""
    broker_url: str | None = None
    """Celery broker; default `filesystem://` under the data dir. E.g. redis://127.0.0.1:6379/0."""
    snapshot_store: str | None = None
    """memory://, file:///dir, redis://… or s3://bucket/prefix; default file://<data_dir>/snapshots."""
    run_store: str | None = None
    """memory://, sqlite:///path or redis://…; default sqlite://<data_dir>/runs.sqlite3."""
    redis_prefix: str = Field(default="ratchet", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    """First part of every key the Redis stores write; deployments sharing a server differ here."""
    lease_s: float = Field(default=10.0, gt=0)
    """How long a worker's claim on a run lasts without a heartbeat."""
    visibility_timeout_s: int = Field(default=3600, gt=0)
    """Redis broker only: must exceed the longest turn, or Celery delivers a turn twice."""
    filesystem_polling_interval_s: float = Field(default=0.01, gt=0)
    """filesystem:// broker only: how often a worker looks for new messages."""
    continuations_queue: str = Field(default="ratchet.continuations", min_length=1)
    """Queue of plain-JSON continuation messages from non-Celery producers (same broker)."""
    turn_time_limit_s: int = Field(default=1800, gt=0)
    """Celery's hard time limit for one turn task; must stay below `visibility_timeout_s`."""
    sweep_interval_s: float = Field(default=2.0, gt=0)
    """How often the crash sweeper (`celery -A worker beat`, `ratchet sweep`) looks for orphans."""
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
    task_events: bool = True
    """Workers send Celery task events (Flower, `celery events`); 0 turns them off."""
    log_format: Literal["text", "json"] = "text"
    """`json`: a worker logs one JSON object per line, with a `run_id` field."""
    allow_unpinned_continuations: bool = False
    """Accept answers that name neither a continuation_id nor a suspension_seq (unsafe)."""
    notify_task: str | None = None
    """A Celery task name a worker sends (run_id, status) to when a run stops (ends, suspends, parks)."""
    notify_queue: str = "celery"
    """The queue `notify_task` is sent to."""

    @model_validator(mode="after")
    def _turn_fits_in_visibility_timeout(self) -> Settings:
        # A turn that outlives the Redis visibility timeout is delivered again while it
        # still runs (CELERY-NOTES): the time limit must end it first.
        if self.turn_time_limit_s >= self.visibility_timeout_s:
            raise ValueError(
                f"RATCHET_TURN_TIME_LIMIT_S ({self.turn_time_limit_s}) must be below "
                f"RATCHET_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}), or the broker "
                "delivers a long turn a second time while it still runs; lower the one or "
                "raise the other"
            )
        return self

    @property
    def resolved_data_dir(self) -> Path:
        return self.data_dir.expanduser().resolve()

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or "filesystem://localhost//"

    @property
    def resolved_snapshot_store(self) -> str:
        return self.snapshot_store or f"file://{self.resolved_data_dir / 'snapshots'}"

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


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
