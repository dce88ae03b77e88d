"""A paced OpenAI-compatible model on 127.0.0.1 for bench/streaming.py, in a process of its own.

    python -m bench.stream_server --turns 3 --pieces 20 --pace-ms 20   # prints its URL

``POST /v1/chat/completions`` answers a run of ``turns`` model turns as
tests/model_server.py does (a ``lookup_order`` call while the request holds fewer than
``turns - 1`` tool results, then a final answer), and every answer carries ``pieces``
pieces of text, one each ``pace_ms``:

- asked with ``"stream": true``: server-sent events in the chunk shapes of
  tests/openai_server.py (a role chunk, one ``content`` chunk per piece as it is due, the
  tool call in one chunk, a finish chunk, a usage chunk, ``[DONE]``), chunked transfer
  encoding, each event written as it is due;
- otherwise: one JSON body with the same text and call, after the same
  ``pieces * pace_ms``, so a streamed and a plain turn wait on the model equally long.

Each piece is ``"<i>@<ns> "``: ``ns`` is ``time.monotonic_ns()`` as the piece was written
to the socket, so an observer on this machine (CLOCK_MONOTONIC is one clock for every
process) measures its delay from the piece itself. One event loop serves every
connection (HTTP/1.1 keep-alive): hundreds of streams at once cost a coroutine each.
It stops when its stdin closes, and then prints a JSON summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

MAX_BODY = 16 * 1024 * 1024


def piece(i: int) -> str:
    return f"{i}@{time.monotonic_ns()} "


def sent_ns(text: str) -> int | None:
    """The send time a piece carries (None if ``text`` is not one of this server's)."""
    _, at, ns = text.partition("@")
    return int(ns) if at and ns.strip().isdigit() else None


@dataclass
class StreamServer:
    turns: int
    pieces: int
    pace_s: float
    port: int = 0
    requests: int = 0
    connections: int = 0
    """Connections accepted: a client that keeps its connections alive opens few."""
    streamed: int = 0
    most_in_flight: int = 0
    late_ms: float = 0.0
    """The most a piece was written after it was due (this process's own lag)."""
    _in_flight: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> asyncio.Server:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        server = await asyncio.start_server(self._serve, sock=sock, backlog=4096)
        self.port = int(sock.getsockname()[1])
        return server

    def _call(self, body: Any) -> dict[str, Any] | None:
        """The tool call this request is answered with, or None for the final answer."""
        messages = body.get("messages", []) if isinstance(body, dict) else []
        results = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")
        if results >= self.turns - 1:
            return None
        function = {"name": "lookup_order", "arguments": '{"order_id": "A1"}'}
        return {"id": f"call_{results + 1}", "type": "function", "function": function}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = dict(
                    (k.strip().lower(), v.strip())
                    for k, _, v in (line.partition(":") for line in lines[1:] if ":" in line)
                )
                length = int(headers.get("content-length") or 0)
                if length > MAX_BODY or not path.endswith("/chat/completions"):
                    return
                body = json.loads(await reader.readexactly(length))
                self._in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self._in_flight)
                try:
                    if body.get("stream"):
                        await self._stream(writer, self._call(body))
                    else:
                        await self._plain(writer, self._call(body))
                finally:
                    self._in_flight -= 1
                self.requests += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _paced(self, started: float, i: int) -> None:
        due = started + (i + 1) * self.pace_s
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        else:
            self.late_ms = max(self.late_ms, (now - due) * 1000)

    async def _plain(self, writer: asyncio.StreamWriter, call: dict[str, Any] | None) -> None:
        started = time.monotonic()
        await self._paced(started, self.pieces - 1)
        text = "".join(piece(i) for i in range(self.pieces))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if call is not None:
            message["tool_calls"] = [call]
        answer = {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if call else "stop"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": self.pieces},
        }  # fmt: skip
        payload = json.dumps(answer).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, call: dict[str, Any] | None) -> None:
        def event(data: Any) -> None:
            line = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
            writer.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")

        started = time.monotonic()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await writer.drain()
        for i in range(self.pieces):
            await self._paced(started, i)
            event({"choices": [{"index": 0, "delta": {"content": piece(i)}}]})
            await writer.drain()
            self.streamed += 1
        if call is not None:
            part = {"index": 0, **call}
            event({"choices": [{"index": 0, "delta": {"tool_calls": [part]}}]})
        reason = "tool_calls" if call else "stop"
        event({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})
        event({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": self.pieces}})
        event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, required=True, help="model turns per run")
    parser.add_argument("--pieces", type=int, required=True, help="pieces of text per answer")
    parser.add_argument("--pace-ms", type=float, required=True, help="ms between pieces")
    args = parser.parse_args()

    async def run() -> None:
        server = StreamServer(args.turns, args.pieces, args.pace_ms / 1000)
        listening = await server.start()
        print(server.url, flush=True)
        # Ends when the parent closes our stdin (or dies): never outlives its benchmark.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        listening.close()
        summary = {"requests": server.requests, "connections": server.connections,
                   "streamed": server.streamed,
                   "most_in_flight": server.most_in_flight, "late_ms": server.late_ms}  # fmt: skip
        print(json.dumps(summary), flush=True)

    asyncio.run(run())


if __name__ == "__main__":
    main()
