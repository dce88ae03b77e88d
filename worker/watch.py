"""Watching a run: its committed events and its live stream (store/live), merged in order.

:func:`watch` yields :class:`Seen` items — a committed event, a piece of the model's
answer as it forms (``model.delta``), an attempt that ended without an answer
(``model.aborted``), a tool's progress (``tool.progress``) — each with the cursor a
reader that reconnects passes back as ``after``: it misses nothing still kept and sees
nothing twice.

The event log is the truth; the live stream is what it does not keep. The rules that
join them:

- An attempt is named by the seq of its ``model.requested`` (``at``) and the provider's
  request number (``attempt``). A delta is yielded only after the event at its ``at``:
  the reader reads the log up to it first.
- An attempt ends **answered** when ``model.responded`` commits; later pieces of it (the
  writer is asynchronous) are dropped, and the event carries the whole answer, so the
  text a reader assembles ends equal to what was journaled (:class:`Assembly`).
- It ends **aborted** when the provider says so (a stream cut off), or when the log moves
  past it unanswered: a retry (``model.retrying``), the next attempt's
  ``model.requested`` (its worker died, or the call timed out), or the run leaving
  ``running``. A later piece of an aborted attempt is dropped, so no attempt's text is
  ever shown twice or mixed into another's.
- A reader that joins late (``after=None``) gets the log from the start, then the
  current attempt's text so far; earlier attempts' pieces are dropped as above.
- A reader says it watches (store/live ``watch``, every few seconds): a model call
  streams only if its run was watched as the call began. A reader that arrives in the
  middle of a call nobody watched sees that answer when it commits, and the next ones
  as they form.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import InvalidOption, StoreError
from runtime.models import FINISHED_STATUSES, Event
from runtime.numbers import finite
from store.live import LiveEntry
from store.runs import RunStore

_CURSOR = re.compile(r"^(0|[1-9][0-9]{0,18})\.([0-9]{1,20}(?:-[0-9]{1,20})?)?(\+?)$")
_BATCH = 500
HOLD_S = 0.5
"""How long an answer waits, at most, for pieces of it still on their way (see _holds)."""
WATCH_S = 10.0
"""How long a reader's word that it watches a run lasts; it says it again every third of it."""
_ENDS_AN_ATTEMPT = frozenset({"model.failed", "run.failed", "run.cancelled", "run.stalled"})
"""Events after which no attempt of the current ``model.requested`` goes on."""


@dataclass(frozen=True)
class Seen:
    """One thing a watcher sees. ``kind``: ``event`` (then ``event`` is set),
    ``model.delta``, ``model.aborted`` or ``tool.progress`` (then ``data`` is the entry),
    or ``idle`` (nothing happened for a while; only when asked for)."""

    cursor: str
    """Pass it back as ``after`` to go on just after this item."""
    kind: str
    data: dict[str, Any] = field(default_factory=dict)
    event: Event | None = None


def parse_watch_cursor(cursor: str) -> tuple[int, str | None, bool]:
    """A cursor :func:`watch` gave: the last event seq seen, the live stream's cursor, and
    whether it was an attempt's end told before the item that follows it (a ``+``)."""
    found = _CURSOR.fullmatch(cursor) if isinstance(cursor, str) else None
    if found is None:
        raise InvalidOption(
            f"--after {str(cursor)[:60]!r} is not a watch cursor (it looks like `12.` or "
            "`12.1733412345678-0`: copy one a watcher printed)"
        )
    return int(found[1]), found[2] or None, found[3] == "+"


