"""Where the fleet's rate limits and concurrency caps keep their state.

One store per deployment, beside the run store: the Redis the run store uses
(every decision one Lua script, kept in ``limits/lua/``, atomic across workers and
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

The contract (:class:`LimitStore`) is here; the backends are beside it: ``local.py`` (the
arithmetic in Python, on documents: the base of ``memory.py`` and ``sqlite.py``) and
``redis.py`` (a Lua script per decision, ``lua/``), as ``store/runs/`` and
``store/snapshots/`` keep theirs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from runtime.limits import Rate, Verdict

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


__all__ = [
    "LINE_KEEP_MS",
    "RESERVATION_EARLY_MS",
    "Admission",
    "CapUse",
    "LimitStore",
    "LimitUse",
    "Place",
    "minute_of",
]
