# mypy: disable-error-code="no-untyped-call,override,misc,attr-defined"
# (kombu's transports are untyped, and the mixins below use its channel attributes.)
"""Kombu transports that survive what lands on a queue: ``ratchet-redis``, ``ratchet-filesystem``.

Kombu's Redis and filesystem transports parse each queue entry (a JSON
envelope: ``body``, ``headers``, ``properties``…) inside the worker's consumer
loop, before Celery or ratchet sees it; one entry that is not an envelope
(``redis-cli LPUSH ratchet.turns garbage``, ``[1,2,3]``, a body that is not
valid base64, a zero-byte file left by a full disk) raises there and the
worker exits with ``Unrecoverable error``. These subclasses check every entry
where it is read — Redis ``BRPOP``/``RPOP``, a filesystem ``*.msg`` file —
and hand a bad one to the dead-letter store (:mod:`tasks.rejected`) instead,
then go on with the next entry. Kombu's own source is untouched: the checks
live in overrides of the channel's read methods, and the classes are
registered under their own transport aliases, which ``worker.app`` selects
for ``redis://``, ``rediss://`` and ``filesystem://`` broker URLs.

The filesystem transport also writes atomically: kombu's writer opens the
final ``*.msg`` name and writes into it, so a full disk leaves empty or torn
files that every reader then chokes on, and a reader that lists the folder
mid-write reads half a message (kombu#1551). Here a message is written to a
temporary file of an unpredictable name and renamed; a reader never
sees a partial message from a ratchet producer, and any other bad file
(from before, or from a plain kombu producer) is set aside.

And it wakes up instead of polling: kombu's filesystem transport sleeps its
``polling_interval`` (ratchet's default 10 ms) whenever the queues are empty,
so a chained turn waited half a poll on average and a busy box paid one
``listdir`` per queue per poll. On Linux a worker here waits on an inotify
watch of the queue folder (``inotify_simple``, a ctypes wrapper of the kernel
API) and wakes when a ``*.msg`` file is renamed or written into it, which takes
well under a millisecond; it still looks every :data:`IDLE_POLL_S` (or the
configured interval, if longer) in case a write was not seen (a folder on a
network file system, or a full inotify queue). Where inotify is missing it
polls at the configured interval, as kombu does.

The Redis transport also does less in the worker's main process for each message:
one client for every publish and ack, the BRPOP packed once per order of its
queues, and kombu's unacked bookkeeping written with the next BRPOP (worker/unacked.py).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from celery.app.amqp import AMQP
from celery.app.events import Events
from celery.events.dispatcher import EventDispatcher
from kombu import Connection
from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem, redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from tasks.rejected import (
    MAX_MESSAGE_BYTES,
    FolderRejected,
    RedisRejected,
    RejectedStore,
    read_no_follow,
    set_aside,
    write_atomically,
)
from worker.unacked import RedisQoS, RidingPoller

log = logging.getLogger("ratchet.transport")

REDIS_ALIAS = "ratchet-redis"
FILESYSTEM_ALIAS = "ratchet-filesystem"
IDLE_POLL_S = 1.0
"""With an inotify wake-up: how often an idle filesystem worker looks anyway."""


def envelope_problem(payload: Any, decode_body: Any) -> str | None:
    """Why ``payload`` is not an envelope kombu's virtual transports can deliver; None if it is.

    Mirrors what kombu reads from it: ``properties.delivery_tag`` and
    ``properties.delivery_info.{exchange, routing_key}`` (the Redis transport
    keeps them for acks), the optional strings and headers, and a body its
    ``body_encoding`` decodes.
    """
    if not isinstance(payload, dict):
        return f"the entry is a JSON {type(payload).__name__}, not a kombu envelope (an object)"
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        return "the envelope has no `properties` object"
    tag = properties.get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        return "`properties.delivery_tag` must be a non-empty string"
    info = properties.get("delivery_info")
    if not (
        isinstance(info, dict)
        and isinstance(info.get("exchange"), str)
        and isinstance(info.get("routing_key"), str)
    ):
        return "`properties.delivery_info` must be an object with an exchange and a routing_key"
    for key in ("content-type", "content-encoding"):
        if not isinstance(payload.get(key), str | None):
            return f"`{key}` must be a string"
    if not isinstance(payload.get("headers"), dict | None):
        return "`headers` must be an object"
    body, encoding = payload.get("body"), properties.get("body_encoding")
    if not isinstance(body, str | None):
        return "`body` must be a string"
    if not isinstance(encoding, str | None):
        return "`properties.body_encoding` must be a string"
    if body:
        try:
            decode_body(body, encoding)
        except Exception as exc:  # bad base64 (binascii.Error), an unknown codec, …
            return f"the body cannot be decoded as {encoding!r} ({type(exc).__name__}: {exc})"
    return None


class SafeEntries:
    """The check both channels make on an entry they have taken off a queue."""

    decode_body: Callable[..., Any]
    """kombu's virtual.Channel provides it (an annotation only: the mixin must not shadow it)."""

    def rejected_store(self) -> RejectedStore:
        raise NotImplementedError

    def accept_entry(self, raw: bytes | str, queue: str) -> dict[str, Any] | None:
        """The envelope in ``raw``, or None after setting the entry aside with the reason."""
        data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
        problem: str | None
        payload: Any = None
        if len(data) > MAX_MESSAGE_BYTES:
            problem = f"the entry is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit"
        elif not data.strip():
            problem = "the entry is empty (a write that never finished, e.g. on a full disk)"
        else:
            try:
                payload = loads(bytes_to_str(data))
                problem = envelope_problem(payload, self.decode_body)
            except (ValueError, TypeError, RecursionError) as exc:
                problem = f"the entry is not JSON ({type(exc).__name__}: {str(exc)[:200]})"
        if problem is None:
            return payload  # type: ignore[no-any-return]
        set_aside(data, f"not a kombu message: {problem}", queue, self.rejected_store)
        return None


