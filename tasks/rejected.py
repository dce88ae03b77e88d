"""The dead-letter store: every message a worker refuses, kept raw for an operator.

A worker refuses what it cannot or must not act on: an entry on a queue that is
not a kombu envelope (``LPUSH ratchet.turns garbage``), a body that cannot be
decoded (bad base64, a pickle, not JSON), a task ratchet does not know, a
ratchet task with missing, extra or mistyped arguments, a message over
:data:`MAX_MESSAGE_BYTES`. Each is set aside here — its raw bytes (at most
:data:`MAX_RAW_BYTES` of them), the reason, the queue and the time — and the
worker goes on with the next message. ``ratchet rejected list|show|purge`` reads
and empties the store.

One store per broker, beside the queues:

- Redis: the list ``ratchet:rejected`` on the broker's database, newest first,
  capped at :data:`MAX_ENTRIES` (``LTRIM``);
- RabbitMQ: the durable queue ``ratchet.rejected`` with ``x-max-length``
  :data:`MAX_ENTRIES` (the oldest entry is dropped first);
- ``filesystem://``: one JSON file per entry in ``<data dir>/broker/rejected``,
  oldest removed beyond :data:`MAX_ENTRIES`.

Bounded on purpose: a producer stuck in a loop of garbage must not fill the
broker. Setting a message aside never raises: if the store itself is down,
:func:`set_aside` logs the reason at ERROR (the message is then gone, but not
silently).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.errors import RatchetError, RejectedEntryNotFound
from store.private import private_dir

log = logging.getLogger("ratchet.rejected")

MAX_ENTRIES = 1000
"""Entries kept per broker; the oldest go first."""
MAX_RAW_BYTES = 64 * 1024
"""Bytes of a refused message kept; the entry records the full size."""
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""A broker entry larger than this is refused unread (a turn message is a few hundred bytes)."""
REDIS_KEY = "ratchet:rejected"
AMQP_QUEUE = "ratchet.rejected"
ENTRY_ID = re.compile(r"\A[0-9]{13}-[0-9a-f]{12}\Z")


class _EntryClock:
    """Milliseconds and an order within each millisecond: the ids one process gives sort in
    the order it set the entries aside (a folder keeps the newest by sorting its names;
    a random suffix alone ordered entries of one millisecond at random)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms, self._order = 0, 0

    def next(self) -> tuple[int, int]:
        with self._lock:
            now = max(int(time.time() * 1000), self._ms)  # never backwards
            self._order = self._order + 1 if now == self._ms else 0
            if self._order > 0xFFFF:  # 65,536 in one millisecond: borrow the next one
                now, self._order = now + 1, 0
            self._ms = now
            return now, self._order


_entry_clock = _EntryClock()


@dataclass(frozen=True)
class Rejected:
    """One refused message, as set aside."""

    id: str
    """Sortable by time: ``<ms since the epoch>-<random>``."""
    at_ms: int
    """When the worker refused it."""
    queue: str
    """The queue it came from."""
    reason: str
    """Why it was refused, in one line."""
    size: int
    """Its full size in bytes (``raw`` may be cut at MAX_RAW_BYTES)."""
    raw: str
    """The message as it was on the broker, base64."""

    @property
    def truncated(self) -> bool:
        return len(base64.b64decode(self.raw)) < self.size

    def raw_bytes(self) -> bytes:
        return base64.b64decode(self.raw)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "truncated": self.truncated}

    @classmethod
    def new(cls, raw: bytes, reason: str, queue: str) -> Rejected:
        now, order = _entry_clock.next()
        return cls(
            id=f"{now:013d}-{order:04x}{uuid.uuid4().hex[:8]}",
            at_ms=now,
            queue=queue,
            reason=reason,
            size=len(raw),
            raw=base64.b64encode(raw[:MAX_RAW_BYTES]).decode("ascii"),
        )

    @classmethod
    def from_json(cls, document: bytes | str) -> Rejected:
        data = json.loads(document)
        return cls(
            id=str(data["id"]),
            at_ms=int(data["at_ms"]),
            queue=str(data["queue"]),
            reason=str(data["reason"]),
            size=int(data["size"]),
            raw=str(data["raw"]),
        )

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _entries(documents: Any) -> list[Rejected]:
    """The entries among ``documents``; one that is not an entry is skipped with a warning."""
    entries = []
    for document in documents:
        try:
            entries.append(Rejected.from_json(document))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                "skipping an unreadable dead-letter entry (%s: %s)", type(exc).__name__, exc
            )
    return entries


class RejectedStore:
    """Where refused messages go. ``add`` keeps at most MAX_ENTRIES; list is newest first."""

    where: str = ""

    def add(self, entry: Rejected) -> None:
        raise NotImplementedError

    def list(self, limit: int = 50) -> list[Rejected]:
        raise NotImplementedError

    def get(self, entry_id: str) -> Rejected:
        if not ENTRY_ID.match(entry_id):
            raise RejectedEntryNotFound(entry_id)
        for entry in self.list(MAX_ENTRIES):
            if entry.id == entry_id:
                return entry
        raise RejectedEntryNotFound(entry_id)

    def purge(self) -> int:
        """Destructive: delete every entry; how many there were."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class RedisRejected(RejectedStore):
    def __init__(self, client: Any, owned: bool = False) -> None:
        self.client = client
        self.owned = owned
        kwargs = client.connection_pool.connection_kwargs
        self.where = f"the Redis list {REDIS_KEY} (db {kwargs.get('db', 0)})"

    def add(self, entry: Rejected) -> None:
        with self.client.pipeline() as pipe:
            pipe.lpush(REDIS_KEY, entry.dumps())
            pipe.ltrim(REDIS_KEY, 0, MAX_ENTRIES - 1)
            pipe.execute()

    def list(self, limit: int = 50) -> list[Rejected]:
        return _entries(self.client.lrange(REDIS_KEY, 0, limit - 1))

    def purge(self) -> int:
        with self.client.pipeline() as pipe:
            pipe.llen(REDIS_KEY)
            pipe.delete(REDIS_KEY)
            count, _ = pipe.execute()
        return int(count)

    def close(self) -> None:
        if self.owned:
            self.client.close()


