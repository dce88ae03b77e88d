"""Quiet sweeps: Celery's lines about a ``ratchet.sweep`` that found nothing go to DEBUG.

Beat sends the sweeper every ``RATCHET_SWEEP_INTERVAL_S`` (1 s): Celery's worker logs
two INFO lines a task (received, succeeded) and beat one a send, so an idle fleet
would log about three lines a second saying nothing happened. :func:`quiet_sweeps`
puts a filter on Celery's loggers that makes those DEBUG; ratchet's own app
(:mod:`worker.observe`) and a team's app (:func:`tasks.install`) both install it.
"""

from __future__ import annotations

import logging

LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery.beat", "celery.worker.request")


class QuietSweeps(logging.Filter):
    """Celery's lines about a sweep that found nothing: DEBUG, not INFO.

    The worker's received/succeeded lines (succeeded stays INFO when it found
    runs), its "Discarding revoked task" of a sweep that expired unrun (the next one
    was due), and beat's "Sending due task ratchet.sweep" every interval.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        data = getattr(record, "data", None)
        if record.name in ("celery.beat", "celery.worker.request"):
            # Beat's "Sending due task", and a sweep discarded unrun because the next one
            # was due (its message expires after one interval): nothing happened either.
            if not (isinstance(record.args, tuple) and "ratchet.sweep" in record.args):
                return True
        elif not isinstance(data, dict) or data.get("name") != "ratchet.sweep":
            return True
        elif "return_value" in data and str(data["return_value"]) not in ("0", "None"):
            return True
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_quiet = QuietSweeps()


def quiet_sweeps() -> None:
    """Install the filter on Celery's loggers in this process (once; idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _quiet not in logger.filters:
            logger.addFilter(_quiet)
