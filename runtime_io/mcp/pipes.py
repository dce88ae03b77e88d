"""A stdio MCP server spawned with the original ``os.posix_spawn``, spoken to over its pipes.

The SDK's ``stdio_client`` spawns through asyncio's subprocess support, which under
gevent's patching needs a child watcher that only the main thread's hub has; our loop
runs on a thread of its own (runtime_io/mcp/sessions.py). This transport spawns the
server itself, unpatched, and reads and writes its pipes on the loop: one JSON-RPC
message per line, as the stdio transport of the protocol says. The server gets only
the environment it is given (no inherited variables beyond it) and its stderr goes to
the worker's. Closing the transport closes the server's stdin, then terminates it,
then kills it if it is still there.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.shared.message import SessionMessage

_LINE_LIMIT = 16 * 1024 * 1024
"""The longest line (one message) read from a server: a result past it ends the session."""


def _original(module: str, name: str) -> Any:
    try:
        from gevent import monkey
    except ImportError:
        return getattr(__import__(module), name)
    return monkey.get_original(module, name)


@dataclass
class _Server:
    """A spawned stdio server: its pid and our ends of its pipes."""

    pid: int
    stdin: int
    stdout: int

    def poll(self) -> int | None:
        waitpid = _original("os", "waitpid")
        try:
            pid, status = waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return -1
        return None if pid == 0 else status

    def signal(self, number: int) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.pid, number)


def _spawn(command: list[str], env: dict[str, str], cwd: Path) -> _Server:
    """``command`` in a session of its own, in ``cwd``, with exactly ``env``.

    ``os.posix_spawn`` as it was before gevent's patching (its ``Popen`` would need the
    main thread's hub); ``sh`` changes directory first, since ``posix_spawn`` cannot
    before Python 3.13. The argv goes to ``exec "$@"``: no shell parses any of it.
    """
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    actions = [
        (os.POSIX_SPAWN_DUP2, in_r, 0),
        (os.POSIX_SPAWN_DUP2, out_w, 1),
        (os.POSIX_SPAWN_CLOSE, in_w),
        (os.POSIX_SPAWN_CLOSE, out_r),
    ]
    argv = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', str(cwd), *command]
    try:
        pid = _original("os", "posix_spawn")(
            "/bin/sh", argv, env, file_actions=actions, setsid=True
        )
    finally:
        os.close(in_r)
        os.close(out_w)
    return _Server(pid, in_w, out_r)


@asynccontextmanager
async def pipe_client(
    command: list[str], env: dict[str, str], cwd: Path
) -> AsyncIterator[tuple[Any, Any]]:
    """The read and write streams of a freshly spawned stdio server (an mcp ``Transport``)."""
    # In a session of its own: a ^C at the worker's terminal is the worker's, not the server's.
    process = _spawn(command, env, cwd)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_LINE_LIMIT, loop=loop)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(process.stdout, "rb", 0)
    )
    writer_transport, writer_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(process.stdin, "wb", 0)
    )
    writer = asyncio.StreamWriter(writer_transport, writer_protocol, None, loop)
    incoming_writer, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    outgoing, outgoing_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def read_lines() -> None:
        async with incoming_writer:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, ConnectionError):  # a line past the limit, or a reset pipe
                    return
                if not line:
                    return  # the server exited: the session sees its streams close
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError as exc:
                    await incoming_writer.send(exc)
                    continue
                await incoming_writer.send(SessionMessage(message))

    async def write_lines() -> None:
        async with outgoing_reader:
            async for session_message in outgoing_reader:
                text = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
                try:
                    writer.write(text.encode() + b"\n")
                    await writer.drain()
                except (ConnectionError, RuntimeError):
                    await incoming_writer.aclose()
                    return

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(read_lines)
            group.start_soon(write_lines)
            try:
                yield incoming, outgoing
            finally:
                group.cancel_scope.cancel()
    finally:
        with suppress(Exception):
            writer.close()
        await _stop(process)


async def _stop(process: _Server) -> None:
    for number in (signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            return
        process.signal(number)
        for _ in range(40):
            if process.poll() is not None:
                return
            await asyncio.sleep(0.05)
