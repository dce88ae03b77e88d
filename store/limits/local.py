"""The limit stores that do the arithmetic in Python, on documents: memory and SQLite."""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

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
