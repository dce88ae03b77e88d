"""What Flower, ``celery events``, the logs and a foreign client see of ratchet's tasks.

- **Readable tasks.** Every ``ratchet.*`` message is published with an
  ``argsrepr`` naming the agent, the run and the seq (``agent='refund-desk',
  run_id='…', seq=3``): Flower and ``celery events`` show that instead of a bare
  tuple. It is set in Celery's ``before_task_publish`` signal, so every producer
  (the API, a chained turn, the sweeper, the CLI) gets it.
- **Run ids in the logs.** Celery's own task lines (``Task ratchet.turn[…]
  received``, ``… succeeded in …``) get `` (run …)`` appended, and every log
  record carries a ``run_id`` attribute: the run of the ratchet task in progress.
  ``RATCHET_LOG_FORMAT=json`` makes a worker log one JSON object per line with a
  ``run_id`` field.
- **Quiet sweeps.** Celery logs two INFO lines per task, and beat one per send; for
  ``ratchet.sweep`` (every second) they are kept at DEBUG unless the sweep found something
  (:mod:`tasks.sweep_logs`; ``tasks.install`` does the same for a team's own app).
- **Told when a run stops.** With ``RATCHET_NOTIFY_TASK=name`` a worker sends
  that Celery task, kwargs ``run_id``, ``status``, ``output``, ``error``, to
  ``RATCHET_NOTIFY_QUEUE`` whenever a task of its leaves a run completed, failed,
  cancelled, suspended, parked, stalled or dead-lettered.
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    before_task_publish,
    task_postrun,
    task_prerun,
)

from tasks.messages import fields_of
from tasks.sweep_logs import quiet_sweeps

log = logging.getLogger("ratchet.observe")

SEQ_FIELD = {"ratchet.turn": "expected_seq", "ratchet.resume": "seen_seq", "ratchet.wake": "seq"}
"""The message field (tasks/messages.py) a task's label shows as ``seq``."""

STOPPED_OUTCOMES = frozenset(
    {"completed", "failed", "cancelled", "suspended", "parked", "stalled", "dead_lettered"}
)
"""Task results after which the run no longer moves by itself: worth telling a client."""

_current_run: ContextVar[str | None] = ContextVar("ratchet_run_id", default=None)
_agents: dict[str, str] = {}
_AGENTS_MAX = 10_000
_ARGS_RUN_ID = re.compile(r"run_id='([A-Za-z0-9_-]{1,64})'")


def _agent_of(task: str, run_id: str, fields: dict[str, Any]) -> str | None:
    """The run's agent name: from ``ratchet.start``'s agent file, else the run store (cached)."""
    if task == "ratchet.start":
        agent_file = fields.get("agent_file")
        return Path(str(agent_file)).stem if agent_file else None
    if run_id in _agents:
        return _agents[run_id]
    try:
        import tasks.context as context

        # Only a context this process already opened: a bare Celery client has none,
        # and a label is not worth opening stores (or creating ./.ratchet) for.
        ctx = context._context if context._context_pid == os.getpid() else None
        if ctx is None:
            return None
        # A turn chaining the next one has just checkpointed the run: no store read.
        agent = ctx.remembered_agent(run_id)
        if agent is None:
            record = ctx.runs.get(run_id)
            agent = record.agent if record is not None else None
    except Exception:  # noqa: BLE001 - a label is never worth failing a publish
        return None
    if agent is None:
        return None
    if len(_agents) >= _AGENTS_MAX:
        _agents.clear()
    _agents[run_id] = agent
    return agent


def describe(task: str, args: Any, kwargs: Any) -> str | None:
    """``agent='…', run_id='…', seq=N`` for a ratchet task's arguments; None for others."""
    fields = fields_of(task, args, kwargs)
    run_id = fields.get("run_id")
    if not isinstance(run_id, str):
        return None
    parts = []
    agent = _agent_of(task, run_id, fields)
    if agent:
        parts.append(f"agent={agent!r}")
    parts.append(f"run_id={run_id!r}")
    seq = fields.get(SEQ_FIELD.get(task, ""))
    if isinstance(seq, int) and not isinstance(seq, bool):
        parts.append(f"seq={seq}")
    return ", ".join(parts)


