"""The tools an MCP server lists, as :class:`~runtime.tools.ToolSpec`\\ s, and their calls.

Listing happens when an agent file is loaded (a worker's first turn of the agent,
``ratchet runs start``, a resume); calling, on the worker's session of the server
(runtime_io/mcp/sessions.py). Before each call the session is pinged: a server that
died between turns is started (or reached) again first, and the call goes to the
new session — it had not been sent. A call whose session fails *after* it was sent
has an unknown outcome: the call waits out the agent's ``tool_timeout_s`` and is then
handled as any call that timed out (run again if idempotent, else probed or parked).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model
from pydantic_core import to_jsonable_python

from runtime import json_values
from runtime.errors import NotStorable, ToolError
from runtime.probes import ToolContext
from runtime.tools import ToolSpec, is_tool_name
from runtime_io.mcp import META_KEY, McpToolPolicy, Server, ServerRefused
from runtime_io.mcp.sessions import ServerUnavailable, client_for, forget, process_loop

_ANNOTATION_NAMES = {
    "read_only_hint": "readOnlyHint",
    "idempotent_hint": "idempotentHint",
    "destructive_hint": "destructiveHint",
    "open_world_hint": "openWorldHint",
}


class McpToolFailed(Exception):
    """The server answered the call with ``isError``: its text goes to the model."""


def _connect(server: Server) -> Any:
    from mcp import Client

    if server.table.command is not None:
        from runtime_io.mcp.pipes import pipe_client

        command = list(server.table.command)
        return Client(pipe_client(command, server.environment(), server.folder), mode="legacy")
    return Client(_http_transport(server), mode="legacy")


@asynccontextmanager
async def _http_transport(server: Server) -> AsyncIterator[Any]:
    """The streamable-HTTP transport over an HTTP client of the session's own, closed with it
    (the SDK leaves a client it is given open)."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    assert server.table.url is not None
    headers = server.headers()
    async with httpx2.AsyncClient(headers=headers, timeout=server.table.connect_timeout_s) as http:
        async with streamable_http_client(server.table.url, http_client=http) as streams:
            yield streams


def list_tools(server: Server) -> list[Any]:
    """Every tool ``server`` lists (all pages); ServerUnavailable names the server."""
    loop = process_loop()

    async def listing() -> list[Any]:
        client = await _live_client(loop, server)
        tools: list[Any] = []
        cursor: str | None = None
        for _ in range(100):
            page = await client.list_tools(cursor=cursor, cache_mode="refresh")
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                return tools
        return tools

    try:
        return loop.run(listing, server.table.connect_timeout_s)
    except ServerUnavailable:
        raise
    except Exception as exc:
        raise ServerUnavailable(
            f"{server.describe()}: listing its tools failed ({_short(exc)})"
        ) from None


async def _live_client(loop: Any, server: Server) -> Any:
    """A session of ``server`` that answered a ping just now, started afresh if it did not."""
    for attempt in (1, 2):
        try:
            client = await asyncio.wait_for(
                client_for(loop, server.key, lambda: _connect(server)),
                server.table.connect_timeout_s,
            )
        except ServerRefused as exc:
            raise ServerUnavailable(str(exc)) from None
        except Exception as exc:
            await forget(loop, server.key)
            raise ServerUnavailable(
                f"{server.describe()} could not be started or reached ({_short(exc)})"
            ) from None
        try:
            # The session's own ping: the handshake-era protocol (mode="legacy") has it.
            await asyncio.wait_for(client.session.send_ping(), server.table.connect_timeout_s)
            return client
        except Exception as exc:
            await forget(loop, server.key)
            if attempt == 2:
                raise ServerUnavailable(
                    f"{server.describe()} does not answer ({_short(exc)})"
                ) from None
    raise AssertionError("unreachable")


