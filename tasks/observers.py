"""The observers of a process's turns: one list, through which failpoints, metrics and
tracing see each committed transition and each step of a turn (dramatiq's middleware,
Temporal's interceptors).

The code that decides and does calls one dispatch per point, and only when the list is
not empty::

    if ctx.observers:
        ctx.observers.reached("tool.requested", model_calls)

so with nothing switched on a turn pays one truth test of an empty tuple per point: no
call, no allocation. The list is :attr:`tasks.context.Context.observers`, built with the
context (``observers_for`` there): ``tasks/failpoints.py`` when ``RATCHET_FAILPOINT``
arms a point, ``tasks/metrics.py`` when ``RATCHET_METRICS_PORT`` is set,
``tasks/tracing.py`` when ``RATCHET_OTEL_EXPORTER`` is.

An observer overrides the hooks it watches; the others do nothing. A hook is called on
the thread of the step it observes, in the order of the list. It must not raise into
the turn, except a failpoint's, whose purpose is to end the process at that exact point.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.actions import TurnOutcome
from runtime.models import Event, RunState, RunStatus


class Observer:
    """The hooks, each a no-op here: an observer overrides those it watches."""

    def committed(
        self, before: RunStatus, after: RunStatus, events: Sequence[Event], state: RunState | None
    ) -> None:
        """``events`` are committed, taking a run from ``before`` to ``after``.

        ``state`` is the run's state after them; None for an ending appended without the
        run's state (``tasks.persistence.append_ending``).
        """

    def reached(self, point: str, model_calls: int) -> None:
        """A turn reached ``point`` (one of ``tasks.failpoints.POINTS``), when the run's count
        of model calls, the one under way included, was ``model_calls``."""

    def checkpointed(self, seconds: float, nbytes: int | None) -> None:
        """A checkpoint was saved in ``seconds``, ``nbytes`` written (None: a finished run's,
        whose snapshot was deleted)."""

    def turn_ended(self, outcome: TurnOutcome, seconds: float, throttled: bool) -> None:
        """A turn task ended after ``seconds``; ``throttled``: it waits on a limit."""

    def throttled(self, reason: str) -> None:
        """A limit put a turn back on the queue (reserved, over_limit, 429, concurrency)."""

    def limit_checked(self, seconds: float, outcome: str) -> None:
        """The limit store answered ``outcome`` in ``seconds``."""

    def live_dropped(self, reason: str, entries: int) -> None:
        """``entries`` live-stream entries were dropped: ``full``, ``store`` or ``too_large``."""

    def purged(self, count: int) -> None:
        """Retention purged ``count`` finished runs."""

    def unreplicated(self, calls: int) -> None:
        """``calls`` tool calls were not started: too few of the run store's replicas
        acknowledged their journal entry (``min_replicas``)."""


class Observers(tuple[Observer, ...]):
    """The list: each hook calls that hook of every observer, in order. Empty, it is false:
    the caller tests it before dispatching, and pays nothing more."""

    __slots__ = ()

    def committed(
        self, before: RunStatus, after: RunStatus, events: Sequence[Event], state: RunState | None
    ) -> None:
        for observer in self:
            observer.committed(before, after, events, state)

    def reached(self, point: str, model_calls: int) -> None:
        for observer in self:
            observer.reached(point, model_calls)

    def checkpointed(self, seconds: float, nbytes: int | None) -> None:
        for observer in self:
            observer.checkpointed(seconds, nbytes)

    def turn_ended(self, outcome: TurnOutcome, seconds: float, throttled: bool) -> None:
        for observer in self:
            observer.turn_ended(outcome, seconds, throttled)

    def throttled(self, reason: str) -> None:
        for observer in self:
            observer.throttled(reason)

    def limit_checked(self, seconds: float, outcome: str) -> None:
        for observer in self:
            observer.limit_checked(seconds, outcome)

    def live_dropped(self, reason: str, entries: int) -> None:
        for observer in self:
            observer.live_dropped(reason, entries)

    def purged(self, count: int) -> None:
        for observer in self:
            observer.purged(count)

    def unreplicated(self, calls: int) -> None:
        for observer in self:
            observer.unreplicated(calls)


NONE = Observers()
"""The empty list: nothing watches."""
