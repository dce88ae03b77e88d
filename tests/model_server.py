"""An asynchronous OpenAI-compatible model on 127.0.0.1 that plays an agent with tools.

``POST /v1/chat/completions`` answers after ``latency_s``: with one tool call
(``lookup_order``) while the request holds fewer than ``turns - 1`` tool
results, then with a final answer. So a run of ``turns`` model turns makes
``turns - 1`` tool calls, and the model's answer depends only on the
transcript, as a deterministic model's would. One event loop serves every
connection (HTTP/1.1 keep-alive), so thousands of requests wait at once for
the price of a coroutine each — unlike tests/openai_server.py, a thread per
connection with canned answers.

::

    with serve(latency_s=0.5, turns=3) as server:   # in a thread of this process
        ... base_url = server.url ...

    python -m tests.model_server --port 0 --latency 1 --turns 3   # a process; prints its URL

With ``rpm`` / ``tpm`` set it enforces them as a provider does: a token bucket per
limit, ``burst_s`` seconds of it deep, and beyond them 429 with a ``Retry-After``
(fractional seconds) until the bucket has room; the tokens a request costs are the
usage it reports. It records when it accepted each request (``accepted_at``) and how
many it refused, for bench/limits.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

MAX_BODY = 16 * 1024 * 1024
HOLD_TIMEOUT_S = 120.0


@dataclass
class ModelServer:
    latency_s: float
    turns: int
    hold_until: int = 0
    """Hold every request until this many wait at once (or HOLD_TIMEOUT_S passed): a test
    that must have N model calls in flight together gets them, however slow the box."""
    host: str = "127.0.0.1"
    port: int = 0
    requests: int = 0
    """Chat completions answered."""
    in_flight: int = 0
    most_in_flight: int = 0
    """The most requests waiting out their latency at once."""
    rpm: float = 0.0
    """Requests a minute this server accepts (0: no limit); beyond them it answers 429."""
    tpm: float = 0.0
    """Tokens a minute (prompt and completion, as the usage reports them; 0: no limit)."""
    burst_s: float = 2.0
    """How deep the buckets are, in seconds of their rate."""
    refused: int = 0
    """Requests answered 429."""
    accepted_at: list[float] = field(default_factory=list)
    """``time.time()`` of each request accepted (within the limits)."""
    accepted_tokens: int = 0
    arrived_at: list[float] = field(default_factory=list)
    """``time.time()`` of each chat completion as its request was read, limits or none."""
    _buckets: dict[str, list[float]] = field(default_factory=dict, repr=False)
    _server: asyncio.Server | None = field(default=None, repr=False)
    _connections: set[asyncio.Task[None]] = field(default_factory=set, repr=False)
    _released: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._server = await asyncio.start_server(self._serve, sock=sock, backlog=4096)
        self.port = int(sock.getsockname()[1])

    async def close(self) -> None:
        """Stop listening and drop every open connection (keep-alive ones wait forever)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    def admit(self, cost_tokens: int, now: float) -> float:
        """0 when a request of ``cost_tokens`` fits both buckets (taken), else seconds to wait."""
        wanted = [("requests", self.rpm, 1.0), ("tokens", self.tpm, float(cost_tokens))]
        wait_s = 0.0
        for name, per_minute, cost in wanted:
            if not per_minute:
                continue
            per_s, depth = per_minute / 60, per_minute / 60 * self.burst_s
            level, at = self._buckets.setdefault(name, [depth, now])
            level = min(depth, level + (now - at) * per_s)
            self._buckets[name] = [level, now]
            if level < min(cost, depth):
                wait_s = max(wait_s, (min(cost, depth) - level) / per_s)
        if wait_s > 0:
            return wait_s
        for name, per_minute, cost in wanted:
            if per_minute:
                self._buckets[name][0] -= cost
        return 0.0

    def answer(self, body: Any) -> dict[str, Any]:
        """The chat completion for a request body: a tool call, or the final answer."""
        messages = body.get("messages", []) if isinstance(body, dict) else []
        results = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")
        usage = {"prompt_tokens": 100 + 20 * len(messages), "completion_tokens": 12}
        if results < self.turns - 1:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{results + 1}",
                        "type": "function",
                        "function": {"name": "lookup_order", "arguments": '{"order_id": "A1"}'},
                    }
                ],
            }
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": "done"}, "stop"
        return {
            "id": f"chatcmpl-{self.requests}",
            "object": "chat.completion",
            "model": body.get("model", "?") if isinstance(body, dict) else "?",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage,
        }

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length") or 0)
                if length > MAX_BODY:
                    return
                raw = await reader.readexactly(length)
                if method != "POST" or not path.endswith("/chat/completions"):
                    await self._send(writer, 404, {"error": {"message": f"no route {path}"}})
                    continue
                try:
                    body = json.loads(raw)
                except ValueError:
                    await self._send(writer, 400, {"error": {"message": "body is not JSON"}})
                    continue
                self.arrived_at.append(time.time())
                if self.rpm or self.tpm:
                    usage = self.answer(body)["usage"]
                    cost = usage["prompt_tokens"] + usage["completion_tokens"]
                    wait_s = self.admit(cost, time.monotonic())
                    if wait_s > 0:
                        self.refused += 1
                        after = {"Retry-After": f"{wait_s:.3f}"}
                        message = {"error": {"message": "Rate limit reached", "type": "requests"}}
                        await self._send(writer, 429, message, after)
                        continue
                    self.accepted_at.append(time.time())
                    self.accepted_tokens += cost
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                try:
                    await self._hold()
                    await asyncio.sleep(self.latency_s)
                finally:
                    self.in_flight -= 1
                self.requests += 1
                await self._send(writer, 200, self.answer(body))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            # Ended by close(); finishing normally keeps asyncio's stream callback quiet.
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _hold(self) -> None:
        if self._released.is_set() or not self.hold_until:
            return
        if self.in_flight >= self.hold_until:
            self._released.set()
            return
        try:
            await asyncio.wait_for(self._released.wait(), HOLD_TIMEOUT_S)
        except TimeoutError:
            self._released.set()  # the caller's in-flight assertion says what went wrong

    @staticmethod
    async def _send(
        writer: asyncio.StreamWriter, status: int, body: Any, headers: dict[str, str] | None = None
    ) -> None:
        payload = json.dumps(body).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests"}[status]
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()