def _short(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _short(exc.exceptions[0])
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def policy(annotations: Any, override: McpToolPolicy | None) -> tuple[bool, bool, dict[str, str]]:
    """(idempotent, needs approval, where each came from) for one MCP tool."""
    hints = {}
    if annotations is not None:
        for attr, name in _ANNOTATION_NAMES.items():
            value = getattr(annotations, attr, None)
            if value is not None:
                hints[name] = bool(value)
    if override is not None and override.idempotent is not None:
        idempotent, idempotent_from = override.idempotent, "agent file"
    elif hints.get("readOnlyHint") or hints.get("idempotentHint"):
        idempotent = True
        idempotent_from = "readOnlyHint" if hints.get("readOnlyHint") else "idempotentHint"
    else:
        idempotent, idempotent_from = False, "default (unannotated: not idempotent)"
    if override is not None and override.approval is not None:
        approval, approval_from = override.approval, "agent file"
    elif hints.get("destructiveHint") and not hints.get("readOnlyHint"):
        approval, approval_from = True, "destructiveHint"
    else:
        approval, approval_from = False, "default"
    return idempotent, approval, {"idempotent": idempotent_from, "approval": approval_from}


class _AnyArguments(BaseModel):
    """The server validates its own arguments: they go to it as the model gave them."""

    model_config = ConfigDict(extra="allow")


def specs(server: Server, wanted: str, tool_timeout_s: float) -> list[tuple[ToolSpec, bool]]:
    """The ToolSpecs of ``server``'s tool ``wanted`` (or of all, ``*``), each with whether
    it awaits approval. ToolError names the reference when the server lacks the tool."""
    listed = list_tools(server)
    chosen = listed if wanted == "*" else [t for t in listed if t.name == wanted]
    if not chosen:
        names = ", ".join(sorted(t.name for t in listed)[:20]) or "none"
        raise ToolError(
            f"mcp:{server.name}/{wanted}",
            f"{server.describe()} lists no tool `{wanted}` (it lists: {names})",
        )
    out = []
    for tool in chosen:
        schema, description = _declared(server, tool)
        idempotent, approval, sources = policy(tool.annotations, server.table.tools.get(tool.name))
        spec = ToolSpec(
            name=tool.name,
            reference=f"mcp:{server.name}/{tool.name}",
            description=description,
            idempotent=idempotent,
            control=False,
            parameters=schema,
            arguments_model=create_model(f"mcp_{tool.name}", __base__=_AnyArguments),
            fn=None,
        )
        mcp = {
            "server": server.name,
            "annotations": _hints(tool.annotations),
            "policy_from": sources,
        }
        out.append(
            (replace(spec, remote=_caller(server, tool.name, tool_timeout_s), mcp=mcp), approval)
        )
    return out


MAX_SCHEMA_BYTES = 64 * 1024
"""The largest input schema an MCP tool may declare (it goes into every run's binding)."""
MAX_DESCRIPTION_CHARS = 4000


def _declared(server: Server, tool: Any) -> tuple[dict[str, Any], str]:
    """A listed tool's schema and description, checked where they cross into ratchet (they
    go into the run's binding and to the model): ToolError names the tool otherwise."""
    reference = f"mcp:{server.name}/{tool.name}"
    if not is_tool_name(tool.name):
        raise ToolError(
            f"mcp:{server.name}/{str(tool.name)[:64]!r}",
            f"{server.describe()} lists a tool whose name is not 1-64 letters, digits, _ or -",
        )
    raw = tool.input_schema or {"type": "object", "properties": {}}
    try:
        schema, size = json_values.checked(
            to_jsonable_python(raw), max_bytes=MAX_SCHEMA_BYTES, surrogates="refuse"
        )
    except (NotStorable, ValueError, TypeError) as exc:
        raise ToolError(
            reference, f"{server.describe()} lists a schema that cannot be used ({exc})"
        ) from None
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ToolError(
            reference, f"{server.describe()} lists a schema that is not an object schema"
        )
    schema = dict(schema)
    schema.pop("title", None)
    text = json_values.replaced(str(tool.description or "").strip())
    return schema, text[:MAX_DESCRIPTION_CHARS]


def _hints(annotations: Any) -> dict[str, bool]:
    if annotations is None:
        return {}
    found = {name: getattr(annotations, attr, None) for attr, name in _ANNOTATION_NAMES.items()}
    return {k: bool(v) for k, v in found.items() if v is not None}


def _caller(server: Server, tool: str, tool_timeout_s: float) -> Any:
    def call(arguments: dict[str, Any], context: ToolContext | None) -> Any:
        meta: dict[str, Any] = {}
        if context is not None:
            meta = {
                META_KEY: context.idempotency_key,
                "ratchet/run_id": context.run_id,
                "ratchet/call_id": context.call_id,
            }
        loop = process_loop()
        sent = [False]

        async def go() -> Any:
            client = await _live_client(loop, server)
            sent[0] = True
            try:
                return await client.call_tool(tool, arguments, meta=meta)
            except Exception:
                await forget(loop, server.key)
                raise

        started = time.monotonic()
        try:
            result = loop.run(go, tool_timeout_s)
        except ServerUnavailable:
            raise
        except Exception as exc:
            if not sent[0]:
                raise ServerUnavailable(f"{server.describe()}: {_short(exc)}") from None
            if _is_protocol_error(exc):
                raise McpToolFailed(
                    f"{server.describe()} refused the call: {_short(exc)}"
                ) from None
            # Sent, and the session failed: whether it ran is unknown. Wait out the
            # tool's timeout, so the turn handles it as any call that timed out.
            time.sleep(max(0.0, tool_timeout_s + 1.0 - (time.monotonic() - started)))
            raise
        return _result(server, tool, result)

    return call


def _is_protocol_error(exc: BaseException) -> bool:
    from mcp.shared.exceptions import MCPError

    return isinstance(exc, MCPError)


def _result(server: Server, tool: str, result: Any) -> Any:
    texts = [getattr(block, "text", None) for block in result.content or ()]
    text = "\n".join(t for t in texts if isinstance(t, str))
    if result.is_error:
        raise McpToolFailed(text or f"{server.describe()}: `{tool}` failed and said nothing")
    if result.structured_content is not None:
        return result.structured_content
    others = [
        getattr(b, "type", "?") for b in result.content or () if getattr(b, "text", None) is None
    ]
    if others and not text:
        return {"content_types": others}
    return text
