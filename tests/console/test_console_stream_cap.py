"""A console streams to at most RATCHET_CONSOLE_MAX_STREAMS run pages at once, each in a
thread of its own: one more is told 503 with Retry-After, and the pages' own requests are
never kept waiting by the streams."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tasks.start import create_run
from tests.console.conftest import TOKEN, ConsoleServer
from tests.helpers import turn, write_agent
from tests.workers import redis_context, wait_for

BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def console_env() -> dict[str, str]:
    return {"RATCHET_CONSOLE_MAX_STREAMS": "2", "RATCHET_CONSOLE_KEEPALIVE_S": "0.5"}


@pytest.fixture
def run_id(redis_url: str, tmp_path: Path) -> Iterator[str]:
    """A run that never moves (its turn is never sent): its watchers wait on and on."""
    ctx = redis_context(redis_url)
    yield create_run(ctx, write_agent(tmp_path, [turn("Done.")]), "wait").run_id
    ctx.close()


def test_a_stream_past_the_cap_is_told_to_come_back_and_pages_still_answer(
    console_server: ConsoleServer, run_id: str
) -> None:
    url = f"{console_server.url}/runs/{run_id}"
    with httpx.Client(headers=BEARER, timeout=10) as client, ExitStack() as streams:
        # Given two pages streaming the run (each has had its first event)
        for _ in range(2):
            stream = streams.enter_context(client.stream("GET", f"{url}/stream"))
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert any(line.startswith("event: event") for line in lines)
        # When a third page asks
        with httpx.Client(headers=BEARER, timeout=10) as other:
            refused = other.get(f"{url}/stream")
            # Then it is told to come back, and a page's own request is answered at once
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
            assert "2 pages already" in refused.text
            assert other.get(url).status_code == 200
    # And once those pages are gone (noticed at the next keepalive), a stream is taken again
    with httpx.Client(headers=BEARER, timeout=10) as again:

        def streams_again() -> bool:
            with again.stream("GET", f"{url}/stream") as stream:
                return stream.status_code == 200

        wait_for("a stream is taken once the others are gone", streams_again, timeout_s=20)
