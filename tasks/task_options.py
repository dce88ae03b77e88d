"""The options ratchet's tasks run with: one table, read wherever they are set or checked.

Every ratchet task is acknowledged once it has run (``acks_late``), put back on its
queue when the process running it dies (``reject_on_worker_lost``: a turn of a
SIGKILLed pool child is delivered again, not acknowledged and lost), and keeps no
result (``ignore_result``: ratchet reads a run's fate from its stores, never from a
result backend). The broker's redelivery is only the fast path (CELERY-NOTES.md);
the lease and the seq make a duplicate a no-op. The time limit is the operator's
(``RATCHET_TURN_TIME_LIMIT_S``), below the broker's visibility timeout
(tasks/settings.py checks it).

A task of the control queue is also asked again while the run is busy or a store
briefly away (:data:`CONTROL_RETRIES`).

Who reads the table:

- :func:`tasks.task_base.ratchet_task` declares each task with :func:`declared`
  (and refuses a declaration that spells one of these options itself);
- ``worker/app.py`` sets :func:`app_defaults` as the defaults of ratchet's own app;
- :func:`tasks.install` annotates each ratchet task of an application's app with
  :func:`task_annotations`, so it runs as on ratchet's app whatever the app's defaults;
- tests/test_task_options.py checks every registered ``ratchet.*`` task of both apps
  against it, option by option.

What the table leaves out (``track_started``, ``acks_on_failure_or_timeout``,
``soft_time_limit``, rate limits, ...) is the app's choice: a ratchet task reads it
from the app's configuration, as any task does.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from runtime.errors import ClockSkewed, RunBusy, StoreUnavailable
from tasks.queues import CONTROL_QUEUE, ROUTES

EVERY_TASK: Final[Mapping[str, Any]] = MappingProxyType(
    {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}
)
"""What every ratchet task is declared with (see the module docstring)."""

TIME_LIMIT: Final = "time_limit"
"""The option that is the operator's, ``RATCHET_TURN_TIME_LIMIT_S``, not the table's."""

CONTROL_RETRIES: Final[Mapping[str, Any]] = MappingProxyType(
    {
        # A run busy with a turn, or a store briefly away: ask again, backing off up to 30 s.
        "autoretry_for": (RunBusy, StoreUnavailable, ClockSkewed),
        "retry_backoff": 1,
        "retry_backoff_max": 30,
        "max_retries": 20,
    }
)
"""What a task of the control queue is declared with besides :data:`EVERY_TASK`."""

TABLE_OPTIONS: Final = frozenset({*EVERY_TASK, *CONTROL_RETRIES, TIME_LIMIT})
"""The options only this module sets: a task's declaration never spells them."""


def declared(name: str) -> dict[str, Any]:
    """The options the ratchet task ``name`` is declared with, by the queue :data:`ROUTES`
    sends it to (KeyError for a name that is not ratchet's)."""
    if ROUTES[name] == CONTROL_QUEUE:
        return {**EVERY_TASK, **CONTROL_RETRIES}
    return dict(EVERY_TASK)


def task_annotations(time_limit_s: int) -> dict[str, Any]:
    """What an application's app annotates each ratchet task with (:func:`tasks.install`):
    the options ratchet's own app has as its defaults (:func:`app_defaults`)."""
    return {**EVERY_TASK, TIME_LIMIT: time_limit_s}


def app_defaults(time_limit_s: int) -> dict[str, Any]:
    """:func:`task_annotations` as the Celery settings (``task_acks_late``, ...) of ratchet's own
    app, where every task takes them."""
    return {f"task_{option}": value for option, value in task_annotations(time_limit_s).items()}