class SafeRedisReads(SafeEntries):
    """The Redis channel's three reads of a queue entry, each through accept_entry.

    A mixin, so that a Sentinel channel could share it (ratchet does not configure
    Sentinel brokers yet: kombu's Sentinel transport needs a ``master_name`` option).
    """

    def rejected_store(self) -> RejectedStore:
        return RedisRejected(self._create_client())

    def _brpop_read(self, **options: Any) -> bool:
        # kombu's _brpop_read with two changes: the replies of the unacked bookkeeping
        # the BRPOP carried are read first (worker/unacked.py), and the entry goes
        # through accept_entry instead of straight into loads() and the delivery
        # callback. Kept in step with kombu 5.7 (the reauth flush in `finally` included).
        if getattr(self.qos, "riding", 0):
            connection = self.client.connection
            try:
                self.qos.read_riding(connection)
                waiting = not self._closing and not connection.can_read(timeout=0)
            except self.connection_errors:
                connection.disconnect()
                self._in_poll = None
                raise
            if waiting:
                raise Empty()  # the BRPOP still waits: its reply wakes the loop again
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            payload = self.accept_entry(item, dest)
            if payload is None:
                raise Empty()
            # The connection is idle until the next BRPOP: the delivery's bookkeeping is
            # written on it (worker/unacked.py).
            self.delivering = self.client.connection
            try:
                self.connection._deliver(payload, dest)
            finally:
                self.delivering = None
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _get(self, queue: str) -> dict[str, Any]:
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                while item := client.rpop(self._q_for_pri(queue, pri)):
                    payload = self.accept_entry(item, queue)
                    if payload is not None:
                        self._maybe_update_queues_expire(client, queue)
                        return payload
            self._maybe_update_queues_expire(client, queue)
            raise Empty()

    def _deliver_fanout_message(self, message: Any, exchange: str) -> bool:
        problem = envelope_problem(message, self.decode_body)
        if problem is not None:
            # Broadcasts (remote control) are best-effort in kombu: log and skip.
            log.warning("fanout exchange %s: broadcast ignored: %s", exchange, problem)
            return False
        return bool(super()._deliver_fanout_message(message, exchange))


BRPOP_COMMANDS_MAX = 64
"""Packed BRPOP commands a channel keeps (one per order of its queues, at most)."""


