"""Named points in a turn where a test can end the process, as a crash would.

Arm one with ``RATCHET_FAILPOINT=<name>`` (any turn) or ``<name>@<n>`` (only
when the run's count of model calls, the one under way included, is ``n``:
1-based); the process then calls ``os._exit(137)`` at that point — no cleanup,
no ack, like SIGKILL.
Armed, a :class:`FailpointObserver` is on every context's list of observers
(tasks/observers.py, tasks/context.py), whose ``reached`` hook the turn calls at each
point, exactly where the point stands; unarmed, no code of this module runs in a turn.

With ``RATCHET_FAILPOINT_HOLD=<path>`` as well, the armed point does not end the
process: while ``<path>`` exists the turn waits there, then goes on (no file: it
goes on at once). A test holds a turn at a point to act on the world around it —
cut the host's network, say — and lets it go by removing the file.

Points, in the order a turn passes them:

- ``model.response.received``      the model answered; nothing recorded yet
- ``model.response.checkpointed``  the answer is in the events (with the ``tool.requested``
                                   of its calls if all are idempotent), and in the snapshot
                                   unless the turn goes on to run its calls
- ``tool.requested``               the call is journaled as requested; not run yet
- ``tool.completed``               the tool ran; its outcome is not journaled yet
- ``child.created``                a `run_child` call's child run is recorded; not enqueued
- ``child.enqueued``               the child's first turn is on the broker; parent not suspended
- ``snapshot.before_save``         the turn's last checkpoint is made and not written (apart
                                   from the snapshot store: its events are appended)
- ``snapshot.after_save``          the snapshot is saved
- ``turn.ended``                   the turn's last checkpoint is saved, the lease released;
                                   the next turn is not sent yet (unless it went with that
                                   checkpoint: broker and stores on one Redis)
- ``turn.enqueued``                the next turn is on the broker; the lease is released
"""

from __future__ import annotations

import os
import sys
import time

from runtime.errors import ConfigInvalid
from tasks.observers import Observer

POINTS = (
    "model.response.received",
    "model.response.checkpointed",
    "tool.requested",
    "tool.completed",
    "child.created",
    "child.enqueued",
    "snapshot.before_save",
    "snapshot.after_save",
    "turn.ended",
    "turn.enqueued",
)


def _parse(value: str | None) -> tuple[str, int | None] | None:
    if not value:
        return None
    name, _, model_calls = value.partition("@")
    if name not in POINTS or (model_calls and not model_calls.isdigit()):
        raise ConfigInvalid(
            "RATCHET_FAILPOINT",
            f"RATCHET_FAILPOINT={value[:80]!r} is not POINT or POINT@N; give one of "
            f"{', '.join(POINTS)}, or unset it",
        )
    return name, int(model_calls) if model_calls else None


_given = os.environ.get("RATCHET_FAILPOINT")
try:
    _armed = _parse(_given)
except ConfigInvalid:
    # Raised by check(), from make_app: at import it would be a traceback from Celery's
    # app loader instead of the one line every other bad setting is.
    _armed = None
_hold = os.environ.get("RATCHET_FAILPOINT_HOLD") or None


def check() -> None:
    """Raise ConfigInvalid if ``RATCHET_FAILPOINT`` is set but names no point."""
    _parse(_given)


def armed() -> bool:
    """Whether ``RATCHET_FAILPOINT`` armed a point in this process (read at import)."""
    return _armed is not None


class FailpointObserver(Observer):
    """Ends the process (or holds the turn) at the armed point: :func:`hit`."""

    def reached(self, point: str, model_calls: int) -> None:
        hit(point, model_calls)


def hit(name: str, model_calls: int) -> None:
    """End the process here if this point is armed (at ``model_calls``, if one was given).

    With a hold file named, wait here while it exists instead.
    """
    if _armed is None:
        return
    point, at = _armed
    if point == name and (at is None or at == model_calls):
        if _hold is not None:
            _hold_while_present(_hold, name, model_calls)
            return
        sys.stderr.write(f"ratchet failpoint {name} hit at turn {model_calls}: exiting\n")
        sys.stderr.flush()
        os._exit(137)


def _hold_while_present(path: str, name: str, model_calls: int) -> None:
    if not os.path.exists(path):
        return
    sys.stderr.write(
        f"ratchet failpoint {name} hit at turn {model_calls}: holding while {path} exists\n"
    )
    sys.stderr.flush()
    while os.path.exists(path):
        time.sleep(0.01)
    sys.stderr.write(f"ratchet failpoint {name} released at turn {model_calls}\n")
    sys.stderr.flush()
