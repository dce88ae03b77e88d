"""Limits on the run store's Redis: one Lua script per decision (``lua/``), atomic
across workers and hosts, on the Redis server's clock."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from typing import Any, cast

from runtime.errors import StoreUnavailable
from runtime.limits import (
    Rate,
    Verdict,
    checked_run_time,
)
from store.limits import (
    LINE_KEEP_MS,
    RESERVATION_EARLY_MS,
    Admission,
    CapUse,
    LimitStore,
    LimitUse,
    Place,
    minute_of,
)


def _lua(name: str) -> str:
    """A limit script, kept beside this module in ``lua/<name>``; read once, at import
    (redis-py sends it by SHA and loads it into a server that does not know it yet)."""
    return resources.files(__package__ or "store.limits").joinpath("lua", name).read_text("utf-8")


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

    def _timed(self, key: str, fill: Callable[[Any], None]) -> list[Any]:
        """The server's TIME, then the answers to what ``fill`` puts on a pipeline: one round
        trip. On a cluster, whose pipelines take no TIME, the time is asked apart, of the
        node that holds ``key``'s limit (whose clock its scripts read)."""
        import redis.cluster

        pipe = self._client.pipeline(transaction=False)
        if isinstance(self._client, redis.cluster.RedisCluster):
            fill(pipe)
            node = self._client.get_node_from_key(self._k(key, "blocked"))  # type: ignore[no-untyped-call]
            return [self._client.time(target_nodes=node), *pipe.execute()]
        pipe.time()
        fill(pipe)
        return cast("list[Any]", pipe.execute())

    def use(self, key: str) -> LimitUse:
        minute = minute_of(time.time() * 1000)

        def fill(pipe: Any) -> None:
            for part in ("tat:requests", "tat:tokens", "blocked", f"count:requests:{minute}",
                         f"count:tokens:{minute}"):  # fmt: skip
                pipe.get(self._k(key, part))
            pipe.zcard(self._k(key, "line:under_way"))
            pipe.zcard(self._k(key, "line:new"))

        with self._translated():
            (secs, micros), tr, tt, blocked, cr, ct, w0, w1 = self._timed(key, fill)
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
        with self._translated():
            (secs, micros), blocked = self._timed(
                key, lambda pipe: pipe.get(self._k(key, "blocked"))
            )
        return max(0.0, float(blocked) - (secs * 1000 + micros / 1000)) / 1000 if blocked else 0.0

    def note_key(self, key: str) -> None:
        with self._translated():
            self._register(self._known, key)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
