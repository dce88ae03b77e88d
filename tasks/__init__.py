"""Celery tasks, thin: decode the message, call the runtime, persist, enqueue.

Task names are stable (``ratchet.*``): durable messages outlive module paths.
"""

from tasks.children import deliver_run
from tasks.control import cancel_run, continue_run
from tasks.recovery import reconcile_run, resume_run, sweep
from tasks.start import start_run
from tasks.timers import wake_run
from tasks.turn import run_turn

__all__ = [
    "cancel_run",
    "deliver_run",
    "continue_run",
    "reconcile_run",
    "resume_run",
    "run_turn",
    "start_run",
    "sweep",
    "wake_run",
]
