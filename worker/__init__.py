"""The Celery app (``celery -A worker worker``), settings, the Python API and the CLI."""

from worker.startup import refuse_if_shadowed

refuse_if_shadowed()  # before worker.app imports ratchet's tasks and stores
from worker.app import app  # noqa: E402

__all__ = ["app"]
