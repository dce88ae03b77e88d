"""A resume is a writer like a turn: fenced by the seq and its lease, never escaping.

The resume reads the run, classifies it, then records ``run.resumed``. Whatever
happens to the run in between — an operator's cancel, another worker taking the
lease — makes that write refused and the resume end ``fenced``, leaving the run
as the other party left it. The seam is the agent lookup the classification
makes (a Context subclass acts there).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runtime.agent import Agent
from runtime.models import RunStatus
from runtime.recovery import OPERATOR, SWEEPER
from store.runs.memory import MemoryRunStore
from store.snapshots.memory import MemorySnapshotStore
from tasks.context import Context
from tasks.control import cancel
from tasks.recovery import resume
from tasks.settings import Settings
from tasks.start import create_run
from tests.contract.conftest import FakeClock
from tests.helpers import call, drive, memory_context, turn, write_agent

LEASE_S = 60


@dataclass
class Interrupted(Context):
    """A context that runs ``meanwhile`` once, the first time an agent is looked up."""

    meanwhile: list[Callable[[], object]] = field(default_factory=list)

    def agent(
        self,
        path: str | Path,
        while_loading: Callable[[], AbstractContextManager[object]] | None = None,
    ) -> Agent:
        while self.meanwhile:
            self.meanwhile.pop(0)()
        return super().agent(path, while_loading)


@pytest.mark.parametrize("interruption", ["cancel", "takeover"])
def test_a_run_that_changes_while_a_resume_examines_it_is_left_as_the_other_left_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interruption: str
) -> None:
    monkeypatch.setenv("RATCHET_EXAMPLE_LEDGER", str(tmp_path / "ledger"))
    clock = FakeClock()
    ctx = Interrupted(Settings(lease_s=LEASE_S), MemorySnapshotStore(), MemoryRunStore(clock=clock))
    agent = write_agent(tmp_path, [turn("look", call("lookup_order", order_id="B2")), turn("ok")])
    run_id = create_run(ctx, agent, "look").run_id

    def take_over() -> None:
        clock.advance(LEASE_S * 1000 + 1)
        assert ctx.runs.acquire_lease(run_id, "worker-b", LEASE_S)

    # Given an operator's cancel (no lease, only the seq) or another worker's takeover
    # (the lease) lands while the resume is classifying the run
    act = (lambda: cancel(ctx, run_id, "stop")) if interruption == "cancel" else take_over
    ctx.meanwhile.append(act)
    before = ctx.runs.events(run_id)

    # When the resume goes on to record run.resumed
    done = resume(ctx, run_id, OPERATOR)

    # Then it is refused, ends fenced, and the run is as the other party left it
    assert done.outcome == "fenced"
    events = ctx.runs.events(run_id)
    assert "run.resumed" not in [e.type for e in events]
    record = ctx.runs.get(run_id)
    assert record is not None
    if interruption == "cancel":
        assert record.status == RunStatus.CANCELLED and events[-1].type == "run.cancelled"
    else:
        assert events == before
        lease = ctx.runs.lease(run_id)
        assert lease is not None and lease.owner == "worker-b"


def test_a_stale_sweeper_resume_lets_go_of_the_lease_it_took(tmp_path: Path) -> None:
    # Given a run the sweeper saw at seq 1, which has moved on since
    ctx = memory_context()
    agent = write_agent(tmp_path, [turn("Which?", call("request_user_input", prompt="Which?"))])
    run_id = create_run(ctx, agent, "x").run_id
    drive(ctx, run_id)
    # When the sweeper's resume arrives with the seq it saw
    done = resume(ctx, run_id, SWEEPER, seen_seq=1)
    # Then it does nothing, and holds nothing: an operator may act at once
    assert done.outcome == "stale"
    assert ctx.runs.lease(run_id) is None
