"""A model call bounded on the turn's own thread (runtime_io/providers/http.py).

The built-in providers (OpenAI, Anthropic, scripted) end a call by ``call_deadline``: every socket operation of its
requests waits at most the time left, and so does a pause between attempts. A server
that trickles its answer a byte at a time, or asks for a long wait before the next
attempt, cannot hold the call past it; a turn then counts a timed-out attempt as it
did when the call ran on a caller thread, and no thread is left behind. Real sockets,
a real OpenAI-compatible server, real Redis for the turn.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.fsm import rebuild
from runtime.models import Message
from runtime.provider import ModelRequest
from runtime_io.providers.http import (
    DeadlineExceeded,
    call_deadline,
    pool_size,
    shared_client,
    size_http_pool,
    time_left,
)
from runtime_io.providers.openai import OpenAIProvider
from runtime_io.providers.scripted import ScriptedProvider
from tasks.context import Context
from tasks.start import create_run
from tasks.turn import advance
from tests.openai_server import OpenAIServer, serve
from tests.workers import redis_context

pytestmark = pytest.mark.timeout(60)

TRICKLED = 400
"""Bytes of the trickling server's body: at one per 50 ms, twenty seconds of answer."""


class Trickler:
    """An HTTP server whose answer comes a byte every 50 ms; counts the bytes it got out
    before the client hung up."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.sent = 0
        self.hung_up = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"

    def _serve(self) -> None:
        connection, _ = self.listener.accept()
        with connection:
            connection.recv(65536)
            try:
                connection.sendall(
                    f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {TRICKLED}\r\n\r\n".encode()
                )
                for _ in range(TRICKLED):
                    connection.sendall(b" ")
                    self.sent += 1
                    time.sleep(0.05)
            except OSError:
                pass
            self.hung_up.set()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    server = Trickler()
    yield server
    server.close()


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with serve() as started:
        yield started


def request() -> ModelRequest:
    return ModelRequest(messages=(Message(role="user", content="hello"),), tools=(), model_call=0)


def provider(url: str, **table: object) -> OpenAIProvider:
    return OpenAIProvider.from_settings("gpt-test", {"provider": {"base_url": url, **table}})


def test_a_server_that_trickles_its_answer_is_cut_off_at_the_deadline(trickler: Trickler) -> None:
    # Each byte comes well within timeout_s: without the deadline the call takes 20 s
    model = provider(trickler.url, timeout_s=5, max_attempts=1)
    assert model.bounds_calls

    with pytest.raises(DeadlineExceeded), call_deadline(0.5):
        model.complete(request())

    assert trickler.hung_up.wait(10)
    assert 0 < trickler.sent < TRICKLED / 2


def test_a_pause_before_the_next_attempt_ends_at_the_deadline(server: OpenAIServer) -> None:
    # The server asks for a 20 s pause before the next attempt; the deadline is sooner
    server.enqueue(503, {"error": {"message": "busy"}}, {"Retry-After": "20"})
    model = provider(server.url, max_attempts=3, max_retry_s=60)
    started = time.monotonic()

    with pytest.raises(DeadlineExceeded), call_deadline(0.5):
        model.complete(request())

    assert time.monotonic() - started < 10
    assert len(server.requests) == 1


def test_deadlines_nest_to_the_sooner_and_a_request_outside_one_has_none(
    server: OpenAIServer,
) -> None:
    assert time_left() is None
    with call_deadline(5):
        with call_deadline(60):
            left = time_left()
            assert left is not None and left <= 5
        server.enqueue(200, {"ok": True})
        assert shared_client().post(f"{server.url}/anything", json={}).json() == {"ok": True}
    assert time_left() is None


@pytest.fixture
def fresh_client() -> Iterator[None]:
    """The process's HTTP client made again (under the test's environment), and again after."""
    size_http_pool(pool_size())
    yield
    size_http_pool(pool_size())


def test_with_a_proxy_in_the_environment_a_call_is_bounded_on_a_caller_thread(
    monkeypatch: pytest.MonkeyPatch, fresh_client: None
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert not provider("https://models.example/v1").bounds_calls


def test_a_proxy_named_after_the_client_was_made_is_not_used_and_calls_stay_bounded(
    monkeypatch: pytest.MonkeyPatch, fresh_client: None, server: OpenAIServer
) -> None:
    # Given the process's client, made with no proxy in the environment
    model = provider(server.url)
    assert model.bounds_calls
    # When a proxy (nothing listens there) is named afterwards
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    # Then the client still goes straight to the server, so its calls stay bounded
    server.enqueue(200, {"ok": True})
    assert shared_client().post(f"{server.url}/anything", json={}).json() == {"ok": True}
    assert model.bounds_calls


def test_a_turn_whose_model_trickles_counts_a_timed_out_attempt_on_its_own_thread(
    redis_url: str, trickler: Trickler, tmp_path: Path
) -> None:
    agent = tmp_path / "agent.toml"
    agent.write_text(
        'name = "trickled"\nmodel = "openai:gpt-test"\nmodel_timeout_s = 0.5\n'
        f'[provider]\nbase_url = "{trickler.url}"\ntimeout_s = 5\nmax_attempts = 1\n'
    )
    ctx: Context = redis_context(redis_url)
    try:
        run_id = create_run(ctx, agent, "hello").run_id
        callers = {t for t in threading.enumerate() if t.name == "ratchet-call"}

        done = advance(ctx, run_id, None)

        assert done.outcome == "next"
        # The call ran here: no caller thread was started for it, none is left behind
        assert {t for t in threading.enumerate() if t.name == "ratchet-call"} <= callers
        assert trickler.hung_up.wait(10) and trickler.sent < TRICKLED / 2
        events = ctx.runs.events(run_id)
        failed = [e for e in events if e.type == "model.failed"]
        assert len(failed) == 1 and failed[0].data["timeout"] is True
        assert "did not return within 0.5 s" in failed[0].data["error"]
        state = rebuild(events)
        assert state is not None and state.usage.model_attempts == 1
    finally:
        ctx.close()


def test_a_scripted_model_slower_than_the_deadline_ends_there(tmp_path: Path) -> None:
    # The scripted model waits 30 s before answering; the call's deadline is 0.5 s
    script = tmp_path / "slow.script.json"
    script.write_text('{"turns": [{"content": "late", "sleep_s": 30}]}')
    model = ScriptedProvider(script)
    assert model.bounds_calls
    started = time.monotonic()

    with pytest.raises(DeadlineExceeded), call_deadline(0.5):
        model.complete(request())

    assert time.monotonic() - started < 10


def test_a_provider_that_does_not_bound_its_calls_is_abandoned_on_a_caller_thread(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A provider without bounds_calls (one with a proxy in the environment, say): its slow
    # call goes to a caller thread, and the turn stops waiting for it at model_timeout_s
    monkeypatch.setattr(ScriptedProvider, "bounds_calls", False)
    (tmp_path / "slow.script.json").write_text('{"turns": [{"content": "late", "sleep_s": 30}]}')
    agent = tmp_path / "agent.toml"
    agent.write_text(
        'name = "slow"\nmodel = "scripted"\nscript = "slow.script.json"\nmodel_timeout_s = 0.5\n'
    )
    ctx: Context = redis_context(redis_url)
    try:
        run_id = create_run(ctx, agent, "hello").run_id

        done = advance(ctx, run_id, None)

        assert done.outcome == "next"
        # The abandoned call still sleeps in the script, on a caller thread
        callers = {t.ident for t in threading.enumerate() if t.name == "ratchet-call"}
        assert any(
            ident in callers and "scripted.py" in "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()
        )
        failed = [e for e in ctx.runs.events(run_id) if e.type == "model.failed"]
        assert len(failed) == 1 and "did not return within 0.5 s" in failed[0].data["error"]
    finally:
        ctx.close()
