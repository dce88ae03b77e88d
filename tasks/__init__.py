"""Celery tasks, thin: decode the message, call the runtime, persist, enqueue.

Task names are stable (``ratchet.*``): durable messages outlive module paths.
"""

from tasks.start import start_run
from tasks.turn import run_turn

__all__ = ["run_turn", "start_run"]
