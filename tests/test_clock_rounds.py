"""Each liveness round measures the run store's clock; past the bound no lease is taken.

In this process, on the session's real Redis (``TIME``): this process's wall clock is
moved after the store was opened, through the tests' clock hook
(``store.clock._TEST_OFFSET_MS``, what ``RATCHET_TEST_CLOCK_OFFSET_S`` sets), as a
host whose time sync fails while it runs. The next round finds the skew, and a lease
is refused naming it; once the clocks agree again, leases are taken again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import store.clock
from runtime.errors import ClockSkewed
from store.clock import HOST_CLOCK
from store.runs.memory import MemoryRunStore
from tasks.liveness import beats, claim
from tests.workers import redis_context, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def offset(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(store.clock, "_TEST_OFFSET_MS", 0)
    yield


def test_a_round_that_finds_the_clock_past_the_bound_stops_leases_until_it_agrees(
    redis_url: str, offset: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ctx = redis_context(redis_url, heartbeat_interval_s=0.05, liveness_s=1, max_clock_skew_s=10)
    try:
        # Given a process that takes leases, its clock in step with the store's
        assert claim(ctx, "clock-run-1", "me/1").taken
        reading = ctx.runs.measure_clock()
        assert reading is not None and reading.source == "Redis TIME"
        assert abs(reading.offset_ms) < 1000
        # When its clock jumps 2 minutes ahead while it runs
        monkeypatch.setattr(store.clock, "_TEST_OFFSET_MS", 120_000)

        def refused() -> bool:
            try:
                claim(ctx, "clock-run-2", "me/2")
            except ClockSkewed:
                return True
            return False

        # Then a liveness round finds it, and the next lease is refused naming the skew
        wait_for("a lease is refused for the clock", refused, timeout_s=20)
        with pytest.raises(ClockSkewed, match=r"120\.\d s ahead of the run store's \(Redis TIME\)"):
            claim(ctx, "clock-run-3", "me/3")
        # while the store's clock still decides: this process's view of now is the store's
        assert abs(ctx.runs.clock() - ctx.runs._server_ms()) < 1000  # type: ignore[operator]
        # and once the clocks agree again, leases are taken again
        monkeypatch.setattr(store.clock, "_TEST_OFFSET_MS", 0)
        wait_for("leases are taken again", lambda: not refused(), timeout_s=20)
    finally:
        beats().forget(ctx.runs)
        ctx.close()


def test_a_store_on_this_host_takes_the_hosts_clock_as_its_own() -> None:
    runs = MemoryRunStore()
    reading = runs.measure_clock()
    assert reading is not None and reading == (0, 0, HOST_CLOCK)
