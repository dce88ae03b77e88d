"""Where the CLI, the console and the API send, and what they check before they do.

- **The team's app.** ``ratchet --app proj …`` (``-A proj``, or ``RATCHET_APP=proj``)
  loads the Celery app as ``celery -A proj`` does and sends everything through it: the
  broker, queues, routes and priority steps its workers read. The app must have ratchet
  installed (``tasks.install(app)``) and nothing ratchet cannot take (:mod:`tasks.delivery`).
- **Before anything is recorded** (a start, an answer), :func:`check_broker` refuses a
  send that can be known to go nowhere: the embedded ``filesystem://`` broker (what is
  used when ``RATCHET_BROKER_URL`` is not set) while the stores are remote, so the
  workers sharing them listen on another broker; and a broker that cannot take the
  next turn (down, or ``ratchet.turns`` declared there with other arguments). On
  RabbitMQ it also says, in one line, when no worker consumes ``ratchet.turns``.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

from kombu.common import maybe_declare
from kombu.exceptions import OperationalError

from runtime.errors import ConfigInvalid, RatchetError
from tasks.broker.pools import pools_made
from tasks.messages import send_through
from tasks.queues import AMQP_SCHEMES, TURNS_QUEUE, scheme_of
from tasks.settings import Settings

log = logging.getLogger("ratchet.senders")

REMOTE_STORES = ("redis", "rediss", "redis+sentinel", "redis+cluster", "rediss+cluster", "s3")
"""Store schemes other machines share: workers elsewhere read them."""


class BrokerUnready(RatchetError):
    """The broker cannot take the next turn; nothing was recorded."""

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"the broker cannot take a turn ({problem}); nothing was recorded: fix the broker "
            "or RATCHET_BROKER_URL / --app, and try again",
            problem,
        )
        self.problem = problem


def use_app(name: str) -> Any:
    """Load the Celery app ``name`` (as ``celery -A`` finds it) and send through it.

    ConfigInvalid, one line, when it cannot be loaded, has no ratchet installed, or has
    a setting ratchet cannot take.
    """
    from celery.app.utils import find_app

    from tasks.delivery import delivery_refusal
    from tasks.settings import get_settings

    try:
        app = find_app(name)
    except Exception as exc:  # find_app raises whatever the import raised
        raise ConfigInvalid(
            "RATCHET_APP",
            f"--app {name}: cannot load it ({type(exc).__name__}: {' '.join(str(exc).split())}); "
            "name your Celery app as for `celery -A` (a module on PYTHONPATH, or module:attr)",
        ) from None
    if not getattr(app, "conf", None) or not app.conf.get("ratchet_installed"):
        raise ConfigInvalid(
            "RATCHET_APP",
            f"--app {name}: app {getattr(app, 'main', name)!r} has no ratchet installed; "
            "call tasks.install(app) where the app is built",
        )
    refusal = delivery_refusal(app, get_settings())
    if refusal is not None:
        raise ConfigInvalid("RATCHET_APP", f"--app {name}: {refusal}")
    send_through(app)
    return app


def misdirected(settings: Settings, app: Any) -> str | None:
    """Why sending through ``app`` surely reaches no worker, cheaply known; or None."""
    broker = str(app.conf.broker_url or settings.resolved_broker_url)
    if settings.broker_url is not None or scheme_of(broker) != "filesystem":
        return None
    for variable, url in (
        ("RATCHET_RUN_STORE", settings.run_store),
        ("RATCHET_SNAPSHOT_STORE", settings.snapshot_store),
    ):
        if url and urlsplit(url).scheme in REMOTE_STORES:
            return (
                f"RATCHET_BROKER_URL is not set, so this would queue onto the embedded "
                f"filesystem:// broker under {settings.resolved_data_dir}, but {variable} is "
                f"{urlsplit(url).scheme}://: the workers sharing that store listen on another "
                "broker; set RATCHET_BROKER_URL to theirs, or pass --app (RATCHET_APP)"
            )
    return None


def check_broker(settings: Settings, app: Any) -> None:
    """Refuse (ConfigInvalid, BrokerUnready) a send that cannot reach a worker, before
    anything is recorded; log one WARNING when RabbitMQ says nobody consumes the turns."""
    refusal = misdirected(settings, app)
    if refusal is not None:
        raise ConfigInvalid("RATCHET_BROKER_URL", refusal)
    queue = app.amqp.queues[TURNS_QUEUE]
    # The app's own pooled connection: the send that follows reuses it, and a queue this
    # connection declared once is not declared again (kombu's maybe_declare), as Celery's.
    with pools_made(app).pool.acquire(block=True) as connection:
        try:
            connection.ensure_connection(max_retries=1)
            channel = connection.default_channel
            maybe_declare(queue, channel)  # type: ignore[no-untyped-call]
            consumers = None
            if scheme_of(str(app.conf.broker_url or "")) in AMQP_SCHEMES:
                consumers = channel.queue_declare(queue=queue.name, passive=True).consumer_count
        except (
            OperationalError,
            OSError,
            *connection.connection_errors,
            *connection.channel_errors,
        ) as exc:
            _close_quietly(connection)  # its channel may be closed: the next use reconnects
            raise BrokerUnready(f"{connection.as_uri()}: {' '.join(str(exc).split())}") from exc
        where = connection.as_uri()
    if consumers == 0:
        log.warning(
            "ratchet: no worker consumes %s on %s yet: what is sent waits there until one "
            "does (celery -A <your app> worker -Q ratchet.turns,ratchet.control)",
            queue.name,
            where,
        )


def _close_quietly(closable: Any) -> None:
    try:
        closable.close()
    except Exception:  # noqa: BLE001  (a channel the broker already closed)
        pass
