"""How many replicas must hold a run's journal before a call that is not idempotent starts.

Redis replicates asynchronously: a primary acknowledges a write before any replica
has it. If it dies then, and a replica is promoted, the write is gone — and when the
write was the ``tool.requested`` of a call that is not idempotent, the run looks as if
the call never started, and the call runs again. Two parameters of a Redis store URL
close that hole::

    redis://host:6379/0?min_replicas=1&replica_timeout_ms=1000
    redis+sentinel://h1:26379,h2:26379/service/0?min_replicas=1

``min_replicas`` (0–16, default 0): the replicas that must acknowledge the append that
journals such a call before it starts (Redis ``WAIT``); 0 waits for none, exactly as
before. ``replica_timeout_ms`` (1–4000, default 1000): how long to wait for them; fewer
within it and the call is not started, the run stalls saying why
(:class:`runtime.errors.NotReplicated`). Both are ratchet's, taken out of the URL before
redis-py reads it. A snapshot store's URL accepts them too (one URL often serves both
stores) and has nothing to wait for: the event log is the truth, a lost snapshot is
rebuilt from it.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_REPLICAS_MAX = 16
"""More replicas than any Redis deployment runs; a larger number is a typo."""
REPLICA_TIMEOUT_MS_DEFAULT = 1000
REPLICA_TIMEOUT_MS_MAX = 4000
"""Under the 5 s a reply may take (store.snapshots.redis.SOCKET_TIMEOUT_S): the socket's
timeout never cuts a WAIT short, and a WAIT of 0 (Redis: forever) is never sent."""
_RANGES = {
    "min_replicas": (0, MIN_REPLICAS_MAX, "a whole number of replicas"),
    "replica_timeout_ms": (1, REPLICA_TIMEOUT_MS_MAX, "a whole number of milliseconds"),
}


@dataclass(frozen=True)
class ReplicaWait:
    """What a store URL asks of its replicas (:func:`split_replica_wait`)."""

    min_replicas: int = 0
    """Replicas that must acknowledge a journal entry before its call starts; 0: none."""
    timeout_ms: int = REPLICA_TIMEOUT_MS_DEFAULT
    """How long to wait for them."""


def split_replica_wait(url: str) -> tuple[str, ReplicaWait]:
    """``url`` without ``min_replicas`` and ``replica_timeout_ms``, and what they ask.

    A URL naming neither comes back as it was, character for character. ValueError,
    naming the parameter and the accepted range, for a value that is not a whole number
    in range or a parameter given twice.
    """
    # Cut by hand, not rebuilt by urllib: urlunsplit writes `unix:///path` as `unix:/path`.
    base, _, rest = url.partition("?")
    query, hash_mark, fragment = rest.partition("#")
    if not any(p.split("=", 1)[0] in _RANGES for p in query.split("&")):
        return url, ReplicaWait()
    kept: list[str] = []
    given: dict[str, int] = {}
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        if name not in _RANGES:
            kept.append(pair)
            continue
        low, high, what = _RANGES[name]
        if name in given:
            raise ValueError(f"`{name}` is given twice; give it once")
        if not (value.isascii() and value.isdigit() and low <= int(value) <= high):
            raise ValueError(f"`{name}={value[:20]}`: use {what} from {low} to {high}")
        given[name] = int(value)
    wait = ReplicaWait(
        given.get("min_replicas", 0), given.get("replica_timeout_ms", REPLICA_TIMEOUT_MS_DEFAULT)
    )
    return base + ("?" + "&".join(kept) if kept else "") + hash_mark + fragment, wait