class FolderRejected(RejectedStore):
    """One ``<id>.json`` per entry; written to a temp file of an unpredictable name, then renamed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = f"the folder {folder}"

    def _ensure(self) -> None:
        private_dir(self.folder)
        if self.folder.is_symlink():
            # Entries are written into this folder: never into one someone pointed elsewhere.
            raise OSError(f"{self.folder} is a symlink; make it a plain directory")

    def add(self, entry: Rejected) -> None:
        self._ensure()
        write_atomically(self.folder, f"{entry.id}.json", entry.dumps().encode())
        names = self._names()
        for name in names[: max(0, len(names) - MAX_ENTRIES)]:
            (self.folder / name).unlink(missing_ok=True)

    def _names(self) -> list[str]:
        try:
            return sorted(
                n for n in os.listdir(self.folder) if n.endswith(".json") and ENTRY_ID.match(n[:-5])
            )
        except FileNotFoundError:
            return []

    def list(self, limit: int = 50) -> list[Rejected]:
        entries: list[Rejected] = []
        for name in reversed(self._names()):
            if len(entries) >= limit:
                break
            document = read_no_follow(self.folder / name)
            if document is not None:
                entries.extend(_entries([document]))
        return entries

    def get(self, entry_id: str) -> Rejected:
        if not ENTRY_ID.match(entry_id):
            raise RejectedEntryNotFound(entry_id)
        document = read_no_follow(self.folder / f"{entry_id}.json")
        found = _entries([document]) if document is not None else []
        if not found:
            raise RejectedEntryNotFound(entry_id)
        return found[0]

    def purge(self) -> int:
        count = 0
        for name in self._names():
            try:
                (self.folder / name).unlink()
                count += 1
            except FileNotFoundError:
                pass
        return count


class AmqpRejected(RejectedStore):
    """A durable RabbitMQ queue; reading it takes every entry and gives them all back."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = f"the RabbitMQ queue {AMQP_QUEUE}"

    def _queue(self) -> Any:
        from kombu import Queue

        return Queue(  # type: ignore[no-untyped-call]
            AMQP_QUEUE,
            durable=True,
            queue_arguments={"x-max-length": MAX_ENTRIES, "x-overflow": "drop-head"},
        )

    def _with_channel(self, fn: Callable[[Any], Any]) -> Any:
        from kombu import Connection

        with Connection(self.url) as connection:  # type: ignore[no-untyped-call]
            channel = connection.channel()
            try:
                bound = self._queue()(channel)
                bound.declare()
                return fn(bound)
            finally:
                # Closing the channel hands every message read but not acknowledged back.
                channel.close()

    def add(self, entry: Rejected) -> None:
        from kombu import Connection

        with Connection(self.url) as connection:  # type: ignore[no-untyped-call]
            producer = connection.Producer()
            producer.publish(
                entry.dumps(),
                exchange="",
                routing_key=AMQP_QUEUE,
                declare=[self._queue()],
                content_type="application/json",
                content_encoding="utf-8",
                delivery_mode=2,
            )

    def list(self, limit: int = 50) -> list[Rejected]:
        def read(queue: Any) -> list[Rejected]:
            entries: list[Rejected] = []
            while True:
                message = queue.get(no_ack=False)
                if message is None:
                    break
                entries.extend(_entries([message.body]))
            return entries

        entries: list[Rejected] = self._with_channel(read)
        return list(reversed(entries))[:limit]

    def purge(self) -> int:
        return int(self._with_channel(lambda queue: queue.purge() or 0))