@contextmanager
def serve(
    latency_s: float, turns: int, hold_until: int = 0, rpm: float = 0.0, tpm: float = 0.0,
    burst_s: float = 2.0,
) -> Iterator[ModelServer]:  # fmt: skip
    """A ModelServer on a free port, on an event loop in a daemon thread of this process."""
    server = ModelServer(latency_s, turns, hold_until, rpm=rpm, tpm=tpm, burst_s=burst_s)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="model-server", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the model server did not start within 10 s")
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, required=True, help="seconds per answer")
    parser.add_argument("--turns", type=int, required=True, help="model turns per run")
    parser.add_argument("--rpm", type=float, default=0.0, help="requests a minute (429 beyond)")
    parser.add_argument("--tpm", type=float, default=0.0, help="tokens a minute (429 beyond)")
    parser.add_argument("--burst", type=float, default=2.0, help="bucket depth, in seconds")
    args = parser.parse_args()

    async def run() -> None:
        server = ModelServer(
            args.latency, args.turns, port=args.port, rpm=args.rpm, tpm=args.tpm,
            burst_s=args.burst,
        )  # fmt: skip
        await server.start()
        print(server.url, flush=True)
        # Ends when the parent closes our stdin (or dies): never outlives its benchmark.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        summary = {
            "requests": server.requests,
            "most_in_flight": server.most_in_flight,
            "refused": server.refused,
            "accepted_at": server.accepted_at,
            "accepted_tokens": server.accepted_tokens,
        }
        print(json.dumps(summary))

    asyncio.run(run())


if __name__ == "__main__":
    main()
