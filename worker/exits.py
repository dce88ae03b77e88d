"""The ``ratchet`` command's exit statuses: one table, shared by every command.

Scripts branch on these; the README's "Exit statuses" table lists the same numbers.
"""

from __future__ import annotations

from enum import IntEnum

from runtime.models import RunStatus


class Exit(IntEnum):
    OK = 0
    """Done; with ``--wait``: the run completed."""
    REFUSED = 1
    """An error or a refusal (one line on stderr says why and what to do)."""
    USAGE = 2
    """A bad option or argument, or a bad setting."""
    FAILED = 3
    """``--wait``: the run failed or was cancelled."""
    SUSPENDED = 4
    """``--wait``: the run waits for a person (needs_user_input, blocked, awaiting_approval)."""
    OPERATOR = 5
    """``--wait``: the run is parked or stalled and needs an operator
    (needs_reconciliation, stalled, dead_lettered)."""
    TIMEOUT = 6
    """``--wait``: the run was still live when the wait ended."""
    NOT_ENQUEUED = 7
    """The run was recorded but its first turn could not be queued (the broker is down);
    it starts by itself once the broker is back."""


def wait_exit(status: RunStatus) -> Exit:
    """The exit status of ``--wait`` for a run that ended the wait in ``status``."""
    if status == RunStatus.COMPLETED:
        return Exit.OK
    if status in (RunStatus.FAILED, RunStatus.CANCELLED):
        return Exit.FAILED
    if status.is_suspended:
        return Exit.SUSPENDED
    if status.is_live:
        return Exit.TIMEOUT
    return Exit.OPERATOR
