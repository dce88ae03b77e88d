"""tasks/live.py: the per-process writer of live streams never holds or fails a turn,
and a streamed model call can wait, briefly, for its last pieces to be written."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import StoreUnavailable
from store.live.memory import MemoryLiveStream
from tasks import live as live_module
from tasks.live import LiveWriter


class GatedStream(MemoryLiveStream):
    """The memory stream, whose writes wait for ``open`` (or fail once ``broken``)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = threading.Event()
        self.broken = False

    def _add(self, run_id: str, entries: list[str], maxlen: int, keep_s: float) -> None:
        self.open.wait(10)
        if self.broken:
            raise StoreUnavailable("live stream test", "broken on purpose")
        super()._add(run_id, entries, maxlen, keep_s)


def texts(stream: MemoryLiveStream) -> list[Any]:
    return [e.data["text"] for e in stream.read("run-a", limit=10_000)]


def test_settle_returns_once_every_entry_handed_in_is_written() -> None:
    stream = GatedStream()
    writer = LiveWriter(stream, 1000, 60)
    for i in range(50):
        writer.put("run-a", {"text": i})
    stream.open.set()
    assert writer.settle(10)
    assert texts(stream) == list(range(50))


def test_settle_gives_up_after_its_timeout_and_the_entries_are_written_later() -> None:
    stream = GatedStream()
    writer = LiveWriter(stream, 1000, 60)
    writer.put("run-a", {"text": "late"})
    assert writer.settle(0.05) is False  # the turn goes on
    stream.open.set()
    assert writer.settle(10) and texts(stream) == ["late"]


def test_a_failing_store_drops_and_counts_and_settle_still_returns() -> None:
    stream = GatedStream()
    stream.broken = True
    stream.open.set()
    writer = LiveWriter(stream, 1000, 60)
    writer.put("run-a", {"text": "lost"})
    assert writer.settle(10)
    assert texts(stream) == []


def test_a_full_queue_drops_what_does_not_fit_without_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(live_module, "CAPACITY", 3)
    stream = GatedStream()
    writer = LiveWriter(stream, 1000, 60)
    for i in range(10):  # the writer takes one batch and waits on the store; the rest queue
        writer.put("run-a", {"text": i})
    stream.open.set()
    assert writer.settle(10)
    written = texts(stream)
    assert 3 <= len(written) < 10 and written == sorted(written)


def test_a_model_call_puts_at_most_its_bound_of_pieces_in_the_stream(tmp_path: Path) -> None:
    from runtime.models import RunStatus
    from tasks.live import MAX_PIECES_BYTES
    from tasks.start import create_run
    from tests.helpers import drive, memory_context, write_agent

    # Given a watched run whose model streams an answer past any bound (3 MiB of text)
    content = "x" * (3 * 2**20)
    agent = write_agent(tmp_path, [{"content": content}], tools=[])
    script = agent.with_name(f"{agent.stem}.script.json")
    played = json.loads(script.read_text())
    pace = {"chunk_chars": 100_000, "interval_s": 0}
    script.write_text(json.dumps({**played, "stream": pace}))
    ctx = memory_context()
    run_id = create_run(ctx, agent, "go").run_id
    live = ctx.runs.live()
    assert live is not None
    live.watch(run_id, 60)
    # When it is driven (the answer itself is refused as too large, as without streaming)
    drive(ctx, run_id)
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.FAILED
    # Then the stream holds no more of its pieces than the bound
    ctx.live().settle(10)  # type: ignore[union-attr]
    kept = sum(len(e.data.get("text", "")) for e in live.read(run_id, limit=10_000))
    assert 0 < kept <= MAX_PIECES_BYTES, kept
