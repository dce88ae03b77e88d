"""Live streams of the Redis run store: a Redis Stream per run, beside its record."""

from __future__ import annotations

import re
from typing import Any

import redis

from runtime.errors import StoreUnavailable
from store.keyspace import Keyspace
from store.live import LiveEntry, LiveStream, decoded

_CURSOR = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")


class RedisLiveStream(LiveStream):
    """``{prefix}:run:{<id>}:live``: ``XADD MAXLEN`` (exact) and ``PEXPIRE`` in one
    pipeline per batch; ``XREAD BLOCK`` to wait for the next entry. ``…:live:watched``, a
    key with a TTL, while someone watches. On a cluster ``{prefix}`` is the run's shard's
    (:mod:`store.keyspace`): the stream sits in its run's slot."""

    name = "redis live stream"

    def __init__(self, client: Any, keys: Keyspace, where: str) -> None:
        self._client = client
        self._keys = keys
        self._where = f"live stream {where}"

    def _key(self, run_id: str) -> str:
        return self._keys.of(run_id).run_key(run_id, "live")

    def _add(self, run_id: str, entries: list[str], maxlen: int, keep_s: float) -> None:
        key = self._key(run_id)
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for entry in entries:
                    pipe.xadd(key, {"e": entry}, maxlen=maxlen, approximate=False)
                pipe.pexpire(key, int(keep_s * 1000))
                pipe.execute()
        except redis.RedisError as exc:
            raise StoreUnavailable(self._where, type(exc).__name__) from exc

    def _watch(self, run_id: str, for_s: float) -> None:
        try:
            self._client.set(f"{self._key(run_id)}:watched", b"1", px=max(1, int(for_s * 1000)))
        except redis.RedisError as exc:
            raise StoreUnavailable(self._where, type(exc).__name__) from exc

    def _watched(self, run_id: str) -> bool:
        try:
            return bool(self._client.exists(f"{self._key(run_id)}:watched"))
        except redis.RedisError as exc:
            raise StoreUnavailable(self._where, type(exc).__name__) from exc

    def _read(self, run_id: str, after: str | None, limit: int, block_s: float) -> list[LiveEntry]:
        if after is not None and not _CURSOR.fullmatch(after):
            raise ValueError(
                f"not a live-stream cursor: {after[:40]!r} (a Redis stream id, like 1733412345678-0)"
            )
        block = int(block_s * 1000) or None
        try:
            answer: Any = self._client.xread(
                {self._key(run_id): after or "0-0"}, count=limit, block=block
            )
        except redis.RedisError as exc:
            raise StoreUnavailable(self._where, type(exc).__name__) from exc
        found: list[LiveEntry] = []
        for _, entries in answer or ():
            for cursor, fields in entries:
                text = fields.get(b"e") or fields.get("e")
                if text is not None:
                    found.append(LiveEntry(_text(cursor), decoded(text)))
        return found


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