@dataclass
class _Attempts:
    """What the reader knows of the model call in flight, from the log and the stream."""

    requested_at: int = 0
    """The seq of the newest ``model.requested`` read."""
    answered: bool = False
    """Whether that request has its ``model.responded``."""
    open: tuple[int, int] | None = None
    """(at, attempt) whose pieces are being shown."""
    shown: str = ""
    """The text of the open attempt's pieces shown so far."""
    closed: set[tuple[int, int]] = field(default_factory=set)

    def behind(self, answer: Event) -> bool:
        """Whether ``answer`` (a ``model.responded``) ends the open attempt while pieces of
        it are still on their way: what was shown is a start of it, but not all of it."""
        content = answer.data.get("content")
        return (
            self.open is not None
            and self.open[0] == self.requested_at
            and isinstance(content, str)
            and len(self.shown) < len(content)
            and content.startswith(self.shown)
        )

    def close(self, reason: str) -> dict[str, Any] | None:
        """The open attempt ends unanswered: what to tell the reader, if one was open."""
        if self.open is None:
            return None
        at, attempt = self.open
        self.closed.add(self.open)
        self.open, self.shown = None, ""
        return {"at": at, "attempt": attempt, "reason": reason}

    def on_event(self, event: Event) -> dict[str, Any] | None:
        if event.type == "model.requested":
            told = self.close("its worker stopped before the answer was recorded; asked again")
            self.requested_at, self.answered = event.seq, False
            return told
        if event.type == "model.retrying":
            at_attempt = (self.requested_at, int(event.data.get("attempt") or 0))
            if self.open == at_attempt:
                return self.close(f"attempt failed: {event.data.get('error') or 'retried'}")
            self.closed.add(at_attempt)
            return None
        if event.type == "model.responded":
            self.answered = True
            if self.open is not None:
                self.closed.add(self.open)
                self.open, self.shown = None, ""
            return None
        if event.type in _ENDS_AN_ATTEMPT:
            return self.close(f"the run went on without it ({event.type})")
        return None

    def on_delta(self, data: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
        """Whether to show this piece, and an attempt it shows to have ended first."""
        at, attempt = _int(data.get("at")), _int(data.get("attempt"))
        key = (at, attempt)
        if (
            key in self.closed
            or at < self.requested_at
            or (self.answered and at == self.requested_at)
        ):
            return False, None
        if "aborted" in data:
            if self.open == key:
                self.open, self.shown = None, ""
            self.closed.add(key)
            return True, None
        told = None
        if self.open is not None and self.open != key:
            if key < self.open:
                return False, None
            told = self.close("a later attempt began")
        self.open = key
        if isinstance(data.get("text"), str):
            self.shown += data["text"]
        return True, told


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def watch(
    runs: RunStore,
    run_id: str,
    after: str | None = None,
    timeout_s: float | None = None,
    until_suspended: bool = False,
    wait_s: float = 0.1,
    idle_s: float | None = None,
) -> Iterator[Seen]:
    """Yield the run's events and live entries in order, until it is finished (or, with
    ``until_suspended``, no longer live), or ``timeout_s`` has passed.

    ``wait_s``: how long one read of the live stream waits for a piece (the most a new
    committed event waits to be seen). A store with no live stream yields events only.
    ``idle_s``: after this long with nothing to yield, yield an ``idle`` item (its cursor
    is where the reader stands), so a caller can give up on a quiet run between items.
    """
    finite("wait_s", wait_s)
    deadline = None if timeout_s is None else time.monotonic() + finite("timeout_s", timeout_s)
    watcher = _Watcher(runs, run_id, after)
    quiet_since = time.monotonic()
    while True:
        for seen in watcher.read(wait_s):
            quiet_since = time.monotonic()
            yield seen
        if watcher.new and watcher.done(until_suspended):
            return
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return
        if idle_s is not None and now - quiet_since >= idle_s:
            quiet_since = now
            yield Seen(watcher.at(), "idle")


class _Watcher:
    def __init__(self, runs: RunStore, run_id: str, after: str | None) -> None:
        self.runs, self.run_id = runs, run_id
        self.seq = 0
        self.cursor: str | None = None
        self.live = runs.live()
        self.attempts = _Attempts()
        self.pending: list[LiveEntry] = []
        self.new = False
        self.log_read_at = 0.0
        self.watched_at = -WATCH_S
        self.holding = False
        self.held_since: float | None = None
        self.told_already = False
        if after is not None:
            seq, cursor, told = parse_watch_cursor(after)
            self._replay(seq, cursor)
            self.told_already = told

    def at(self, told: bool = False) -> str:
        return f"{self.seq}.{self.cursor or ''}{'+' if told else ''}"

    def _replay(self, seq: int, cursor: str | None) -> None:
        """Read the log and the stream up to where the reader stood, showing nothing: what
        it knew there (the attempt in flight) is known again, so what follows is told
        exactly as it would have been."""
        events = [e for e in self.runs.events(self.run_id) if e.seq <= seq]
        if self.live is not None and cursor is not None:
            upto, after = _order(cursor), None
            while True:
                batch = self.live.read(self.run_id, after=after, limit=_BATCH)
                kept = [e for e in batch if _order(e.cursor) <= upto]
                self.pending += kept
                if not batch or len(kept) < len(batch):
                    break
                after = batch[-1].cursor
        for _ in self._merged(events):
            pass
        self.seq, self.cursor, self.pending = seq, cursor, []

    def say_watched(self) -> None:
        """Tell the workers someone watches, so the run's next model calls stream (a store
        that cannot be told costs this reader the pieces, never its events)."""
        now = time.monotonic()
        if self.live is None or now - self.watched_at < WATCH_S / 3:
            return
        self.watched_at = now
        try:
            self.live.watch(self.run_id, WATCH_S)
        except StoreError:
            pass

    def read(self, wait_s: float) -> Iterator[Seen]:
        """What was added to the log and the stream since the last read, merged: each
        live entry comes after the event at its ``at`` and before the events after it.

        While pieces flow, the log is read at most once every ``wait_s`` (and whenever a
        piece names an event not read yet): a run streaming to many readers does not cost
        a log read per piece per reader."""
        self.say_watched()
        if self.live is not None and not self.pending:
            self.pending = self.live.read(self.run_id, after=self.cursor, limit=_BATCH)
        now = time.monotonic()
        events: list[Event] = []
        if (
            not self.pending
            or now - self.log_read_at >= wait_s
            or any(_int(e.data.get("at")) > self.seq for e in self.pending)
        ):
            events = self.runs.events(self.run_id, after_seq=self.seq)
            self.log_read_at = now
        self.new = bool(events)
        if not events and not self.pending:
            if self.live is None:
                time.sleep(wait_s)
            else:
                self.pending = self.live.read(
                    self.run_id, after=self.cursor, limit=_BATCH, block_s=wait_s
                )
        yield from self._merged(events)
        if self.holding and self.live is not None and not self.pending:
            self.pending = self.live.read(
                self.run_id, after=self.cursor, limit=_BATCH, block_s=min(wait_s, HOLD_S / 5)
            )
            self.log_read_at = 0.0  # the held answer is read again at once
            return
        if self.pending and not events and _int(self.pending[0].data.get("at")) > self.seq:
            # A piece of an attempt whose model.requested this reader has not read yet
            # (it is committed before any piece is written): read the log again.
            time.sleep(min(wait_s, 0.005))

    def _merged(self, events: list[Event]) -> Iterator[Seen]:
        self.holding = False
        for event in events:
            while self.pending and _int(self.pending[0].data.get("at")) < event.seq:
                yield from self._entry(self.pending.pop(0))
            if event.type == "model.responded" and self._holds(event):
                return  # its last pieces first: this event and those after it, next read
            yield from self._event(event)
        while self.pending and _int(self.pending[0].data.get("at")) <= self.seq:
            yield from self._entry(self.pending.pop(0))

    def _holds(self, answer: Event) -> bool:
        """Whether to hold ``answer`` back a moment (``HOLD_S`` at most) for the pieces of
        it still on their way: the writer is behind the checkpoint under load, and a piece
        read after its answer is dropped, so without the wait the answer's end would show
        all at once."""
        if not self.attempts.behind(answer):
            self.held_since = None
            return False
        now = time.monotonic()
        if self.held_since is None:
            self.held_since = now
        if now - self.held_since >= HOLD_S:
            self.held_since = None
            return False
        self.holding = True
        return True

    def _event(self, event: Event) -> Iterator[Seen]:
        told = self.attempts.on_event(event)
        if told is not None and not self.told_already:
            yield Seen(self.at(told=True), "model.aborted", _aborted(self.run_id, told))
        self.told_already = False
        self.seq = event.seq
        yield Seen(self.at(), "event", event=event)

    def _entry(self, entry: LiveEntry) -> Iterator[Seen]:
        before = self.at(told=True)
        self.cursor = entry.cursor
        for seen in _shown(entry, self.attempts, self.run_id, self.at()):
            if seen.cursor == "":  # the end of an attempt this entry shows: before it
                if not self.told_already:
                    yield Seen(before, seen.kind, seen.data)
                continue
            yield seen
        self.told_already = False

    def done(self, until_suspended: bool) -> bool:
        record = self.runs.get(self.run_id)
        if record is None or record.last_seq > self.seq:
            return False
        return record.status in FINISHED_STATUSES or (until_suspended and not record.status.is_live)


def _order(cursor: str) -> tuple[int, ...]:
    """A live-stream cursor as something that sorts: ``17`` or Redis's ``1733412345678-0``."""
    return tuple(int(part) for part in cursor.split("-") if part.isdigit())


def _shown(entry: LiveEntry, attempts: _Attempts, run_id: str, at: str) -> Iterator[Seen]:
    data = entry.data
    kind = data.get("kind")
    if kind == "tool.progress":
        yield Seen(at, "tool.progress", data)
        return
    if kind != "model.delta":
        return
    show, told = attempts.on_delta(data)
    if told is not None:
        yield Seen("", "model.aborted", _aborted(run_id, told))  # its cursor: the caller's
    if show and "aborted" in data:
        reason = str(data["aborted"])
        yield Seen(at, "model.aborted", _aborted(run_id, {**_named(data), "reason": reason}))
    elif show:
        yield Seen(at, "model.delta", data)


def _named(data: dict[str, Any]) -> dict[str, Any]:
    return {"at": _int(data.get("at")), "attempt": _int(data.get("attempt"))}


def _aborted(run_id: str, told: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "model.aborted", "run": run_id, **told}


class Assembly:
    """The text of the answer forming, as a watcher shows it: pieces as they come, then
    what the journaled answer adds when ``model.responded`` commits, so the text shown
    for a model call ends equal to the journaled answer, each part once.

    Only if the stream dropped a piece (its writer full or its store down) does the shown
    text differ from the start of the answer: then the whole answer follows on a new line.
    """

    def __init__(self) -> None:
        self.shown = ""
        self.answers: list[str] = []
        """Each answered model call's text as shown in the end (pieces, then the rest)."""

    def add(self, seen: Seen) -> str:
        """The text to show for ``seen`` (empty for most items)."""
        if seen.kind == "model.delta":
            piece = seen.data.get("text")
            if isinstance(piece, str):
                self.shown += piece
                return piece
            return ""
        if seen.kind == "model.aborted":
            self.shown = ""
            return ""
        if seen.kind == "event" and seen.event is not None:
            if seen.event.type == "model.requested":
                self.shown = ""
            elif seen.event.type == "model.responded":
                answer = str(seen.event.data.get("content") or "")
                shown, self.shown = self.shown, ""
                if answer.startswith(shown):
                    self.answers.append(answer)
                    return answer[len(shown) :]
                self.answers.append(shown + "\n" + answer)
                return "\n" + answer
        return ""
