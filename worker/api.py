"""The Python API applications import; the ``ratchet`` CLI is a thin layer over it.

::

    from worker.api import Ratchet

    ratchet = Ratchet()                       # settings from the environment
    run_id = ratchet.start("examples/refund-desk.toml", "Refund order B2")
    record = ratchet.wait(run_id, timeout_s=60)
    print(record.status, record.output)
    for event in ratchet.events(run_id):
        print(event.seq, event.type)
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator
from pathlib import Path

from runtime.errors import RunNotFound
from runtime.models import Event, RunStatus, validate_run_id
from store.runs import RunRecord
from tasks.context import Context, get_context
from tasks.start import create_run
from tasks.turn import run_turn


class Ratchet:
    """Start runs and read them. Every method validates ids at the edge."""

    def __init__(self, context: Context | None = None) -> None:
        self.ctx = context or get_context()

    def start(self, agent_file: str | Path, text: str, run_id: str | None = None) -> str:
        """Create a run and enqueue its first turn; returns the run id.

        The agent file and input are checked here, so a bad one is refused
        before anything is queued (AgentFileError, InvalidInput).
        """
        state = create_run(self.ctx, agent_file, text, run_id)
        run_turn.apply_async((state.run_id, state.seq))
        return state.run_id

    def get(self, run_id: str) -> RunRecord:
        """The run's record; RunNotFound if there is none."""
        record = self.ctx.runs.get(validate_run_id(run_id))
        if record is None:
            raise RunNotFound(run_id)
        return record

    def list(self, status: RunStatus | None = None, limit: int = 100) -> list[RunRecord]:
        return self.ctx.runs.list(status, limit)

    def events(self, run_id: str, after_seq: int = 0) -> builtins.list[Event]:
        self.get(run_id)
        return self.ctx.runs.events(run_id, after_seq)

    def follow(
        self, run_id: str, poll_s: float = 0.05, timeout_s: float | None = None
    ) -> Iterator[Event]:
        """Yield the run's events as they are appended, until it stops being live."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seq = 0
        while True:
            for event in self.ctx.runs.events(run_id, after_seq=seq):
                seq = event.seq
                yield event
            record = self.get(run_id)
            if not record.status.is_live and record.last_seq <= seq:
                return
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(poll_s)

    def wait(self, run_id: str, timeout_s: float = 300, poll_s: float = 0.05) -> RunRecord:
        """Poll until the run is no longer live (finished, suspended or parked), or time out."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.get(run_id)
            if not record.status.is_live or time.monotonic() > deadline:
                return record
            time.sleep(poll_s)

    def snapshot_document(self, run_id: str) -> bytes | None:
        """The run's snapshot exactly as stored, or None (finished runs have none)."""
        self.get(run_id)
        return self.ctx.snapshots.load_document(run_id)
