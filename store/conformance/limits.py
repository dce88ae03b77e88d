"""The LimitStore contract: rate limits' schedules, reservations, waiting lines and blocks,
concurrency caps, and the limits operators set at run time.

Limit stores read the real clock (the Redis one the server's), so one test waits out
a reservation's second. Every limit store passes all of it.
"""

from __future__ import annotations

import time

import pytest

from runtime.limits import Rate
from store.limits import LimitStore


class LimitStoreContract:
    """Subclass it as ``Test…`` beside a ``limit_store`` fixture that yields a fresh, empty
    store; pytest runs every test below on it."""

    def test_a_store_admits_a_burst_then_reserves_in_order_and_then_denies(
        self, limit_store: LimitStore
    ) -> None:
        # One every 10 s, one ahead: the slots lie 5 s from the horizon's edge, so a slow
        # store (SQLite's fsyncs on a loaded disk) cannot move one across it.
        rate = Rate("requests", 6, burst_s=10.0)
        answers = []
        for i in range(6):
            admission = limit_store.admit(
                "k", f"run-{i}", 1, 2, [rate], [1], 25_000, under_way=True
            )
            answers.append(admission.verdict.outcome)
        # Two go at once, the next two reserve their slots 10 s and 20 s on, the rest are past 25 s
        assert answers == ["go", "go", "reserved", "reserved", "denied", "denied"]
        # The denied stand in line in the order they asked
        again = [
            limit_store.admit("k", f"run-{i}", 1, 2, [rate], [1], 25_000, True) for i in (5, 4)
        ]
        assert [a.place for a in again] == [1, 0]

    def test_a_reservation_is_taken_by_the_turn_it_was_made_for_and_only_once(
        self, limit_store: LimitStore
    ) -> None:
        rate = Rate("requests", 60, burst_s=0.001)  # one a second
        limit_store.admit("k", "other", 1, 2, [rate], [1], 2000, True)
        made = limit_store.admit("k", "run", 4, 5, [rate], [1], 2000, True)
        assert made.verdict.outcome == "reserved" and 0 < made.verdict.wait_ms <= 1000
        # The re-enqueued turn (seq 5) fired early: told to come back at its time, not charged
        early = limit_store.admit("k", "run", 5, 6, [rate], [1], 0, True)
        assert (early.verdict.outcome, early.verdict.binding) == ("reserved", "early")
        time.sleep(early.verdict.wait_ms / 1000 + 0.01)  # the countdown, run out
        # At its time it finds its reservation and goes without asking the rate
        assert (
            limit_store.admit("k", "run", 5, 6, [rate], [1], 0, True).verdict.binding == "reserved"
        )
        # A duplicate of that turn asks the rate like anyone else
        assert (
            limit_store.admit("k", "run", 5, 6, [rate], [1], 0, True).verdict.binding != "reserved"
        )

    def test_reservations_taken_late_do_not_go_in_a_bunch(self, limit_store: LimitStore) -> None:
        # One each 300 ms, no burst: `a` goes, `b` and `c` reserve the next two slots
        rate = Rate("requests", 200, burst_s=0.001)
        assert limit_store.admit("k", "a", 1, 2, [rate], [1], 1000, True).verdict.outcome == "go"
        for run in ("b", "c"):
            made = limit_store.admit("k", run, 1, 2, [rate], [1], 1000, True)
            assert made.verdict.outcome == "reserved", made
        # Their countdowns fire late, both at once (a stalled worker): past both slots
        time.sleep(0.7)
        late_b = limit_store.admit("k", "b", 2, 3, [rate], [1], 1000, True)
        assert (late_b.verdict.outcome, late_b.verdict.binding) == ("go", "reserved")
        # The provider has just had `b`: `c` waits one spacing behind it, not at once
        late_c = limit_store.admit("k", "c", 2, 3, [rate], [1], 1000, True)
        assert (late_c.verdict.outcome, late_c.verdict.binding) == ("reserved", "early"), late_c
        assert 0 < late_c.verdict.wait_ms <= rate.interval_ms
        # and a new call is scheduled behind what went, not into the slots left unused
        fresh = limit_store.admit("k", "d", 1, 2, [rate], [1], 1000, True)
        assert fresh.verdict.outcome != "go", fresh
        # At its new time `c` goes, on its reservation
        time.sleep(late_c.verdict.wait_ms / 1000 + 0.01)
        assert limit_store.admit("k", "c", 2, 3, [rate], [1], 1000, True).verdict.outcome == "go"

    def test_reservations_after_a_block_are_a_spacing_apart(self, limit_store: LimitStore) -> None:
        # One each 300 ms, no burst; a call went, then a 429 held the key off for a second
        rate = Rate("requests", 200, burst_s=0.001)
        assert limit_store.admit("k", "a", 1, 2, [rate], [1], 5000, True).verdict.outcome == "go"
        limit_store.block("k", 1000)
        b, c = (limit_store.admit("k", run, 1, 2, [rate], [1], 5000, True) for run in "bc")
        assert (b.verdict.outcome, b.verdict.binding) == ("reserved", "blocked"), b
        assert c.verdict.outcome == "reserved", c
        # The first goes as the block ends, the next a spacing later: not both at its end
        at_b, at_c = (x.now_ms + x.verdict.wait_ms for x in (b, c))
        # (a spacing less the burst's tolerance, give or take the 1 ms Redis rounds to)
        assert at_c - at_b >= rate.interval_ms - rate.tolerance_ms - 1, (at_b, at_c)

    def test_new_runs_wait_behind_runs_under_way_in_the_line(self, limit_store: LimitStore) -> None:
        rate = Rate("requests", 60, burst_s=0.001)
        limit_store.admit("k", "first", 1, 2, [rate], [1], 0, True)
        new = limit_store.admit("k", "new", 1, 2, [rate], [1], 0, under_way=False)
        under_way = limit_store.admit("k", "started", 3, 4, [rate], [1], 0, under_way=True)
        assert (
            under_way.place,
            limit_store.admit("k", "new", 1, 2, [rate], [1], 0, False).place,
        ) == (0, 1)
        assert new.verdict.outcome == "denied"

    def test_a_block_holds_every_run_of_the_key_off(self, limit_store: LimitStore) -> None:
        limit_store.block("k", 60_000)
        admission = limit_store.admit("k", "run", 1, 2, [], [], 0, True)
        assert admission.verdict.outcome == "denied" and admission.verdict.binding == "blocked"
        assert 59_000 < admission.verdict.wait_ms <= 60_000
        assert limit_store.use("k").blocked_s > 59

    def test_after_an_idle_spell_a_burst_gets_no_more_than_burst_s_allows(
        self, limit_store: LimitStore
    ) -> None:
        # One each 100 ms, 200 ms ahead: three at once at most, however long it was idle
        rate = Rate("requests", 600, burst_s=0.2)
        first = limit_store.admit("k", "first", 1, 2, [rate], [1], 0, True)
        assert first.verdict.outcome == "go"
        time.sleep(1.0)  # ten intervals unused: capacity past the burst is not saved up
        burst = [limit_store.admit("k", f"run-{i}", 1, 2, [rate], [1], 0, True)
                 for i in range(12)]  # fmt: skip
        went = sum(a.verdict.outcome == "go" for a in burst)
        # The store's own clock: as many more as the rate refilled while the burst asked
        refilled = int((burst[-1].now_ms - burst[0].now_ms) / rate.interval_ms)
        assert 3 <= went <= 3 + refilled, (went, refilled)

    def test_a_run_let_through_leaves_the_waiting_line(self, limit_store: LimitStore) -> None:
        # One each 2 s: the three asks below come well within one interval, however loaded
        # the box (at one each 100 ms a busy CI box let `a` through at once)
        rate = Rate("requests", 30, burst_s=0.001)
        limit_store.admit("k", "first", 1, 2, [rate], [1], 0, True)
        waiting = [limit_store.admit("k", run, 1, 2, [rate], [1], 0, True) for run in ("a", "b")]
        assert [w.verdict.outcome for w in waiting] == ["denied", "denied"]
        assert [w.place for w in waiting] == [0, 1]
        deadline = time.monotonic() + 10
        while limit_store.admit("k", "a", 1, 2, [rate], [1], 0, True).verdict.outcome != "go":
            assert time.monotonic() < deadline, "the rate never let `a` go"
            time.sleep(0.02)
        # `a` went: it is out of the line, and `b` is first in it now
        assert limit_store.use("k").waiting == (1, 0)
        assert limit_store.admit("k", "b", 1, 2, [rate], [1], 0, True).place == 0

    def test_a_shorter_retry_after_does_not_shorten_a_longer_block(
        self, limit_store: LimitStore
    ) -> None:
        limit_store.block("k", 60_000)
        limit_store.block("k", 1_000)
        assert limit_store.use("k").blocked_s > 59
        admission = limit_store.admit("k", "run", 1, 2, [], [], 0, True)
        assert admission.verdict.binding == "blocked" and admission.verdict.wait_ms > 59_000

    def test_a_block_is_read_as_a_hold_off_and_a_key_noted_is_known(
        self, limit_store: LimitStore
    ) -> None:
        assert limit_store.held_off_s("k") == 0
        limit_store.block("k", 60_000)
        assert 59 < limit_store.held_off_s("k") <= 60
        limit_store.note_key("unlimited")
        limit_store.note_key("unlimited")
        assert limit_store.known()[0] == ["unlimited"]

    def test_settling_moves_the_token_schedule_and_the_minute_count(
        self, limit_store: LimitStore
    ) -> None:
        tokens = Rate("tokens", 60_000, burst_s=0.001)  # a token a millisecond
        limit_store.admit("k", "run", 1, 2, [tokens], [5000], 0, True)
        before = limit_store.use("k")
        limit_store.settle("k", -4000, tokens)
        after = limit_store.use("k")
        assert before.tokens_this_minute - after.tokens_this_minute == 4000
        assert before.ahead_s["tokens"] - after.ahead_s["tokens"] == pytest.approx(4, abs=0.2)

    def test_a_cap_admits_n_runs_queues_the_rest_in_order_and_hands_places_on(
        self, limit_store: LimitStore
    ) -> None:
        held = [limit_store.acquire("agent:a", f"r{i}", 2).held for i in range(5)]
        assert held == [True, True, False, False, False]
        assert limit_store.acquire("agent:a", "r0", 2).held  # a holder keeps its place
        waiting = limit_store.acquire("agent:a", "r4", 2)
        assert waiting.place == 2 and set(waiting.holders) == {"r0", "r1"}
        assert limit_store.release("agent:a", "r1", 2) == ["r2"]
        assert limit_store.cap_use("agent:a").holders == ("r0", "r2")
        assert limit_store.cap_use("agent:a").waiting == ("r3", "r4")
        # A cap raised at run time hands every new place on at once, in order
        assert limit_store.release("agent:a", "r0", 4) == ["r3", "r4"]

    def test_overrides_are_kept_and_removed(self, limit_store: LimitStore) -> None:
        limit_store.set_override("k", {"requests_per_minute": 100})
        limit_store.set_cap_override("key:tenant-a", 3)
        assert limit_store.overrides() == {"k": {"requests_per_minute": 100}}
        assert limit_store.cap_overrides() == {"key:tenant-a": 3}
        assert limit_store.known() == (["k"], ["key:tenant-a"])
        limit_store.set_override("k", None)
        limit_store.set_cap_override("key:tenant-a", None)
        assert limit_store.overrides() == {} and limit_store.cap_overrides() == {}
        # A key only ever set at run time is not listed once it is unset
        assert limit_store.known() == ([], [])

    def test_a_key_runs_used_stays_known_after_its_run_time_value_is_unset(
        self, limit_store: LimitStore
    ) -> None:
        limit_store.acquire("agent:a", "r0", 2)
        limit_store.set_cap_override("agent:a", 3)
        limit_store.set_cap_override("agent:a", None)
        assert limit_store.known() == ([], ["agent:a"])
