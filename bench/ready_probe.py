"""Loaded into a bench's workers (``celery -A worker worker -I bench.ready_probe``): appends
``<event> <unix time>`` lines to ``$RATCHET_BENCH_READY_FILE`` — ``loaded`` when Celery
imports this module (ratchet and Celery imported, the app configured), ``init`` at the end
of ``worker_init`` (ratchet's start-up checks are connected before this handler, so they
are done) and ``ready`` at ``worker_ready`` (pool started, consuming) — so a bench can
tell how long a worker takes to start, and where the time goes."""

from __future__ import annotations

import os
import time
from typing import Any

from celery.signals import worker_init, worker_ready


def _note(event: str) -> None:
    path = os.environ.get("RATCHET_BENCH_READY_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as ready:
            ready.write(f"{event} {time.time():.3f} {os.getpid()}\n")


_note("loaded")


@worker_init.connect
def _after_checks(**_: Any) -> None:
    _note("init")


@worker_ready.connect
def _record_ready(**_: Any) -> None:
    _note("ready")
