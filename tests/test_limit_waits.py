"""When a model call the limits hold waits again, stalls the run, or rechecks its cap
(runtime/limits.py ``rate_wait`` and ``cap_wait``): pure, the clock passed in."""

from __future__ import annotations

import pytest

from runtime.limits import CAP_RECHECK_S, cap_wait, rate_wait

MINUTE_S = 60.0


@pytest.mark.parametrize(
    ("now_ms", "since_ms", "wait_ms", "stalls"),
    [
        (10_000, None, 1_000, False),  # a first wait, well within max_wait_s
        (10_000, None, 60_000, False),  # a first wait of exactly max_wait_s
        (10_000, None, 60_001, True),  # a first wait already past it
        (70_000, 10_000, 0, False),  # waited exactly max_wait_s, nothing more to wait
        (70_000, 10_000, 1, True),  # one ms more would pass it
        (40_000, 10_000, 29_000, False),  # waited half, the rest fits
        (40_000, 10_000, 31_000, True),  # waited half, the rest does not fit
    ],
)
def test_a_held_call_waits_again_until_it_would_pass_max_wait_s_in_a_row_then_stalls(
    now_ms: int, since_ms: int | None, wait_ms: float, stalls: bool
) -> None:
    wait = rate_wait("r1", 3, "k", "over_limit", wait_ms, "requests", now_ms, since_ms, MINUTE_S)

    assert wait.stalls is stalls
    throttled = wait.events[0]
    assert throttled[0] == "run.throttled"
    assert throttled[1]["since_ms"] == (since_ms if since_ms is not None else now_ms)
    assert throttled[1]["until_ms"] == now_ms + wait_ms
    if stalls:
        assert wait.countdown_s == 0.0 and [kind for kind, _ in wait.events][1:] == ["run.stalled"]
    else:
        assert wait.countdown_s == wait_ms / 1000 and len(wait.events) == 1


@pytest.mark.parametrize(
    ("binding", "refused", "says"),
    [
        ("blocked", True, "held by the provider's 429 (Retry-After)"),
        ("requests", False, "held by its requests limit"),
        ("tokens", False, "held by its tokens limit"),
    ],
)
def test_a_stall_names_the_limit_that_held_the_run_and_how_to_go_on(
    binding: str, refused: bool, says: str
) -> None:
    wait = rate_wait("r1", 2, "k", "429", 120_000, binding, 50_000, 5_000, MINUTE_S, refused)

    assert wait.stalls
    reason = wait.events[-1][1]["reason"]
    assert says in reason and "waited 45 s and would wait 120 s more" in reason
    assert "max_wait_s=60;" in reason
    assert "`ratchet limits set k ...`" in reason and "`ratchet runs resume r1`" in reason
    assert wait.events[0][1].get("refused", False) is refused


def test_a_throttled_event_says_what_held_the_call_and_until_when() -> None:
    wait = rate_wait("r1", 4, "k", "reserved", 1234.5, "tokens", 1_000, None, MINUTE_S)

    assert wait.events == [
        (
            "run.throttled",
            {
                "turn": 4,
                "reason": "reserved",
                "limit": "k",
                "binding": "tokens",
                "wait_s": 1.234,
                "until_ms": 2_234,
                "since_ms": 1_000,
            },
        )
    ]


@pytest.mark.parametrize("ahead", [0, 1, 500])
def test_a_run_short_of_a_cap_place_rechecks_later_and_never_stalls(ahead: int) -> None:
    wait = cap_wait(7, "agent:a", 2, ahead, 1_000)

    assert not wait.stalls and wait.countdown_s == CAP_RECHECK_S
    assert wait.events == [
        (
            "run.throttled",
            {
                "turn": 7,
                "reason": "concurrency",
                "limit": "agent:a",
                "cap": 2,
                "ahead": ahead,
                "wait_s": CAP_RECHECK_S,
                "until_ms": 1_000 + int(CAP_RECHECK_S * 1000),
            },
        )
    ]