class RedisChannel(SafeRedisReads, redis.Channel):
    QoS = RedisQoS
    delivering: Any = None
    """The BRPOP connection while a message read on it is delivered (else None)."""
    _plain_client: Any = None
    _brpop_connection: Any = None
    _brpop_commands: dict[tuple[Any, ...], Any] | None = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        # kombu asks for a new redis.Redis for every publish, ack and restore; each one
        # copies redis-py's table of ~170 response callbacks (measured: two per turn,
        # about 0.3 ms). The client holds no connection of its own (it checks one out
        # of the channel's pool per command), so one per pool serves them all.
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._plain_client
        if client is None or client.connection_pool is not self.pool:
            client = self._plain_client = super()._create_client()
        return client

    def _brpop_start(self, timeout: float | None = None) -> None:
        # kombu's _brpop_start, with the command packed once per order of the queues
        # instead of for every message: with ratchet's ten priority steps (worker/
        # priorities.py) a BRPOP names ten lists a queue, 21 keys for the turns and
        # control queues, and packing them was the largest share of what the steps
        # cost the worker's main process (measured: 3x the packing of a one-list BRPOP,
        # once a turn). Kept in step with kombu 5.7.
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        connection = self.client.connection
        commands = self._brpop_commands
        if commands is None or self._brpop_connection is not connection:
            # Packed with this connection's encoder (kombu may give the client a new one).
            commands = self._brpop_commands = {}
            self._brpop_connection = connection
        order = (*queues, timeout)
        packed = commands.get(order)
        if packed is None:
            keys = [self._q_for_pri(queue, pri) for pri in self.priority_steps
                    for queue in queues]  # fmt: skip
            command_args = ["BRPOP", *keys, timeout or 0]
            if self.global_keyprefix:
                command_args = self.client._prefix_args(command_args)
            packed = connection.pack_command(*command_args)
            if len(commands) >= BRPOP_COMMANDS_MAX:
                commands.clear()
            commands[order] = packed
        riders = self.qos.take_riders(connection) if self.qos.riders else None
        self._in_poll = connection
        self._brpop_sent_at = monotonic()  # type: ignore[assignment]  # kombu: None until sent
        try:
            # One send for the bookkeeping and the BRPOP: one write on the wire.
            connection.send_packed_command([b"".join((riders, *packed))] if riders else packed)
        except BaseException:
            self.qos.riding = 0
            raise

    def _flush_brpop_reauth(self) -> None:
        # kombu sends AUTH on the idle BRPOP connection and reads its reply: not before the
        # replies of the bookkeeping it carried are read (its timer tries again).
        if not self.qos.riding:
            super()._flush_brpop_reauth()

    def close(self) -> None:
        # What the bookkeeping still owes is written while the clients are open (kombu
        # closes them before it restores what the channel still holds).
        if not self.closed:
            try:
                self.qos.settle()
            except self.connection_errors as exc:
                # A lost connection closes the channel too: kombu's close must still run.
                log.warning("the broker's unacked bookkeeping was not written at close: %r", exc)
        super().close()


class RedisTransport(redis.Transport):
    Channel = RedisChannel
    driver_name = "redis"

    cycle: RidingPoller  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = RidingPoller()

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self.cycle.loop_thread = threading.get_ident()
        super().register_with_event_loop(connection, loop)


