"""ratchet's worker app with a profiler: ``celery -A tests.traced_worker worker -P solo``.

Imported before the worker starts, it sets ``sys.setprofile`` (the main thread, where a
solo pool runs each task) and ``threading.setprofile`` (every thread started after it:
the model and tool calls, the heartbeat), so nothing the turn runs escapes. While the
first ``ratchet.turn`` task of run ``RATCHET_TEST_TRACE_RUN`` runs (``task_prerun`` to
``task_postrun``) it collects the file of every Python function called, and then writes
them, one a line, to the path in ``RATCHET_TEST_TRACE``. Python 3.11 has no ``sys.monitoring``; a
subprocess is what lets the profile be installed before any of the worker's threads.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from celery.signals import task_postrun, task_prerun

from worker.app import app

__all__ = ["app"]

TRACE = Path(os.environ["RATCHET_TEST_TRACE"])
RUN = os.environ["RATCHET_TEST_TRACE_RUN"]
_files: set[str] = set()
_turn: list[str] = []
"""The id of the turn task being traced; empty before it starts and once it has ended."""


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if _turn and event == "call":
        _files.add(frame.f_code.co_filename)


@task_prerun.connect
def _started(
    sender: Any = None, task_id: str = "", kwargs: dict[str, Any] | None = None, **_: Any
) -> None:
    if getattr(sender, "name", None) != "ratchet.turn" or (kwargs or {}).get("run_id") != RUN:
        return
    if not TRACE.exists() and not _turn:
        _turn.append(task_id)


@task_postrun.connect
def _ended(sender: Any = None, task_id: str = "", **_: Any) -> None:
    if _turn == [task_id]:
        _turn.clear()
        TRACE.write_text("".join(f"{name}\n" for name in sorted(_files)))


sys.setprofile(_profile)
threading.setprofile(_profile)
