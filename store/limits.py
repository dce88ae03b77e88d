"""Where the fleet's rate limits and concurrency caps keep their state.

One store per deployment, beside the run store: the Redis the run store uses
(every decision one Lua script, kept in ``lua/limits/``, atomic across workers and
hosts, on the Redis server's clock), or for the embedded default a SQLite file next to the run
database (one ``BEGIN IMMEDIATE`` transaction per decision, shared by the
processes of one machine); ``memory://`` for tests. The arithmetic is
:mod:`runtime.limits`; the Redis script repeats it, and the conformance tests
hold both to the same answers.

What is kept, per limit key: one TAT per rate, a ``blocked until`` time (a 429's
``Retry-After``), reservations by (run, seq), the two waiting lines (runs under
way, new runs) and per-minute counters for operators. Per concurrency key: the
runs holding a place and the line of runs waiting for one. And the run-time
overrides of limits and caps operators set with ``ratchet limits set`` / ``cap``,
which workers read with a short cache (tasks/limits.py) — no restart.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from runtime.errors import StoreUnavailable
from runtime.limits import (
    Rate,
    Verdict,
    checked_run_time,
    corrected_tat,
    later,
    room_at,
    schedule,
    sent_after,
)
from store.private import private_dir, private_files
from store.snapshots.sqlite import enable_wal

RESERVATION_EARLY_MS = 5
"""A reserved turn that fires this early (a timer's jitter) still goes."""
LINE_KEEP_MS = 3_600_000
"""A place in a waiting line not asked about for this long is dropped (its run went away)."""


class Admission(NamedTuple):
    """What :meth:`LimitStore.admit` decided for one model call (a store's answer, as
    ``store.runs.Claim`` is)."""

    verdict: Verdict
    place: int
    """Denied: the run's 0-based position in the waiting lines (runs under way first)."""
    now_ms: float
    """The store's clock when it decided."""


class Place(NamedTuple):
    """What :meth:`LimitStore.acquire` found: a place under a concurrency key, or a line."""

    held: bool
    """The run holds one of the key's places (it may call the model)."""
    place: int
    """Not held: how many runs wait ahead of it."""
    holders: tuple[str, ...]
    """Not held: (some of) the runs holding the places, for a check they are still live."""


@dataclass(frozen=True)
class LimitUse:
    """A limit key's use right now, as ``ratchet limits`` shows it."""

    key: str
    requests_this_minute: int
    """Model calls let through (or given a reserved time) in this wall-clock minute."""
    tokens_this_minute: int
    """Their estimated tokens, corrected as each call settles (:meth:`LimitStore.settle`)."""
    ahead_s: dict[str, float]
    """Per rate: how far its schedule runs ahead of now (reserved calls, debt)."""
    blocked_s: float
    """How long a 429's ``Retry-After`` still holds every call back (0: it does not)."""
    waiting: tuple[int, int]
    """Runs waiting: under way, new."""


@dataclass(frozen=True)
class CapUse:
    """A concurrency key's use right now, as ``ratchet limits`` shows it."""

    key: str
    holders: tuple[str, ...]
    """The runs holding a place."""
    waiting: tuple[str, ...]
    """The runs waiting for one, first in line first."""


def minute_of(wall_ms: float) -> int:
    return int(wall_ms // 60_000)


class LimitStore(ABC):
    """The contract: atomic decisions on shared state (see the module docstring)."""

    @abstractmethod
    def admit(
        self,
        key: str,
        run_id: str,
        seq: int,
        next_seq: int,
        rates: Sequence[Rate],
        costs: Sequence[float],
        horizon_ms: float,
        under_way: bool,
    ) -> Admission:
        """May ``run_id`` at ``seq`` call the model now? Takes a reservation made for
        ``seq`` if there is one; a new reservation is kept for ``next_seq`` (the seq of
        the turn that will be re-enqueued)."""

    @abstractmethod
    def settle(self, key: str, delta_tokens: float, rate: Rate) -> None:
        """The call cost ``delta_tokens`` more (or fewer) than its estimate."""

    @abstractmethod
    def block(self, key: str, for_ms: float) -> None:
        """The provider said 429 with Retry-After: nobody calls before ``for_ms`` from now."""

    @abstractmethod
    def acquire(self, cap_key: str, run_id: str, cap: int) -> Place:
        """Take (or keep) a place under ``cap_key``; else join its line, in order."""

    @abstractmethod
    def release(self, cap_key: str, run_id: str, cap: int) -> list[str]:
        """Let go of ``run_id``'s place (or its place in line); the runs handed a place."""

    @abstractmethod
    def use(self, key: str) -> LimitUse: ...

    @abstractmethod
    def cap_use(self, cap_key: str) -> CapUse: ...

    @abstractmethod
    def overrides(self) -> dict[str, dict[str, Any]]:
        """Limits set at run time: key → {requests_per_minute, tokens_per_minute}."""

    @abstractmethod
    def set_override(self, key: str, values: dict[str, Any] | None) -> None:
        """Set (``None``: remove) a limit's run-time values."""

    @abstractmethod
    def cap_overrides(self) -> dict[str, int]: ...

    @abstractmethod
    def set_cap_override(self, cap_key: str, cap: int | None) -> None: ...

    @abstractmethod
    def known(self) -> tuple[list[str], list[str]]:
        """Limit keys and concurrency keys runs have used, and those set at run time now
        (for ``ratchet limits``): a key only set at run time goes once it is unset."""

    def held_off_s(self, key: str) -> float:
        """How long a 429 still holds ``key`` off (0: not held). Read by a run whose key has
        no rate, which asks :meth:`admit` only while it is held off."""
        return self.use(key).blocked_s

    def note_key(self, key: str) -> None:  # noqa: B027 - optional: a backend may list less
        """``key`` is in use without a rate: :meth:`known` lists it. (A backend that does
        not override this lists only the keys it admitted or had set.)"""


# --- the embedded default and tests: the arithmetic in Python, on documents -------


class LocalLimitStore(LimitStore):
    """Decisions in Python on JSON documents, one transaction each (``_documents``)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or (lambda: time.time_ns() / 1e6)

    @abstractmethod
    @contextmanager
    def _documents(self, *names: str) -> Iterator[dict[str, dict[str, Any]]]:
        """The named documents (``{}`` when new), saved as left when the block ends."""
        yield {}  # pragma: no cover

    def admit(self, key: str, run_id: str, seq: int, next_seq: int, rates: Sequence[Rate],
              costs: Sequence[float], horizon_ms: float, under_way: bool) -> Admission:  # fmt: skip
        now = self._clock()
        with self._documents(f"limit:{key}", "known") as docs:
            doc = docs[f"limit:{key}"]
            docs["known"].setdefault("limits", {})[key] = 1
            tats, sent = doc.setdefault("tats", {}), doc.setdefault("sent", {})
            went = [sent.get(r.unit) for r in rates]
            taken = _take_reservation(doc, f"{run_id}:{seq}", room_at(went, rates, now), now)
            if taken is not None:
                if taken.outcome == "go":
                    _went(sent, rates, sent_after(went, costs, rates, now))
                return Admission(taken, 0, now)
            verdict = schedule(
                [later(tats.get(r.unit), t) for r, t in zip(rates, went, strict=True)],
                costs, rates, now, horizon_ms, doc.get("blocked_until", 0.0),
            )  # fmt: skip
            lines = doc.setdefault("lines", [{}, {}])
            for line in lines:
                for run, since in list(line.items()):
                    if since < now - LINE_KEEP_MS:
                        del line[run]
            if verdict.outcome == "denied":
                mine = lines[0 if under_way else 1]
                mine.setdefault(run_id, now)
                order = sorted(mine, key=lambda r: (mine[r], r))
                place = order.index(run_id) + (0 if under_way else len(lines[0]))
                return Admission(verdict, place, now)
            assert verdict.tats is not None
            for rate, tat in zip(rates, verdict.tats, strict=True):
                tats[rate.unit] = tat
            for line in lines:
                line.pop(run_id, None)
            if verdict.outcome == "go":
                _went(sent, rates, sent_after(went, costs, rates, now))
            tokens = sum(int(c) for r, c in zip(rates, costs, strict=True) if r.unit == "tokens")
            _count(doc, now, 1, tokens)
            if verdict.outcome == "reserved":
                at = now + verdict.wait_ms
                doc.setdefault("reservations", {})[f"{run_id}:{next_seq}"] = [at, at + LINE_KEEP_MS]
            return Admission(verdict, 0, now)

    def settle(self, key: str, delta_tokens: float, rate: Rate) -> None:
        now = self._clock()
        with self._documents(f"limit:{key}") as docs:
            doc = docs[f"limit:{key}"]
            for tats in (doc.setdefault("tats", {}), doc.setdefault("sent", {})):
                if "tokens" in tats:
                    tats["tokens"] = corrected_tat(tats["tokens"], delta_tokens, rate, now)
            _count(doc, now, 0, int(delta_tokens))

    def block(self, key: str, for_ms: float) -> None:
        now = self._clock()
        with self._documents(f"limit:{key}") as docs:
            doc = docs[f"limit:{key}"]
            doc["blocked_until"] = max(doc.get("blocked_until", 0.0), now + for_ms)

    def acquire(self, cap_key: str, run_id: str, cap: int) -> Place:
        now = self._clock()
        with self._documents(f"cap:{cap_key}", "known") as docs:
            doc = docs[f"cap:{cap_key}"]
            docs["known"].setdefault("caps", {})[cap_key] = 1
            holders: list[str] = doc.setdefault("holders", [])
            line: dict[str, float] = doc.setdefault("line", {})
            if run_id in holders:
                return Place(True, 0, ())
            line.setdefault(run_id, now)
            order = sorted(line, key=lambda r: (line[r], r))
            place = order.index(run_id)
            free = cap - len(holders)
            if place < free:
                del line[run_id]
                holders.append(run_id)
                return Place(True, 0, ())
            return Place(False, place - max(0, free), tuple(holders[:50]))

    def release(self, cap_key: str, run_id: str, cap: int) -> list[str]:
        with self._documents(f"cap:{cap_key}") as docs:
            doc = docs[f"cap:{cap_key}"]
            holders: list[str] = doc.setdefault("holders", [])
            line: dict[str, float] = doc.setdefault("line", {})
            if run_id in holders:
                holders.remove(run_id)
            line.pop(run_id, None)
            handed = []
            for run in sorted(line, key=lambda r: (line[r], r)):
                if len(holders) >= cap:
                    break
                del line[run]
                holders.append(run)
                handed.append(run)
            return handed

    def use(self, key: str) -> LimitUse:
        now = self._clock()
        with self._documents(f"limit:{key}") as docs:
            doc = docs[f"limit:{key}"]
            this = doc.get("counts", {}).get(str(minute_of(now)), [0, 0])
            ahead = {u: max(0.0, t - now) / 1000 for u, t in doc.get("tats", {}).items()}
            lines = doc.get("lines", [{}, {}])
            blocked = max(0.0, doc.get("blocked_until", 0.0) - now) / 1000
            return LimitUse(key, this[0], this[1], ahead, blocked, (len(lines[0]), len(lines[1])))

    def cap_use(self, cap_key: str) -> CapUse:
        with self._documents(f"cap:{cap_key}") as docs:
            doc = docs[f"cap:{cap_key}"]
            line = doc.get("line", {})
            order = tuple(sorted(line, key=lambda r: (line[r], r)))
            return CapUse(cap_key, tuple(doc.get("holders", ())), order)

    def overrides(self) -> dict[str, dict[str, Any]]:
        return self._run_time("limits")

    def set_override(self, key: str, values: dict[str, Any] | None) -> None:
        self._set_run_time("limits", key, None if values is None else checked_run_time(values))

    def cap_overrides(self) -> dict[str, int]:
        return self._run_time("caps")

    def set_cap_override(self, cap_key: str, cap: int | None) -> None:
        self._set_run_time("caps", cap_key, cap)

    def _run_time(self, kind: str) -> dict[str, Any]:
        with self._documents("config") as docs:
            return dict(docs["config"].get(kind, {}))

    def _set_run_time(self, kind: str, key: str, value: Any) -> None:
        """Set (``None``: remove) a run-time value of ``kind``."""
        with self._documents("config") as docs:
            table = docs["config"].setdefault(kind, {})
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value

    def known(self) -> tuple[list[str], list[str]]:
        with self._documents("known", "config") as docs:
            known, config = docs["known"], docs["config"]
            return (
                sorted({*known.get("limits", {}), *config.get("limits", {})}),
                sorted({*known.get("caps", {}), *config.get("caps", {})}),
            )

    def note_key(self, key: str) -> None:
        with self._documents("known") as docs:
            docs["known"].setdefault("limits", {})[key] = 1


def _take_reservation(
    doc: dict[str, Any], name: str, room: tuple[float, str | None], now: float
) -> Verdict | None:
    """The verdict on a reservation made earlier for this (run, seq); None if there is none.

    ``room``: when the calls that went leave room for this one (:func:`room_at`). A
    reservation come late waits for it, moved to that time, rather than go in a bunch.
    """
    reservations = doc.setdefault("reservations", {})
    for other, (_, expires) in list(reservations.items()):
        if expires < now:
            del reservations[other]
    mine = reservations.pop(name, None)
    if mine is None:
        return None
    at = mine[0] if mine[0] - now > RESERVATION_EARLY_MS else room[0]
    if at - now <= RESERVATION_EARLY_MS:
        return Verdict("go", 0.0, None, "reserved")
    # A timer that fired early, or one late behind calls that went: it comes back at its time
    reservations[name] = [at, max(mine[1], at + LINE_KEEP_MS)]
    return Verdict("reserved", at - now, None, "early")


def _went(sent: dict[str, float], rates: Sequence[Rate], tats: Sequence[float]) -> None:
    for rate, tat in zip(rates, tats, strict=True):
        sent[rate.unit] = tat


def _count(doc: dict[str, Any], now: float, requests: int, tokens: int) -> None:
    counts = doc.setdefault("counts", {})
    this = counts.setdefault(str(minute_of(now)), [0, 0])
    this[0] += requests
    this[1] += tokens
    for old in [m for m in counts if int(m) < minute_of(now) - 1]:
        del counts[old]


class MemoryLimitStore(LocalLimitStore):
    """One process's limits (tests, ``memory://`` run stores)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        super().__init__(clock)
        self._docs: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def _documents(self, *names: str) -> Iterator[dict[str, dict[str, Any]]]:
        with self._lock:
            yield {name: self._docs.setdefault(name, {}) for name in names}


class SqliteLimitStore(LocalLimitStore):
    """The embedded default's limits: a SQLite file shared by one machine's processes."""

    def __init__(self, path: Path, clock: Callable[[], float] | None = None) -> None:
        super().__init__(clock)
        self.path = path
        self._local = threading.local()

    def _connection(self) -> sqlite3.Connection:
        import os

        held = getattr(self._local, "connection", None)
        if held is not None and held[0] == os.getpid():
            return held[1]  # type: ignore[no-any-return]
        private_dir(self.path.parent, tighten=False)
        connection = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        enable_wal(connection, patience_s=10)
        private_files(
            self.path, *(self.path.with_name(self.path.name + s) for s in ("-wal", "-shm"))
        )
        connection.execute(
            "CREATE TABLE IF NOT EXISTS limits (name TEXT PRIMARY KEY, doc TEXT NOT NULL)"
        )
        self._local.connection = (os.getpid(), connection)
        return connection

    @contextmanager
    def _documents(self, *names: str) -> Iterator[dict[str, dict[str, Any]]]:
        try:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"limits {self.path}", str(exc)) from exc
        try:
            docs = {}
            for name in names:
                row = db.execute("SELECT doc FROM limits WHERE name = ?", (name,)).fetchone()
                docs[name] = json.loads(row[0]) if row else {}
            yield docs
            for name, doc in docs.items():
                db.execute(
                    "INSERT OR REPLACE INTO limits (name, doc) VALUES (?, ?)",
                    (name, json.dumps(doc, separators=(",", ":"))),
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise


# --- Redis: one Lua script per decision, on the server's clock --------------------


def _lua(name: str) -> str:
    """A limit script, kept beside this module in ``lua/limits/<name>``; read once, at import
    (redis-py sends it by SHA and loads it into a server that does not know it yet)."""
    return (
        resources.files(__package__ or "store").joinpath("lua", "limits", name).read_text("utf-8")
    )


_NOW = _lua("now.lua")
_ADMIT = _NOW + _lua("admit.lua")
_SETTLE = _NOW + _lua("settle.lua")
_BLOCK = _NOW + _lua("block.lua")
_ACQUIRE = _NOW + _lua("acquire.lua")
_RELEASE = _lua("release.lua")


class RedisLimitStore(LimitStore):
    """Limits on the run store's Redis; a limit's keys share one hash slot (``{…}``)."""

    def __init__(self, client: Any, prefix: str = "ratchet") -> None:
        self._client = client
        self._prefix = prefix
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)
        self._block = client.register_script(_BLOCK)
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._config = f"{prefix}:limits:config"
        self._caps = f"{prefix}:limits:caps"
        self._known = f"{prefix}:limits:known"
        self._known_caps = f"{prefix}:limits:known_caps"
        self._registered: set[tuple[str, str]] = set()

    def _k(self, key: str, part: str) -> str:
        return f"{self._prefix}:limit:{{{key}}}:{part}"

    def _c(self, cap_key: str, part: str) -> str:
        return f"{self._prefix}:cap:{{{cap_key}}}:{part}"

    @contextmanager
    def _translated(self) -> Iterator[None]:
        import redis

        try:
            yield
        except redis.RedisError as exc:
            raise StoreUnavailable("limits (redis)", f"{type(exc).__name__}: {exc}") from exc

    def _register(self, set_key: str, key: str) -> None:
        if (set_key, key) not in self._registered:
            self._client.sadd(set_key, key)
            self._registered.add((set_key, key))

    def admit(self, key: str, run_id: str, seq: int, next_seq: int, rates: Sequence[Rate],
              costs: Sequence[float], horizon_ms: float, under_way: bool) -> Admission:  # fmt: skip
        by_unit = {r.unit: (r, c) for r, c in zip(rates, costs, strict=True)}
        rpm = by_unit["requests"][0].per_minute if "requests" in by_unit else 0
        tpm = by_unit["tokens"][0].per_minute if "tokens" in by_unit else 0
        burst_ms = max((r.tolerance_ms for r in rates), default=0.0)
        minute = minute_of(time.time() * 1000)
        keys = [
            self._k(key, "tat:requests"), self._k(key, "tat:tokens"), self._k(key, "blocked"),
            self._k(key, f"res:{run_id}:{seq}"), self._k(key, f"res:{run_id}:{next_seq}"),
            self._k(key, "line:under_way"), self._k(key, "line:new"),
            self._k(key, f"count:requests:{minute}"), self._k(key, f"count:tokens:{minute}"),
            self._k(key, "sent:requests"), self._k(key, "sent:tokens"),
        ]  # fmt: skip
        args = [rpm, tpm, burst_ms, by_unit.get("requests", (None, 1))[1],
                by_unit.get("tokens", (None, 0))[1], horizon_ms, 0 if under_way else 1, run_id,
                LINE_KEEP_MS, RESERVATION_EARLY_MS]  # fmt: skip
        with self._translated():
            self._register(self._known, key)
            outcome, wait, binding, now, place = self._admit(keys=keys, args=args)
        verdict = Verdict(_s(outcome), float(wait), None, _s(binding) or None)  # type: ignore[arg-type]
        return Admission(verdict, int(place), float(now))

    def settle(self, key: str, delta_tokens: float, rate: Rate) -> None:
        minute = minute_of(time.time() * 1000)
        keys = [self._k(key, "tat:tokens"), self._k(key, f"count:tokens:{minute}"),
                self._k(key, "sent:tokens")]  # fmt: skip
        with self._translated():
            self._settle(keys=keys, args=[int(delta_tokens), rate.per_minute])

    def block(self, key: str, for_ms: float) -> None:
        with self._translated():
            self._block(keys=[self._k(key, "blocked")], args=[for_ms])

    def acquire(self, cap_key: str, run_id: str, cap: int) -> Place:
        with self._translated():
            self._register(self._known_caps, cap_key)
            out = self._acquire(
                keys=[self._c(cap_key, "holders"), self._c(cap_key, "line")], args=[run_id, cap]
            )
        return Place(bool(out[0]), int(out[1]), tuple(_s(h) for h in out[2:]))

    def release(self, cap_key: str, run_id: str, cap: int) -> list[str]:
        with self._translated():
            handed = self._release(
                keys=[self._c(cap_key, "holders"), self._c(cap_key, "line")], args=[run_id, cap]
            )
        return [_s(h) for h in handed]

    def use(self, key: str) -> LimitUse:
        minute = minute_of(time.time() * 1000)
        pipe = self._client.pipeline(transaction=False)
        pipe.time()
        for part in ("tat:requests", "tat:tokens", "blocked", f"count:requests:{minute}",
                     f"count:tokens:{minute}"):  # fmt: skip
            pipe.get(self._k(key, part))
        pipe.zcard(self._k(key, "line:under_way"))
        pipe.zcard(self._k(key, "line:new"))
        with self._translated():
            (secs, micros), tr, tt, blocked, cr, ct, w0, w1 = pipe.execute()
        now = secs * 1000 + micros / 1000
        ahead = {u: max(0.0, float(v) - now) / 1000 for u, v in (("requests", tr), ("tokens", tt))
                 if v is not None}  # fmt: skip
        blocked_s = max(0.0, float(blocked) - now) / 1000 if blocked else 0.0
        return LimitUse(key, int(cr or 0), int(ct or 0), ahead, blocked_s, (int(w0), int(w1)))

    def cap_use(self, cap_key: str) -> CapUse:
        with self._translated():
            holders = sorted(_s(h) for h in self._client.smembers(self._c(cap_key, "holders")))
            line = [_s(r) for r in self._client.zrange(self._c(cap_key, "line"), 0, -1)]
        return CapUse(cap_key, tuple(holders), tuple(line))

    def overrides(self) -> dict[str, dict[str, Any]]:
        with self._translated():
            raw = self._client.hgetall(self._config)
        return {_s(k): json.loads(v) for k, v in raw.items()}

    def set_override(self, key: str, values: dict[str, Any] | None) -> None:
        encoded = None if values is None else json.dumps(checked_run_time(values), sort_keys=True)
        self._set_run_time(self._config, key, encoded)

    def cap_overrides(self) -> dict[str, int]:
        with self._translated():
            raw = self._client.hgetall(self._caps)
        return {_s(k): int(v) for k, v in raw.items()}

    def set_cap_override(self, cap_key: str, cap: int | None) -> None:
        self._set_run_time(self._caps, cap_key, cap)

    def _set_run_time(self, table: str, key: str, value: str | int | None) -> None:
        """Set (``None``: remove) ``key`` in hash ``table``."""
        with self._translated():
            if value is None:
                self._client.hdel(table, key)
            else:
                self._client.hset(table, key, value)

    def known(self) -> tuple[list[str], list[str]]:
        with self._translated():
            pipe = self._client.pipeline(transaction=False)
            for name in (self._known, self._known_caps):
                pipe.smembers(name)
            pipe.hkeys(self._config)
            pipe.hkeys(self._caps)
            used, used_caps, set_now, caps_now = pipe.execute()
        limits = sorted({_s(k) for k in used} | {_s(k) for k in set_now})
        caps = sorted({_s(k) for k in used_caps} | {_s(k) for k in caps_now})
        return limits, caps

    def held_off_s(self, key: str) -> float:
        pipe = self._client.pipeline(transaction=False)
        pipe.time()
        pipe.get(self._k(key, "blocked"))
        with self._translated():
            (secs, micros), blocked = pipe.execute()
        return max(0.0, float(blocked) - (secs * 1000 + micros / 1000)) / 1000 if blocked else 0.0

    def note_key(self, key: str) -> None:
        with self._translated():
            self._register(self._known, key)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def open_limit_store(runs: Any, redis_prefix: str = "ratchet") -> LimitStore:
    """The limit store beside run store ``runs``: its Redis, a SQLite file beside it, or memory."""
    import sys

    # Looked up, not imported: a run store of a backend never imported is not of it, and
    # importing redis-py costs what the embedded default should not pay (and more, with
    # opentelemetry installed, which redis-py then loads).
    redis_backend = sys.modules.get("store.runs.redis")
    sqlite_backend = sys.modules.get("store.runs.sqlite")
    if redis_backend is not None and isinstance(runs, redis_backend.RedisRunStore):
        return RedisLimitStore(runs._client, redis_prefix)
    if sqlite_backend is not None and isinstance(runs, sqlite_backend.SqliteRunStore):
        path = Path(runs.path)
        return SqliteLimitStore(path.with_name(path.stem + ".limits.sqlite3"))
    return MemoryLimitStore()


__all__ = [
    "Admission",
    "CapUse",
    "LimitStore",
    "LimitUse",
    "MemoryLimitStore",
    "Place",
    "RedisLimitStore",
    "SqliteLimitStore",
    "open_limit_store",
]