class FilesystemChannel(SafeEntries, filesystem.Channel):
    """Atomic writes, claims by rename, and bad files set aside (see the module docstring)."""

    def rejected_store(self) -> RejectedStore:
        return FolderRejected(Path(self.transport_options["rejected_folder"]))

    _claimed: str | None = None

    @property
    def claimed_folder(self) -> str:
        # Same file system as the queue folder, so the claim is a rename (kombu moves
        # the file to the system temp dir, which may be another file system and full).
        folder = os.path.join(self.data_folder_in, ".claimed")
        if self._claimed != folder or not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            self._claimed = folder
        return folder

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        try:
            # Not fsynced (measured: 0.3 ms a message on an idle disk, several ms on a busy
            # one): a message a host crash empties is set aside, and the run it would have
            # moved is resumed by the sweeper once past due, like any lost message.
            write_atomically(
                Path(self.data_folder_out),
                name,
                dumps(payload).encode("utf-8"),
                sync=False,
                staging=self._staging_folder(),
            )
        except OSError as exc:
            raise ChannelError(
                f"cannot add message {name!r} to {self.data_folder_out}: {exc}"
            ) from exc

    def _names(self) -> list[str]:
        """The queue folder's names, oldest message first: listed once per look over the
        consumed queues of every channel (FilesystemTransport.drain_events), not per queue."""
        listings: dict[str, list[str]] | None = getattr(self.connection, "listings", None)
        if listings is None:
            return sorted(os.listdir(self.data_folder_in))
        names = listings.get(self.data_folder_in)
        if names is None:
            names = listings[self.data_folder_in] = sorted(os.listdir(self.data_folder_in))
        return names

    _staging: str | None = None

    def _staging_folder(self) -> Path:
        """Where a message is written before it is renamed into the queue folder: beside
        it, so that the folder's watch (FolderWake) wakes a consumer once per message, at
        the rename, not also when the temporary file is closed."""
        folder = os.path.join(self.data_folder_out, ".staging")
        if self._staging != folder:
            os.makedirs(folder, exist_ok=True)
            self._staging = folder
        return Path(folder)

    def _get(self, queue: str) -> dict[str, Any]:
        wanted = f"{queue}.msg"
        names = self._names()
        for name in list(names):
            if name.partition(".")[2] != wanted:
                continue
            names.remove(name)  # claimed below, or gone: the look's listing has it no more
            claimed = os.path.join(self.claimed_folder, name)
            try:
                # The rename is the claim: of two workers, exactly one gets the file.
                os.rename(os.path.join(self.data_folder_in, name), claimed)
            except FileNotFoundError:
                continue
            try:
                data = read_no_follow(Path(claimed))
            finally:
                try:
                    os.unlink(claimed)
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        log.warning("cannot remove the consumed message file %s: %s", claimed, exc)
            if data is None:
                # Gone between the claim and the read, or a symlink (never followed).
                set_aside(b"", f"not a kombu message: {name} is not a regular file", queue,
                          self.rejected_store)  # fmt: skip
                continue
            payload = self.accept_entry(data, queue)
            if payload is not None:
                return payload
        raise Empty()

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        super().basic_ack(delivery_tag, multiple)
        self.connection.poke()  # a prefetch slot is free: a waiting consumer may take more

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        super().basic_reject(delivery_tag, requeue)
        self.connection.poke()

    _exchange_paths: dict[str, str] | None = None

    def _exchange_path(self, exchange: str) -> str:
        """The exchange's table file, its name checked by kombu once per channel."""
        paths = self._exchange_paths
        if paths is None:
            paths = self._exchange_paths = {}
        path = paths.get(exchange)
        if path is None:
            path = paths[exchange] = str(self._exchange_file(exchange))
        return path

    def get_table(self, exchange: str) -> list[Any]:
        # Most lookups are of an exchange no queue is bound to: Celery's task events
        # (celeryev) while nothing listens, three a turn in the worker's consumer. kombu
        # builds two Paths and raises out of open() for it (measured: about 15x a stat).
        if not os.path.exists(self._exchange_path(exchange)):
            return []
        try:
            return list(super().get_table(exchange))
        except ValueError as exc:
            # An exchange table torn by a full disk: rebuilt when the queues bind again.
            log.warning(
                "exchange table for %r is unreadable (%s); treating it as empty", exchange, exc
            )
            return []

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        try:
            super()._queue_bind(exchange, routing_key, pattern, queue)
        except ValueError as exc:
            file = self._exchange_file(exchange)
            data = read_no_follow(file) or b""
            set_aside(
                data, f"exchange table {file.name} is unreadable ({exc}); rebuilt", exchange,
                self.rejected_store,
            )  # fmt: skip
            file.unlink(missing_ok=True)
            super()._queue_bind(exchange, routing_key, pattern, queue)


