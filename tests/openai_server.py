"""A stand-in OpenAI-compatible server on 127.0.0.1 that plays canned responses in order.

Responses come from recorded request/response pairs in ``tests/fixtures/openai/``
(or are built in the test); every request is recorded (headers and JSON body)
for assertions. With the queue empty it answers 500 "no canned response queued",
so a test that makes one request too many fails loudly instead of hanging.

::

    with serve() as server:
        server.enqueue_fixture("rate_limited")
        server.enqueue_fixture("text_answer")
        server.enqueue_stream(text_chunks(["Hel", "lo"]))   # server-sent events
        provider = OpenAIProvider("gpt-test", server.url)
        ...
        assert len(server.requests) == 2
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "openai"


def load_fixture(name: str) -> dict[str, Any]:
    """One recorded pair: ``{"description", "request": {...}, "response": {...}}``."""
    document: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text("utf-8"))
    return document


@dataclass(frozen=True)
class CannedResponse:
    status: int
    body: Any = None
    """JSON-encoded unless it is a str (sent as is) or bytes."""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    """Wait this long before answering: stands in for a server slower than the client's timeout."""

    def encoded(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        if isinstance(self.body, str):
            return self.body.encode()
        return b"" if self.body is None else json.dumps(self.body).encode()


@dataclass(frozen=True)
class CannedStream:
    """A 200 answered with server-sent events, one ``data:`` event per item, then
    ``data: [DONE]``, each event flushed as it is written (chunked transfer encoding)."""

    events: list[Any]
    """JSON-encoded unless it is a str (sent as the event's data as is)."""
    pace_s: float = 0.0
    """Wait this long before each event after the first."""
    gates: dict[int, threading.Event] = field(default_factory=dict)
    """Send event ``i`` only once ``gates[i]`` is set (at most 10 s; a miss is recorded in
    ``OpenAIServer.gate_misses``): a test proves the client saw event ``i - 1`` first."""
    cut_after: int | None = None
    """Reset the connection after this many events, with no ``[DONE]``."""
    done: bool = True
    """Send ``data: [DONE]`` at the end (else end the body cleanly without it)."""
    sent_at: dict[int, float] = field(default_factory=dict)
    """``time.monotonic()`` as each event ``i`` was flushed (to measure an observer's delay)."""


def text_chunks(pieces: list[str], usage: dict[str, int] | None = None) -> list[Any]:
    """Chat-completion chunks for an answer of ``pieces``, then a usage chunk if given."""
    chunks: list[Any] = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage is not None:
        chunks.append({"choices": [], "usage": usage})
    return chunks


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names."""
    body: Any
    """The parsed JSON body; ``None`` if it was not JSON."""
    client_port: int = 0
    """The client's port: two requests with the same one came on one connection."""


class OpenAIServer:
    def __init__(self) -> None:
        self._queue: deque[CannedResponse | CannedStream] = deque()
        self.gate_misses: list[int] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.requests: list[RecordedRequest] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """The base URL, as an agent file's ``[provider] base_url`` names it."""
        return f"http://127.0.0.1:{self.port}/v1"

    def enqueue(
        self,
        status: int = 200,
        body: Any = None,
        headers: dict[str, str] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        with self._lock:
            self._queue.append(CannedResponse(status, body, dict(headers or {}), delay_s))

    def enqueue_stream(
        self,
        events: list[Any],
        pace_s: float = 0.0,
        gates: dict[int, threading.Event] | None = None,
        cut_after: int | None = None,
        done: bool = True,
    ) -> CannedStream:
        with self._lock:
            stream = CannedStream(events, pace_s, dict(gates or {}), cut_after, done)
            self._queue.append(stream)
        return stream

    def enqueue_fixture(self, name: str, delay_s: float = 0.0) -> dict[str, Any]:
        """Queue the recorded response of fixture ``name``; returns the whole pair."""
        pair = load_fixture(name)
        response = pair["response"]
        self.enqueue(response["status"], response.get("body"), response.get("headers"), delay_s)
        return pair

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers still sleeping out a delay
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _next(self) -> CannedResponse | CannedStream:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        return CannedResponse(
            500, {"error": {"message": "openai_server: no canned response queued"}}
        )

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - the name http.server dispatches to
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                headers = {k.lower(): v for k, v in self.headers.items()}
                with server._lock:
                    port = int(self.client_address[1])
                    server.requests.append(RecordedRequest("POST", self.path, headers, body, port))
                canned = server._next()
                if isinstance(canned, CannedStream):
                    _send_stream(self, canned, server._stopping, server.gate_misses)
                    return
                if canned.delay_s and server._stopping.wait(canned.delay_s):
                    return
                payload = canned.encoded()
                try:
                    self.send_response(canned.status)
                    names = {k.lower() for k in canned.headers}
                    for name, value in canned.headers.items():
                        self.send_header(name, value)
                    if "content-type" not in names:
                        self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first (its timeout): exactly what the test wanted

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        return Handler


def _send_stream(
    handler: BaseHTTPRequestHandler,
    canned: CannedStream,
    stopping: threading.Event,
    gate_misses: list[int],
) -> None:
    def chunk(data: bytes) -> None:
        handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        handler.wfile.flush()

    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    try:
        for index, event in enumerate(canned.events):
            if canned.cut_after is not None and index >= canned.cut_after:
                handler.close_connection = True
                handler.connection.shutdown(socket.SHUT_RDWR)  # mid-body: the peer sees a reset
                return
            gate = canned.gates.get(index)
            if gate is not None and not gate.wait(10):
                gate_misses.append(index)
            if index and canned.pace_s and stopping.wait(canned.pace_s):
                return
            data = event if isinstance(event, str) else json.dumps(event)
            chunk(f"data: {data}\n\n".encode())
            canned.sent_at[index] = time.monotonic()
        if canned.done:
            chunk(b"data: [DONE]\n\n")
        chunk(b"")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client gave up first


@contextmanager
def serve() -> Iterator[OpenAIServer]:
    """A started server, stopped on exit."""
    server = OpenAIServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    """A started server of the test's own (a module may define a ``server`` of its own)."""
    with serve() as running:
        yield running
