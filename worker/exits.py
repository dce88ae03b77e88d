"""The ``ratchet`` command's exit statuses: one table, shared by every command.

Scripts branch on these. :data:`MEANINGS` is the README's "Exit statuses" table, row
for row (tests/test_exit_statuses.py holds the README to it), and :func:`exit_for` is
the status every command (``ratchet console`` too) exits with on an error it refuses:
:data:`USAGE_ERRORS` exit 2, like click's own usage errors, any other error 1.
"""

from __future__ import annotations

from enum import IntEnum

from runtime.errors import (
    AgentFileError,
    ConfigInvalid,
    ExtraMissing,
    InvalidContinuation,
    InvalidInput,
    InvalidOption,
    InvalidRunId,
    StoreUrlInvalid,
    ToolError,
)
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


MEANINGS: dict[Exit, str] = {
    Exit.OK: "done; with `--wait`: the run completed",
    Exit.REFUSED: "an error or a refusal (one line on stderr says why)",
    Exit.USAGE: (
        "a bad option, argument or setting: one line names the variable (or option) and the "
        "fix — an option or argument that does not parse or combine, a run id that is not "
        "one, an agent file that cannot be loaded, a setting refused, an extra not installed; "
        "also a worker or beat (`celery -A worker …`) that refuses to start"
    ),
    Exit.FAILED: "`--wait`: the run failed or was cancelled",
    Exit.SUSPENDED: (
        "`--wait`: the run waits for a person (needs_user_input, blocked, awaiting_approval)"
    ),
    Exit.OPERATOR: (
        "`--wait`: the run is parked or stalled and needs an operator (needs_reconciliation, "
        "stalled, dead_lettered)"
    ),
    Exit.TIMEOUT: (
        "a wait timed out: `--wait` with the run still live, or `runs resume` that no worker took"
    ),
    Exit.NOT_ENQUEUED: (
        "`runs start`: the run is recorded (its id is printed) but the broker could not take "
        "its first turn; it starts by itself once the broker is back (the crash sweeper, "
        "`celery -A worker beat`, queues it) — `ratchet runs cancel RUN` stops it"
    ),
}
"""The README's exit-status table: status → meaning, every status once."""

USAGE_ERRORS: tuple[type[Exception], ...] = (
    InvalidOption,
    InvalidRunId,
    InvalidInput,
    InvalidContinuation,
    AgentFileError,
    ToolError,
    ConfigInvalid,
    StoreUrlInvalid,
    ExtraMissing,
)
"""The errors that are a bad option, argument or setting: exit status 2."""


def exit_for(error: BaseException) -> Exit:
    """The status a command exits with when it refuses with ``error``."""
    return Exit.USAGE if isinstance(error, USAGE_ERRORS) else Exit.REFUSED