def write_atomically(
    folder: Path, name: str, data: bytes, sync: bool = True, staging: Path | None = None
) -> None:
    """Write ``folder/name`` whole or not at all: temp file (O_EXCL|O_NOFOLLOW), fsync, rename.

    The temp file's name is unpredictable and starts with a dot, so no reader that
    looks for ``*.msg`` or ``*.json`` sees it; on any failure it is removed. Without
    ``sync`` it is not fsynced: still whole or absent for every reader and across a
    crash of the process, but a crash of the host may leave it empty. With
    ``staging`` (a folder on the same file system) the temp file is written there,
    so a watch on ``folder`` sees only the rename.
    """
    temp = (staging or folder) / f".{secrets.token_hex(8)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, folder / name)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def read_no_follow(path: Path) -> bytes | None:
    """The file's bytes, or None if it is gone or is a symlink (never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        return None
    with os.fdopen(fd, "rb") as file:
        return file.read(MAX_MESSAGE_BYTES + 1)


def rejected_folder(data_dir: Path) -> Path:
    return data_dir / "broker" / "rejected"


def open_rejected(
    broker_url: str, data_dir: Path, transport_options: dict[str, Any] | None = None
) -> RejectedStore:
    """The dead-letter store beside the broker at ``broker_url`` (``transport_options``:
    the app's, which name the service of kombu's ``sentinel://`` form)."""
    if broker_url.startswith(("redis://", "rediss://", "unix://")):
        import redis

        return RedisRejected(redis.Redis.from_url(broker_url), owned=True)
    if broker_url.startswith(("redis+sentinel://", "sentinel://")):
        from store.sentinel import SentinelUrl, is_sentinel
        from store.snapshots.redis import connect

        if is_sentinel(broker_url):
            parsed = SentinelUrl.parse(broker_url)
        else:
            parsed = SentinelUrl.from_kombu(broker_url, transport_options or {})
        return RedisRejected(connect(parsed.url(), max_connections=2), owned=True)
    if broker_url.startswith(("amqp://", "amqps://", "pyamqp://")):
        return AmqpRejected(broker_url)
    if broker_url.startswith("filesystem://"):
        return FolderRejected(rejected_folder(data_dir))
    raise RatchetError(
        f"no dead-letter store for the broker {broker_url.split('://', 1)[0]}://; "
        "ratchet keeps refused messages on Redis, RabbitMQ and filesystem:// brokers"
    )


_stores: dict[tuple[int, str, str], RejectedStore] = {}


def store_for_app(app: Any) -> RejectedStore:
    """The store beside the broker ``app`` (a Celery app) uses; one per process and broker.

    Follows the app's own ``broker_url`` (a test or an embedding application may
    change it after the app was built), not the environment.
    """
    url = str(app.conf.broker_url or "")
    folder = str((app.conf.broker_transport_options or {}).get("rejected_folder") or "")
    key = (os.getpid(), url, folder)
    store = _stores.get(key)
    if store is None:
        if url.startswith("filesystem://") and folder:
            store = FolderRejected(Path(folder))
        else:
            from tasks.settings import get_settings

            store = open_rejected(
                url, get_settings().resolved_data_dir, app.conf.broker_transport_options
            )
        _stores[key] = store
    return store


def set_aside(
    raw: bytes, reason: str, queue: str, store: RejectedStore | Callable[[], RejectedStore]
) -> Rejected | None:
    """Keep a refused message and log one WARNING line; never raises. The entry, or None."""
    entry = Rejected.new(raw, " ".join(reason.split()), queue)
    try:
        target = store() if callable(store) else store
        target.add(entry)
    except Exception as exc:  # the store is the last resort: it must not take the worker down
        log.error(
            "%s: message refused (%s) and could not be set aside (%s: %s); %s bytes dropped",
            queue,
            entry.reason,
            type(exc).__name__,
            exc,
            entry.size,
        )
        return None
    log.warning(
        "%s: message refused: %s; set aside as %s (`ratchet rejected show %s`)",
        queue,
        entry.reason,
        entry.id,
        entry.id,
    )
    return entry


def message_bytes(message: Any) -> bytes:
    """A received kombu message as it was on the broker, as far as it can be told.

    The virtual transports (Redis, filesystem) keep the envelope they read; for
    RabbitMQ, the body and its headers and properties are put in the same shape.
    """
    raw = getattr(message, "_raw", None)
    if isinstance(raw, dict):
        return json.dumps(raw, sort_keys=True, default=repr).encode()
    body = message.body
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogateescape")
    envelope = {
        "body": base64.b64encode(body or b"").decode("ascii"),
        "content-encoding": message.content_encoding,
        "content-type": message.content_type,
        "headers": message.headers,
        "properties": {**(message.properties or {}), "body_encoding": "base64"},
    }
    return json.dumps(envelope, sort_keys=True, default=repr).encode()
