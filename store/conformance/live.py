"""The LiveStream contract (store/live): what observers of a run's live stream rely on.

A backend's suite subclasses :class:`LiveStreamContract` beside a ``live_stream``
fixture that yields a fresh stream. Expiry runs on the backend's own clock (Redis
expires keys itself), so its test waits, boundedly, for the entries to go.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from runtime.errors import InvalidRunId
from store.live import LiveEntry, LiveStream

MAXLEN = 1000
KEEP_S = 60.0


def _entries(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"kind": "model.delta", "text": f"piece {i}"} for i in range(start, start + n)]


def _texts(found: list[LiveEntry]) -> list[str]:
    return [entry.data["text"] for entry in found]


class LiveStreamContract:
    @pytest.fixture
    def live_stream(self) -> LiveStream:
        raise NotImplementedError("a backend's suite provides the `live_stream` fixture")

    def test_entries_come_back_in_order_and_a_cursor_goes_on_after_itself(
        self, live_stream: LiveStream
    ) -> None:
        live_stream.add("run-a", _entries(3), MAXLEN, KEEP_S)
        first = live_stream.read("run-a")
        assert _texts(first) == ["piece 0", "piece 1", "piece 2"]
        live_stream.add("run-a", _entries(2, start=3), MAXLEN, KEEP_S)
        # A reader that reconnects with the last cursor it saw: nothing missed, nothing twice.
        rest = live_stream.read("run-a", after=first[1].cursor)
        assert _texts(rest) == ["piece 2", "piece 3", "piece 4"]
        assert live_stream.read("run-a", after=rest[-1].cursor) == []

    def test_a_read_takes_at_most_limit_entries_and_the_next_read_goes_on(
        self, live_stream: LiveStream
    ) -> None:
        live_stream.add("run-a", _entries(5), MAXLEN, KEEP_S)
        page = live_stream.read("run-a", limit=2)
        assert _texts(page) == ["piece 0", "piece 1"]
        assert _texts(live_stream.read("run-a", after=page[-1].cursor, limit=10)) == [
            "piece 2",
            "piece 3",
            "piece 4",
        ]

    def test_each_run_has_a_stream_of_its_own(self, live_stream: LiveStream) -> None:
        live_stream.add("run-a", _entries(2), MAXLEN, KEEP_S)
        live_stream.add("run-b", [{"text": "b"}], MAXLEN, KEEP_S)
        assert _texts(live_stream.read("run-b")) == ["b"]
        assert _texts(live_stream.read("run-a")) == ["piece 0", "piece 1"]
        assert live_stream.read("run-c") == []

    def test_a_stream_keeps_exactly_its_newest_maxlen_entries(
        self, live_stream: LiveStream
    ) -> None:
        for start in range(0, 60, 20):  # a run that streams on: three batches of 20
            live_stream.add("run-a", _entries(20, start), 25, KEEP_S)
        kept = live_stream.read("run-a", limit=1000)
        assert _texts(kept) == [f"piece {i}" for i in range(35, 60)]

    def test_a_stream_is_gone_once_keep_s_has_passed_since_its_last_write(
        self, live_stream: LiveStream
    ) -> None:
        live_stream.add("run-a", _entries(2), MAXLEN, KEEP_S)
        live_stream.add("run-b", _entries(2), MAXLEN, 0.3)
        deadline = time.monotonic() + 10
        while live_stream.read("run-b") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_stream.read("run-b") == []
        assert _texts(live_stream.read("run-a")) == ["piece 0", "piece 1"]

    def test_a_blocked_read_returns_the_entry_written_while_it_waited(
        self, live_stream: LiveStream
    ) -> None:
        live_stream.add("run-a", _entries(1), MAXLEN, KEEP_S)
        seen = live_stream.read("run-a")
        got: list[LiveEntry] = []
        reading = threading.Event()

        def read() -> None:
            reading.set()
            got.extend(live_stream.read("run-a", after=seen[-1].cursor, block_s=10))

        reader = threading.Thread(target=read)
        reader.start()
        reading.wait(5)
        live_stream.add("run-a", _entries(1, start=1), MAXLEN, KEEP_S)
        reader.join(15)
        assert _texts(got) == ["piece 1"]

    def test_text_a_model_sent_with_a_lone_surrogate_is_kept_not_refused(
        self, live_stream: LiveStream
    ) -> None:
        live_stream.add("run-a", [{"text": "bad \ud800 half"}], MAXLEN, KEEP_S)
        assert _texts(live_stream.read("run-a")) == ["bad \ud800 half"]

    def test_bad_arguments_are_refused_in_one_line(self, live_stream: LiveStream) -> None:
        with pytest.raises(InvalidRunId):
            live_stream.add("../run", _entries(1), MAXLEN, KEEP_S)
        with pytest.raises(InvalidRunId):
            live_stream.read("a/b")
        with pytest.raises(ValueError, match="not a live-stream cursor"):
            live_stream.read("run-a", after="x; DROP")
        with pytest.raises(ValueError, match="maxlen"):
            live_stream.add("run-a", _entries(1), 0, KEEP_S)
        with pytest.raises(ValueError, match="limit"):
            live_stream.read("run-a", limit=0)

    def test_a_run_is_watched_while_a_reader_says_so_and_not_after(
        self, live_stream: LiveStream
    ) -> None:
        assert live_stream.watched("run-a") is False
        live_stream.watch("run-a", 60)
        live_stream.watch("run-b", 0.2)
        assert live_stream.watched("run-a") and live_stream.watched("run-b")
        assert live_stream.watched("run-c") is False
        deadline = time.monotonic() + 10
        while live_stream.watched("run-b") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_stream.watched("run-b") is False and live_stream.watched("run-a")
        with pytest.raises(ValueError, match="for_s"):
            live_stream.watch("run-a", 0)
