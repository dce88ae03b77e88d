"""The Celery app (``celery -A worker worker``), settings, the Python API and the CLI."""

from worker.app import app

__all__ = ["app"]
