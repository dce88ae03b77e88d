"""What ending a run's course does: the one rule, for the fold and for a run with no state.

An ending is one event of :data:`ENDINGS`. The fold (:mod:`runtime.fsm`) applies it to a
:class:`~runtime.models.RunState`; a cancel, and a run whose events no longer fold, end
the run from its record alone (``tasks.persistence.append_ending``). Both take what the
ending changes from :func:`ended`, so the two cannot drift: tests/test_endings.py holds the
record an ending writes equal to the record of the state the same events fold to.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from runtime.models import Event, RunStatus, Suspension

ENDINGS: dict[str, RunStatus] = {
    "run.completed": RunStatus.COMPLETED,
    "run.failed": RunStatus.FAILED,
    "run.cancelled": RunStatus.CANCELLED,
    # A suspended run that waited longer than its agent's max_suspended_s.
    "run.expired": RunStatus.FAILED,
    "run.parked": RunStatus.NEEDS_RECONCILIATION,
    "run.stalled": RunStatus.STALLED,
    "run.dead_lettered": RunStatus.DEAD_LETTERED,
}
"""Events that end a run's course, with the status each leaves it in: the fold sets it, and
the ``reason`` as the run's error (the ``output`` of ``run.completed``)."""


def ended(
    kind: str, data: dict[str, Any], suspended_ms: int, suspension: Suspension | None
) -> dict[str, Any]:
    """The fields the ending ``kind`` with ``data`` sets, on a run that had suspended
    ``suspended_ms`` and waited for ``suspension``: a ``model_copy`` update, the same on a
    RunState and on a RunRecord (both have these fields).

    A cancel says how long the suspension it ends lasted (``suspended_ms``, as an answer
    does), and that time counts as suspended; a cancel recorded before it said so leaves
    the suspension as it was (old logs fold as they did).
    """
    status = ENDINGS[kind]
    if status == RunStatus.COMPLETED:
        return {"status": status, "output": data.get("output"), "suspension": None}
    changes: dict[str, Any] = {"status": status, "error": data.get("reason")}
    waited = data.get("suspended_ms")
    if kind == "run.cancelled" and waited is not None and suspension is not None:
        changes.update(suspension=None, suspended_ms=suspended_ms + int(waited))
    return changes


class Ending(NamedTuple):
    """A run ended from its record alone: the events to append, and what its record becomes."""

    events: list[Event]
    record_changes: dict[str, Any]
    """A ``model_copy`` update of the run's record: what ``RunRecord.from_state`` derives
    from the state the events fold to."""


def ending(
    kind: str,
    data: dict[str, Any],
    *,
    last_seq: int,
    now_ms: int,
    suspended_ms: int,
    suspension: Suspension | None,
    is_child: bool = False,
    parent_ended: str | None = None,
) -> Ending:
    """End a run whose log ends at ``last_seq`` by the event ``kind`` of :data:`ENDINGS`,
    from what its record holds (``suspended_ms``, ``suspension``), without its state.

    ``parent_ended``: the run is a child whose parent (that id) has ended, so waits for it
    no more: ``run.parent_told`` is recorded with the ending. Otherwise a child
    (``is_child``) that ends stays due, for its parent to be told
    (:func:`runtime.children.awaiting_delivery`).
    """
    events = [Event(seq=last_seq + 1, type=kind, at_ms=now_ms, data=data)]
    if parent_ended is not None:
        told = {"parent": parent_ended, "outcome": "not waiting"}
        events.append(Event(seq=last_seq + 2, type="run.parent_told", at_ms=now_ms, data=told))
    changes = ended(kind, data, suspended_ms, suspension)
    awaits_delivery = is_child and parent_ended is None and ENDINGS[kind].is_terminal
    return Ending(
        events,
        {
            **changes,
            # A record shows a suspension only while the run is suspended, and no ending is.
            "suspension": None,
            "last_seq": events[-1].seq,
            "updated_at_ms": now_ms,
            "due_at_ms": now_ms if awaits_delivery else None,
        },
    )
