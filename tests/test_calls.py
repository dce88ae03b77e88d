"""The caller threads a turn runs its model and tool calls on (tasks/threads.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from tasks.threads import CallTimedOut, bounded, start


def test_a_call_returns_its_value_or_raises_its_exception_on_the_waiting_thread() -> None:
    callers = {threading.get_ident()}

    def where() -> int:
        return threading.get_ident()

    def fails() -> None:
        raise KeyError("the tool's own error")

    # A call runs on a caller thread, and its value comes back
    ran_on = bounded(where, 5.0, "model call")
    assert ran_on not in callers
    # Its exception is raised where the result is taken, as it was raised
    with pytest.raises(KeyError, match="the tool's own error"):
        bounded(fails, 5.0, "tool fails")
    # And an idle caller thread is used again for the next call
    assert bounded(where, 5.0, "model call") == ran_on


def test_a_call_that_outlives_its_timeout_is_abandoned_and_the_next_call_still_runs() -> None:
    release = threading.Event()
    returned = threading.Event()

    def hangs() -> str:
        release.wait(30)
        returned.set()
        return "late"

    # Given a call that does not return in time
    hung = start(hangs, "tool hangs")
    assert not hung.done()
    with pytest.raises(CallTimedOut, match="tool hangs did not return within 0.2 s"):
        hung.result(0.2)
    # Then the next call runs at once on another thread, not behind the hung one
    assert bounded(lambda: "next", 5.0, "next call") == "next"
    # And the abandoned call's thread is written off once the call returns
    release.set()
    assert returned.wait(5)
    with pytest.raises(RuntimeError, match="already taken"):
        hung.result(1.0)


def test_calls_side_by_side_each_finish_on_their_own() -> None:
    gates = [threading.Event() for _ in range(3)]

    def waits_for(gate: threading.Event) -> Callable[[], int]:
        return lambda: id(gate) if gate.wait(10) else 0

    started = [start(waits_for(g), f"call {i}") for i, g in enumerate(gates)]
    # None is done until its own gate opens, whatever the others do
    gates[1].set()
    assert started[1].result(5.0) == id(gates[1])
    assert not started[0].done() and not started[2].done()
    gates[2].set()
    gates[0].set()
    assert [s.result(5.0) for s in (started[0], started[2])] == [id(gates[0]), id(gates[2])]
