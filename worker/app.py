"""The Celery app: ``celery -A worker worker`` and ``celery -A worker beat``.

JSON only (a pickle message is refused), explicit ``ratchet.*`` task names,
tasks with ``acks_late`` + ``reject_on_worker_lost`` (the table of
:mod:`tasks.task_options`) + prefetch 1, and a separate ``ratchet.control``
queue so continuations, cancels and sweeps never wait behind long turns. The broker's redelivery is only a fast path: ratchet's
own leases, fencing and sweeper are what make a run survive a crash
(docs/recovery.md).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler

from runtime.errors import ConfigInvalid
from store.private import private_dir, private_files
from store.rejected import rejected_folder
from store.sentinel import SentinelUrl, is_sentinel
from tasks.delivery import MAX_PRIORITY, delivery_settings
from tasks.messages import send_through
from tasks.queues import AMQP_SCHEMES, CONTROL_QUEUE, TURNS_QUEUE, beat_schedule, scheme_of
from tasks.settings import EXIT_CONFIG_INVALID, Settings, get_settings
from tasks.task_options import app_defaults
from worker.startup import on_a_command_line

__all__ = ["CONTROL_QUEUE", "TURNS_QUEUE", "app", "celery_config", "make_app"]


def celery_config(settings: Settings) -> dict[str, Any]:
    broker_url = settings.resolved_broker_url
    transport_options: dict[str, Any] = {}
    if broker_url.startswith("filesystem"):
        folders = settings.broker_folders
        for folder in folders.values():
            try:
                private_dir(folder)
            except OSError as exc:
                raise ConfigInvalid(
                    "RATCHET_DATA_DIR",
                    f"RATCHET_DATA_DIR={settings.data_dir}: cannot create the broker folder "
                    f"{folder} ({exc.strerror}); point it at a directory this user can write",
                ) from None
        transport_options = {
            # One folder for in and out: producer and worker processes share it.
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "control_folder": str(folders["control"]),
            "polling_interval": settings.filesystem_polling_interval_s,
            # The broker channels set refused messages aside here (tasks/broker/entries.py).
            "rejected_folder": str(rejected_folder(settings.resolved_data_dir)),
        }
    # What decides where messages go and how they are read: the table a team's app gets
    # from tasks.install too (tasks/delivery.py).
    delivery = delivery_settings(broker_url, settings)
    transport_options.update(delivery.pop("broker_transport_options"))
    if is_sentinel(broker_url):
        # kombu reads Sentinel as its own URL form plus the service's name in an option.
        broker_url, sentinel_options = SentinelUrl.parse(broker_url).kombu()
        transport_options.update(sentinel_options)
    config = {
        "broker_url": broker_url,
        "worker_consumer": "tasks.broker.consumer:RatchetConsumer",
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        # A starting worker has already tried the broker a bounded number of times
        # (worker.checks, RATCHET_BROKER_START_RETRIES) before Celery connects.
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "result_accept_content": ["json"],
        "result_backend": None,
        # One (disabled) result backend per app, not one per thread: Celery makes a backend
        # for every thread that first asks, and under gevent each task is a new greenlet,
        # so without it every turn built one (~3% of a gevent worker's CPU).
        "result_backend_thread_safe": True,
        # acks_late, reject_on_worker_lost, ignore_result and the time limit for every
        # task: the table of tasks/task_options.py.
        **app_defaults(settings.turn_time_limit_s),
        "worker_hijack_root_logger": False,
        "task_default_queue": TURNS_QUEUE,
        # `celery -A worker beat` sends the crash sweeper.
        "beat_schedule": beat_schedule(settings.sweep_interval_s),
        # Beat's schedule files (celerybeat-schedule.*) live with the rest of ratchet's state.
        "beat_schedule_filename": str(settings.resolved_data_dir / "celerybeat-schedule"),
        "beat_scheduler": "worker.app:Scheduler",
        "imports": ("tasks",),
        # Task events per RATCHET_TASK_EVENTS (auto: off on Redis; in the table,
        # tasks.delivery.task_events_on); worker.observe gives the tasks readable arguments
        # and names runs.
        **delivery,
    }
    if scheme_of(broker_url) in AMQP_SCHEMES and settings.task_default_queue_type == "quorum":
        # Every other queue this app declares (RATCHET_NOTIFY_QUEUE's, one made by `-Q`)
        # a quorum queue too; Celery's pidbox and event queues (exclusive, auto-delete)
        # cannot be, and stay classic.
        config["task_default_queue_type"] = "quorum"
        config["task_create_missing_queue_type"] = "quorum"
    elif scheme_of(broker_url) in AMQP_SCHEMES:
        # Every other queue this app declares (RATCHET_NOTIFY_QUEUE's, one made by `-Q`)
        # with priorities too, as earlier releases declared them: RabbitMQ refuses a
        # second declaration of a queue with other arguments.
        config["task_queue_max_priority"] = MAX_PRIORITY
    return config


def make_app(settings: Settings | None = None, *, set_as_current: bool = False) -> Celery:
    """A ratchet Celery app built from ``settings`` (the environment's when None).

    ratchet's tasks are registered on it when it is finalised (they are shared tasks:
    :func:`tasks.task_base.ratchet_task`). It does not become the current app unless
    asked: a second app built in a test or a bench (to send to another broker, to
    start a worker) does not take over what the module's :data:`app` sends.
    """
    import tasks.metrics  # noqa: F401  (worker_init: Prometheus, if RATCHET_METRICS_PORT)
    import worker.checks  # noqa: F401  (worker_init: the broker check, first)
    import worker.observe  # noqa: F401  (argsrepr, run ids in the logs, notifications)
    from tasks import failpoints
    from tasks.broker.compression import bound_decompression
    from tasks.continuations import ContinuationConsumer

    failpoints.check()
    # No message body inflates past 4 MiB in the consumer loop (kombu's registry is global).
    bound_decompression()
    # RatchetAMQP picks tasks.broker.transport's kombu transports for redis:// and filesystem://
    # URLs (they survive a bad queue entry); other brokers keep kombu's own.
    app = Celery(
        "ratchet",
        amqp="tasks.broker.transport:RatchetAMQP",
        events="tasks.broker.transport:RatchetEvents",
        task_cls="tasks.task_base:RatchetTask",
        set_as_current=set_as_current,
    )
    app.conf.update(celery_config(settings or get_settings()))
    app.steps["consumer"].add(ContinuationConsumer)
    return app


def _app_or_exit() -> Celery:
    """The app; on a command line a bad setting is one line on stderr and exit status 2.

    The app is built at import (``celery -A worker`` imports it), before Celery or the CLI
    has an error handler; an application importing ratchet gets ConfigInvalid instead.
    """
    try:
        app = make_app(set_as_current=True)
    except ConfigInvalid as exc:
        if not on_a_command_line():
            raise
        print(f"ratchet: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_INVALID) from None
    # What ratchet sends outside a task goes through this app (the API's, the CLI's, the
    # console's request threads), unless the application installed ratchet on its own.
    send_through(app, unless_set=True)
    return app


class Scheduler(PersistentScheduler):  # type: ignore[misc]  # celery is untyped
    """Celery's persistent beat scheduler, its schedule file under the data dir.

    The folder is made before the file is opened (nothing else may have made the data
    dir when every store is remote); when it cannot be, one line and exit status 2.
    """

    def setup_schedule(self) -> None:
        folder = Path(self.schedule_filename).parent
        try:
            private_dir(folder, tighten=False)
        except OSError as exc:
            print(
                f"ratchet: refusing to start beat: cannot create {folder} for its schedule "
                f"file ({exc.strerror}); set RATCHET_DATA_DIR to a directory this user can write",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(EXIT_CONFIG_INVALID) from None
        super().setup_schedule()
        # The schedule is a dbm file (one or several, by the dbm module) made with the umask.
        private_files(*folder.glob(Path(self.schedule_filename).name + "*"))


app = _app_or_exit()