class FolderWake:
    """Wakes a waiting consumer when a message file lands in a folder (inotify, Linux),
    or when it may take one again (an ack or a reject freed a prefetch slot: ``poke``).

    Made per process: an inotify descriptor inherited over a fork would share
    its event queue with the parent.
    """

    def __init__(self, folder: str) -> None:
        import inotify_simple

        flags = inotify_simple.flags
        self._inotify = inotify_simple.INotify(inheritable=False, nonblocking=True)
        try:
            # Renamed in (ratchet's atomic writes), or written in place (a plain kombu producer).
            self._inotify.add_watch(folder, flags.MOVED_TO | flags.CLOSE_WRITE)
            self._poked, self._poke = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self._inotify.close()
            raise
        self._overflow = int(flags.Q_OVERFLOW)
        self._poller = select.poll()
        self._poller.register(self._inotify.fileno(), select.POLLIN)
        self._poller.register(self._poked, select.POLLIN)

    @classmethod
    def open(cls, folder: str) -> FolderWake | None:
        """A wake-up on ``folder``, or None where inotify is unavailable (then: poll)."""
        try:
            return cls(folder)
        except (ImportError, OSError) as exc:
            log.info("no inotify wake-up on %s (%s); polling for messages", folder, exc)
            return None

    def poke(self) -> None:
        """Wake the wait (from any thread)."""
        try:
            os.write(self._poke, b"x")
        except (BlockingIOError, OSError):
            pass  # already poked (the pipe is full), or closed

    def wait(self, seconds: float) -> bool:
        """Return when a ``*.msg`` file arrived or ``poke`` was called since the last wait,
        or after ``seconds``: False if only a poke ended it (no file may have arrived)."""
        deadline = monotonic() + seconds
        left = seconds
        while left > 0:
            ready = self._poller.poll(max(1, int(left * 1000)))
            poked = arrived = False
            for fd, _ in ready:
                if fd == self._poked:
                    try:
                        os.read(self._poked, 4096)
                    except BlockingIOError:
                        pass
                    poked = True
                else:
                    events = self._inotify.read(timeout=0)
                    # (A full event queue drops events: then anything may have arrived.)
                    arrived = arrived or any(
                        event.name.endswith(".msg") or event.mask & self._overflow
                        for event in events
                    )
            if arrived or poked:
                return arrived
            left = deadline - monotonic()
        return True

    def close(self) -> None:
        self._inotify.close()
        for fd in (self._poked, self._poke):
            os.close(fd)


class FilesystemTransport(filesystem.Transport):
    Channel = FilesystemChannel
    driver_name = "filesystem"
    _wake: FolderWake | None = None
    _wake_tried_pid: int | None = None

    def _folder_wake(self) -> FolderWake | None:
        if self._wake_tried_pid != os.getpid():
            self._wake_tried_pid = os.getpid()
            folder = self.client.transport_options.get("data_folder_in")  # type: ignore[union-attr]
            self._wake = FolderWake.open(folder) if folder else None
        return self._wake

    def poke(self) -> None:
        """Wake this process's waiting consumer, if it waits on the folder."""
        wake = self._wake
        if wake is not None and self._wake_tried_pid == os.getpid():
            wake.poke()

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        # kombu's virtual Transport.drain_events, with the sleep between empty polls
        # replaced by a wait on the folder's wake-up. The watch exists before the
        # first look, so a message that lands in between wakes the wait at once; an
        # ack wakes it too (with every prefetch slot taken, a look finds "nothing").
        wake = self._folder_wake()
        if wake is None:
            super().drain_events(connection, timeout)
            return
        started = monotonic()
        idle = max(IDLE_POLL_S, self.polling_interval or 0.0)
        while True:
            if not self._seen_all:
                try:
                    self._look(timeout)
                    return
                except Empty:
                    pass
            waited = monotonic() - started
            if timeout is not None and waited >= timeout:
                raise TimeoutError()
            # A poke alone (an ack freed a prefetch slot) looks again only if the last look
            # left a message file behind: with none left and none arrived since (the watch
            # would say), a look could take nothing.
            if wake.wait(idle if timeout is None else min(idle, timeout - waited)):
                self._seen_all = False

    listings: dict[str, list[str]] | None = None
    """During one look (``_look``): each queue folder's names, listed once for the look."""

    _seen_all = False
    """The last look listed the queue folder and no message file was left in its listing:
    until the watch reports a new file, another look would find nothing. It saved two
    looks a turn (the one right after a delivery, and the one an ack's poke asked for)."""

    def _look(self, timeout: float | None) -> None:
        """One look over every channel's consumed queues (kombu's cycle): a folder is listed
        once for all of them, not once per queue of each channel (measured: 9.1 listings
        a turn). A message that lands meanwhile wakes the next wait."""
        self._seen_all = False
        listings: dict[str, list[str]] = {}
        self.listings = listings
        try:
            self.cycle.get(self._deliver, timeout=timeout)  # type: ignore[union-attr]
        finally:
            self.listings = None
            folder = self.client.transport_options.get("data_folder_in")  # type: ignore[union-attr]
            names = listings.get(folder) if folder else None
            # (No listing: every channel's prefetch slots were taken; the look saw nothing.)
            self._seen_all = names is not None and not any(n.endswith(".msg") for n in names)

    def close_connection(self, connection: Any) -> None:
        if self._wake is not None and self._wake_tried_pid == os.getpid():
            self._wake.close()
            self._wake, self._wake_tried_pid = None, None
        super().close_connection(connection)


