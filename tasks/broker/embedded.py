# mypy: disable-error-code="no-untyped-call,override,misc,attr-defined"
# (kombu's transports are untyped, and the channel below uses their attributes.)
"""``ratchet-filesystem``: kombu's ``filesystem://`` transport, the embedded default's broker, hardened.

It checks every ``*.msg`` file it reads (tasks/broker/entries.py) and sets a bad one
aside instead of dying on it. It also writes atomically: kombu's writer opens the
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

Kombu's own source is untouched: the changes are overrides of the channel's and
transport's methods, registered under their own alias, which tasks/broker/transport.py's
``transport_for`` selects for a ``filesystem://`` broker URL.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.json import dumps

from store.private import private_dir, private_files, read_no_follow, write_atomically
from store.rejected import MAX_MESSAGE_BYTES, RejectedStore
from store.rejected.folder import FolderRejected
from tasks.broker.entries import SafeEntries
from tasks.refusals import set_aside

log = logging.getLogger("ratchet.transport")

FILESYSTEM_ALIAS = "ratchet-filesystem"
IDLE_POLL_S = 1.0
"""With an inotify wake-up: how often an idle filesystem worker looks anyway."""


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
            private_dir(Path(folder))
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
            private_dir(Path(folder))
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
                data = read_no_follow(Path(claimed), MAX_MESSAGE_BYTES + 1)
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
            data = read_no_follow(file, MAX_MESSAGE_BYTES + 1) or b""
            set_aside(
                data, f"exchange table {file.name} is unreadable ({exc}); rebuilt", exchange,
                self.rejected_store,
            )  # fmt: skip
            file.unlink(missing_ok=True)
            super()._queue_bind(exchange, routing_key, pattern, queue)
        # kombu writes the exchange's table with the umask; its folder is 0700 already.
        private_files(self._exchange_file(exchange))


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


TRANSPORT_ALIASES.setdefault(FILESYSTEM_ALIAS, f"{__name__}:FilesystemTransport")
