"""worker/watch.py: a run's committed events and live stream, merged, on the memory run
store (its log and its live stream are the real ones). What a watcher shows when a
worker dies mid-answer, when a stream is cut, when pieces come late, and when a reader
goes away and comes back with its cursor — at every point it could have gone away."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.errors import InvalidOption
from runtime.models import RunStatus
from store.conformance.records import event, new_run, record
from store.runs.memory import MemoryRunStore
from worker.watch import Assembly, Seen, parse_watch_cursor, watch

RUN = "run-w"


class Run:
    """A run whose log and live stream a test writes, as a worker would."""

    def __init__(self) -> None:
        self.store = MemoryRunStore()
        new_run(self.store, RUN)
        self.seq = 1

    def log(self, type_: str, run_status: RunStatus = RunStatus.MODEL, **data: Any) -> int:
        self.seq += 1
        self.store.append(record(RUN, self.seq, run_status), [event(self.seq, type_, **data)], None)
        return self.seq

    def live(self, *entries: dict[str, Any]) -> None:
        stream = self.store.live()
        stream.add(RUN, [{"run": RUN, **e} for e in entries], 1000, 60)

    def piece(self, at: int, text: str, attempt: int = 1) -> None:
        self.live(
            {"kind": "model.delta", "model_call": 1, "at": at, "attempt": attempt, "text": text}
        )

    def finish(self, content: str) -> None:
        self.log("model.responded", content=content)
        self.log("run.completed", RunStatus.COMPLETED, output=content)


def seen(run: Run, after: str | None = None) -> list[Seen]:
    return list(watch(run.store, RUN, after=after, timeout_s=5, wait_s=0.01))


def brief(items: list[Seen]) -> list[str]:
    """Each item as `e:TYPE`, `d:AT/ATTEMPT:TEXT`, `x:AT/ATTEMPT` or `p:MESSAGE`."""
    out = []
    for item in items:
        d = item.data
        if item.kind == "event":
            assert item.event is not None
            out.append(f"e:{item.event.type}")
        elif item.kind == "model.delta":
            out.append(f"d:{d['at']}/{d['attempt']}:{d.get('text', '')}")
        elif item.kind == "model.aborted":
            out.append(f"x:{d['at']}/{d['attempt']}")
        else:
            out.append(f"p:{d.get('message')}")
    return out


def shown_text(items: list[Seen]) -> str:
    """The answer as a watcher shows it in the end: the last attempt's pieces, and what
    the journaled answer adds to them."""
    assembly = Assembly()
    for item in items:
        assembly.add(item)
    (answer,) = assembly.answers
    return answer


def crashed_mid_answer() -> Run:
    """Attempt 1 streams two pieces, its worker dies; the call is asked again and answered."""
    run = Run()
    first = run.log("model.requested", turn=1)
    run.piece(first, "Hel")
    run.piece(first, "lo w")
    run.log("run.resumed", by="sweeper", attempt=1)
    second = run.log("model.requested", turn=1)
    run.piece(second, "Hello")
    run.piece(second, ", world")
    run.finish("Hello, world")
    return run


def cut_and_retried() -> Run:
    """Attempt 1's stream is cut (the provider says so), attempt 2 answers; a tool reports
    progress; a late piece of attempt 1 arrives after the retry."""
    run = Run()
    at = run.log("model.requested", turn=1)
    run.piece(at, "Hel")
    run.live({"kind": "model.delta", "model_call": 1, "at": at, "attempt": 1, "aborted": "reset"})
    run.log("model.retrying", attempt=1, status=None, error="reset", wait_s=0.5)
    run.piece(at, "Hello", attempt=2)
    run.piece(at, "!", attempt=1)
    run.log("model.responded", content="Hello")
    asked = run.log("tool.requested", RunStatus.TOOLS, call_id="c1", name="scan")
    run.live(
        {"kind": "tool.progress", "call_id": "c1", "name": "scan", "at": asked, "message": "1"}
    )
    run.log("tool.completed", RunStatus.TOOLS, call_id="c1", result={})
    again = run.log("model.requested", turn=2)
    run.piece(again, "Done.")
    run.finish("Done.")
    return run


def test_a_piece_comes_after_the_event_that_asked_and_before_the_answer() -> None:
    run = Run()
    at = run.log("model.requested", turn=1)
    run.piece(at, "Hi")
    run.piece(at, " there")
    run.finish("Hi there")
    assert brief(seen(run)) == [
        "e:run.created",
        "e:model.requested",
        f"d:{at}/1:Hi",
        f"d:{at}/1: there",
        "e:model.responded",
        "e:run.completed",
    ]
    assert shown_text(seen(run)) == "Hi there"


def test_a_worker_that_died_mid_answer_shows_its_attempt_abandoned_then_the_next_once() -> None:
    run = crashed_mid_answer()
    items = seen(run)
    assert brief(items) == [
        "e:run.created",
        "e:model.requested",
        "d:2/1:Hel",
        "d:2/1:lo w",
        "e:run.resumed",
        "x:2/1",
        "e:model.requested",
        "d:4/1:Hello",
        "d:4/1:, world",
        "e:model.responded",
        "e:run.completed",
    ]
    assert shown_text(items) == "Hello, world"


def test_a_late_piece_of_an_abandoned_attempt_is_never_shown() -> None:
    run = Run()
    first = run.log("model.requested", turn=1)
    run.piece(first, "Hel")
    second = run.log("model.requested", turn=1)
    run.piece(second, "Hello")
    run.piece(first, "lo w")  # the dead worker's writer, late
    run.finish("Hello")
    assert brief(seen(run))[2:] == [
        "d:2/1:Hel",
        "x:2/1",
        "e:model.requested",
        "d:3/1:Hello",
        "e:model.responded",
        "e:run.completed",
    ]


def test_a_cut_stream_is_abandoned_by_its_own_word_and_its_retry_shown() -> None:
    run = Run()
    at = run.log("model.requested", turn=1)
    run.piece(at, "Hel")
    run.live({"kind": "model.delta", "model_call": 1, "at": at, "attempt": 1, "aborted": "reset"})
    run.log("model.retrying", attempt=1, status=None, error="reset", wait_s=0.5)
    run.piece(at, "Hello", attempt=2)
    run.finish("Hello")
    items = seen(run)
    assert brief(items)[2:] == [
        "d:2/1:Hel",
        "x:2/1",
        "d:2/2:Hello",
        "e:model.retrying",
        "e:model.responded",
        "e:run.completed",
    ]
    assert items[3].data["reason"] == "reset"
    assert shown_text(items) == "Hello"


def test_pieces_written_after_the_answer_committed_are_not_shown_twice() -> None:
    run = Run()
    at = run.log("model.requested", turn=1)
    run.piece(at, "Hi")
    run.log("model.responded", content="Hi there")
    items = list(watch(run.store, RUN, timeout_s=0.2, wait_s=0.01))
    run.piece(at, " there")  # the writer, behind the checkpoint
    run.log("run.completed", RunStatus.COMPLETED, output="Hi there")
    items += seen(run, after=items[-1].cursor)
    assert brief(items)[-2:] == ["e:model.responded", "e:run.completed"]
    assert shown_text(items) == "Hi there"


def test_tool_progress_shows_between_the_call_and_its_outcome() -> None:
    run = Run()
    asked = run.log("tool.requested", RunStatus.TOOLS, call_id="c1", name="scan")
    run.live(
        {"kind": "tool.progress", "call_id": "c1", "name": "scan", "at": asked, "message": "1 of 2"}
    )
    run.log("tool.completed", RunStatus.TOOLS, call_id="c1", result={})
    # Read as it happens, the late progress comes after the outcome it lags behind...
    live = list(watch(run.store, RUN, timeout_s=0.2, wait_s=0.01))
    run.live(
        {"kind": "tool.progress", "call_id": "c2", "name": "slow", "at": asked, "message": "late"}
    )
    run.log("run.completed", RunStatus.COMPLETED, output="")
    live += seen(run, after=live[-1].cursor)
    assert brief(live)[1:] == [
        "e:tool.requested",
        "p:1 of 2",
        "e:tool.completed",
        "p:late",
        "e:run.completed",
    ]
    # ...and read later, each progress comes right after the call it belongs to.
    assert brief(seen(run))[1:] == [
        "e:tool.requested",
        "p:1 of 2",
        "p:late",
        "e:tool.completed",
        "e:run.completed",
    ]


@pytest.mark.parametrize("make", [crashed_mid_answer, cut_and_retried], ids=["crashed", "cut"])
def test_a_reader_that_goes_away_anywhere_and_comes_back_with_its_cursor_misses_nothing(
    make: Any,
) -> None:
    run = make()
    whole = seen(run)
    cursors = [item.cursor for item in whole]
    assert len(set(cursors)) == len(cursors), cursors  # each cursor names one place
    for cut in range(1, len(whole)):
        again = seen(run, after=whole[cut - 1].cursor)
        assert brief(whole[:cut] + again) == brief(whole), f"gone after item {cut}"


def test_a_cursor_is_checked_in_one_line() -> None:
    assert parse_watch_cursor("12.1733412345678-0") == (12, "1733412345678-0", False)
    assert parse_watch_cursor("3.+") == (3, None, True)
    for bad in ("", "x", "1.2.3", "-1.", "1.a", "01.", "1.2-", "1. 2"):
        with pytest.raises(InvalidOption, match="not a watch cursor"):
            parse_watch_cursor(bad)


def test_astream_yields_what_stream_does_without_blocking_the_event_loop() -> None:
    import asyncio

    from store.snapshots.memory import MemorySnapshotStore
    from tasks.context import Context
    from tasks.settings import Settings
    from worker.api import Ratchet

    run = crashed_mid_answer()
    api = Ratchet(Context(settings=Settings(), snapshots=MemorySnapshotStore(), runs=run.store))

    async def both() -> tuple[list[Seen], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        items = [item async for item in api.astream(RUN, timeout_s=5)]
        ticker.cancel()
        return items, ticks

    items, ticks = asyncio.run(both())
    assert brief(items) == brief(seen(run)) and ticks > len(items)


def test_an_answer_that_commits_before_its_last_pieces_waits_for_them() -> None:
    # Given an answer checkpointed while its writer still holds its last piece
    run = Run()
    at = run.log("model.requested", turn=1)
    run.piece(at, "Hi")
    run.finish("Hi there")
    items: list[Seen] = []
    # When a reader shows the first piece, and only then the last piece is written
    for item in watch(run.store, RUN, timeout_s=5, wait_s=0.01):
        items.append(item)
        if item.kind == "model.delta" and item.data["text"] == "Hi":
            run.piece(at, " there")
    # Then the reader showed it as a piece, before the answer, and nothing twice
    assert brief(items)[2:] == [f"d:{at}/1:Hi", f"d:{at}/1: there", "e:model.responded",
                                "e:run.completed"]  # fmt: skip
    assembly = Assembly()
    assert "".join(assembly.add(item) for item in items) == "Hi there"