TRANSPORT_ALIASES.setdefault(REDIS_ALIAS, f"{__name__}:RedisTransport")
TRANSPORT_ALIASES.setdefault(FILESYSTEM_ALIAS, f"{__name__}:FilesystemTransport")


def transport_for(broker_url: str) -> str | None:
    """The ratchet transport alias for ``broker_url``, or None to leave kombu's choice."""
    scheme = broker_url.split("://", 1)[0]
    if scheme in ("redis", "rediss"):
        return REDIS_ALIAS
    if scheme == "filesystem":
        return FILESYSTEM_ALIAS
    return None


class RatchetConnection(Connection):
    """kombu's Connection, with ratchet's transport for a ``redis://`` or ``filesystem://`` URL.

    Chosen per connection from the URL (not once in ``broker_transport``), so an
    app whose ``broker_url`` is changed after it was built still gets the right
    transport; an explicit ``transport=`` wins.
    """

    def __init__(self, hostname: Any = "localhost", *args: Any, **kwargs: Any) -> None:
        if kwargs.get("transport") is None and isinstance(hostname, str):
            kwargs["transport"] = transport_for(hostname)
        super().__init__(hostname, *args, **kwargs)


_SENT_EVENT_AT = 14
"""Where ``create_sent_event`` is among ``as_task_v2``'s arguments after ``task_id, name``
(Celery 5's ``send_task`` passes it by position)."""


class RatchetAMQP(AMQP):
    """Celery's ``app.amqp`` (its ``Celery(amqp=…)`` seam), making RatchetConnections.

    And it does not send ``task-sent`` for a ratchet task that a running task sends
    (the next turn a turn chains, a sweep's resume): the worker that receives it
    sends ``task-received``, ``task-started`` and ``task-succeeded``, which is
    what Flower and ``celery events`` list a task by, so the event only cost a
    ``PUBLISH`` and its encoding in the pool process on every turn. What a client
    sends (the CLI, the API, beat) still has its ``task-sent``, and so does any
    task that is not ratchet's (an application's notification task).
    """

    Connection = RatchetConnection

    def as_task_v2(self, task_id: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("ratchet.") and self.app.current_worker_task is not None:
            if len(args) > _SENT_EVENT_AT:
                args = (*args[:_SENT_EVENT_AT], False, *args[_SENT_EVENT_AT + 1 :])
            else:
                kwargs["create_sent_event"] = False
        return super().as_task_v2(task_id, name, *args, **kwargs)


class ListenedEventDispatcher(EventDispatcher):
    """Celery's event dispatcher, which publishes nothing on a filesystem broker while
    no queue is bound to the events exchange.

    On a ``filesystem://`` broker the worker's consumer has no event loop, so Celery
    publishes each task event on its own (``task-received``, ``-started``,
    ``-succeeded``: three a turn), and with nothing listening kombu drops each one
    after encoding it (measured: about a fifth of the worker's main process CPU).
    ``celery events`` and Flower bind a queue to the exchange, which writes its
    table file: from the next event on, every event is published as Celery does.
    """

    def _publish(
        self, event: Any, producer: Any, routing_key: str, *args: Any, **kwargs: Any
    ) -> Any:
        # (Celery's one way out for send, publish and flush alike.)
        channel = producer.channel if producer is not None else None
        if isinstance(channel, FilesystemChannel) and not channel.get_table(self.exchange.name):
            return None
        return super()._publish(event, producer, routing_key, *args, **kwargs)


class RatchetEvents(Events):
    """Celery's ``app.events`` (its ``Celery(events=…)`` seam), with ListenedEventDispatcher."""

    dispatcher_cls = f"{__name__}:ListenedEventDispatcher"
