"""Loaded into a bench's workers (``celery -A worker worker -I bench.ready_probe``): appends
``<hostname> <unix time>`` to ``$RATCHET_BENCH_READY_FILE`` when the worker is ready, so a
bench can measure how long a worker takes to start (its start-up checks included)."""

from __future__ import annotations

import os
import time
from typing import Any

from celery.signals import worker_ready


@worker_ready.connect
def _record_ready(sender: Any = None, **_: Any) -> None:
    path = os.environ.get("RATCHET_BENCH_READY_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as ready:
            ready.write(f"{getattr(sender, 'hostname', '?')} {time.time():.3f}\n")