@before_task_publish.connect
def _readable_arguments(
    sender: str | None = None, body: Any = None, headers: Any = None, **_: Any
) -> None:
    # Protocol 2: the body is (args, kwargs, embed) and Flower shows headers["argsrepr"].
    if not isinstance(headers, dict) or not isinstance(body, list | tuple) or len(body) < 2:
        return
    label = describe(str(sender), body[0], body[1])
    if label is not None:
        headers["argsrepr"] = label


# --- logs -------------------------------------------------------------------


def _run_id_of(record: logging.LogRecord) -> str | None:
    data = getattr(record, "data", None)
    if isinstance(data, dict) and str(data.get("name", "")).startswith("ratchet."):
        found = _ARGS_RUN_ID.search(str(data.get("args", "")))
        if found:
            return found[1]
    return _current_run.get()


class RunIdFilter(logging.Filter):
    """Give every record a ``run_id`` (or None); name the run in Celery's task lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "run_id"):
            run_id = _run_id_of(record)
            record.run_id = run_id
            data = getattr(record, "data", None)
            if run_id and isinstance(data, dict) and "id" in data:
                record.msg = f"{record.msg} (run {run_id})"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, process, message, run_id (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "process": record.processName,
            "message": record.getMessage(),
            "run_id": getattr(record, "run_id", None) or _run_id_of(record),
        }
        data = getattr(record, "data", None)
        if isinstance(data, dict) and "id" in data:
            document["task_id"] = str(data["id"])
            document["task"] = str(data.get("name"))
        if record.exc_info:
            document["exc"] = self.formatException(record.exc_info)
        return json.dumps(document, ensure_ascii=False)


quiet_sweeps()


def configure_handlers(logger: logging.Logger, json_logs: bool) -> None:
    """Add the run-id filter (and the JSON formatter) to every handler of ``logger``."""
    for handler in logger.handlers:
        if not any(isinstance(f, RunIdFilter) for f in handler.filters):
            handler.addFilter(RunIdFilter())
        if json_logs:
            handler.setFormatter(JsonFormatter())


@after_setup_logger.connect
@after_setup_task_logger.connect
def _on_logging_setup(logger: logging.Logger | None = None, **_: Any) -> None:
    from tasks.settings import get_settings

    if logger is not None:
        configure_handlers(logger, get_settings().log_format == "json")


# --- the run in progress, and telling a client it stopped --------------------


def _task_run_id(task: Any, args: Any, kwargs: Any) -> str | None:
    run_id = fields_of(str(getattr(task, "name", "")), args, kwargs).get("run_id")
    return run_id if isinstance(run_id, str) else None


@task_prerun.connect
def _enter_run(task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    _current_run.set(_task_run_id(task, args, kwargs))


@task_postrun.connect
def _leave_run(
    task: Any = None, args: Any = None, kwargs: Any = None, retval: Any = None, **_: Any
) -> None:
    try:
        run_id = _task_run_id(task, args, kwargs)
        if run_id is not None and retval in STOPPED_OUTCOMES:
            _notify(task.app, run_id)
    except Exception:  # noqa: BLE001 - a notification never fails the task
        log.exception("run %s: could not send the notification task", _current_run.get())
    finally:
        _current_run.set(None)


def _notify(app: Any, run_id: str) -> None:
    from tasks.context import get_context

    ctx = get_context()
    name = ctx.settings.notify_task
    if not name:
        return
    record = ctx.runs.get(run_id)
    if record is None or record.status.is_live:
        return
    app.send_task(
        name,
        kwargs={
            "run_id": run_id,
            "status": record.status.value,
            "output": record.output,
            "error": record.error,
        },
        queue=ctx.settings.notify_queue,
    )
    log.info(
        "run %s: %s; sent %s to %s", run_id, record.status.value, name, ctx.settings.notify_queue
    )
