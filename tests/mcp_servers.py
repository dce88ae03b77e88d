"""A real MCP server for the tests, built with the ``mcp`` SDK: ``python -m tests.mcp_servers``.

::

    python tests/mcp_servers.py stdio [--ledger P] [--hold P] [--schema 2]
    python tests/mcp_servers.py http PORT [...]      # streamable HTTP on 127.0.0.1:PORT/mcp

Its tools, one of each kind of annotation:

- ``lookup_order`` (``readOnlyHint``), ``wipe_account`` (``destructiveHint``),
  ``issue_refund`` (no annotations), ``always_fails`` (answers ``isError``).

Each call appends a line to the ``--ledger`` file: the tool, its arguments, the ``_meta``
idempotency key it was sent and the server's pid. While the ``--hold`` file exists, a call
of ``issue_refund`` or ``lookup_order`` waits (after writing a ``started`` line), so a test
can kill the worker mid-call. ``--schema 2`` adds a parameter to ``issue_refund``: the
tool's schema changed. It is run as a script (no ``PYTHONPATH`` reaches a stdio server).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("billing")
_parser = argparse.ArgumentParser()
_parser.add_argument("transport", choices=["stdio", "http"])
_parser.add_argument("port", nargs="?", type=int, default=0)
_parser.add_argument("--ledger")
_parser.add_argument("--hold")
_parser.add_argument("--schema", default="1")
OPTIONS = _parser.parse_args() if __name__ == "__main__" else _parser.parse_args(["stdio"])


def _ledger(line: dict[str, Any]) -> None:
    if OPTIONS.ledger:
        with open(OPTIONS.ledger, "a", encoding="utf-8") as ledger:
            ledger.write(json.dumps({**line, "pid": os.getpid()}, sort_keys=True) + "\n")


def _key(ctx: Context) -> str | None:
    meta = ctx.request_context.meta or {}
    value = meta.get("ratchet/idempotency_key") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


def _hold(tool: str, ctx: Context) -> None:
    if OPTIONS.hold and Path(OPTIONS.hold).exists():
        _ledger({"started": tool, "key": _key(ctx)})
        while Path(OPTIONS.hold).exists():
            time.sleep(0.05)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup_order(order_id: str, ctx: Context) -> dict[str, Any]:
    """Find an order by id."""
    _hold("lookup_order", ctx)
    _ledger({"tool": "lookup_order", "order_id": order_id, "key": _key(ctx)})
    return {"order_id": order_id, "status": "lost in transit", "amount_cents": 2900}


def _refund(order_id: str, amount_cents: int, ctx: Context) -> str:
    _hold("issue_refund", ctx)
    _ledger({"tool": "issue_refund", "order_id": order_id, "key": _key(ctx)})
    return f"refunded {amount_cents} on {order_id}"


if OPTIONS.schema == "2":

    @server.tool(name="issue_refund")
    def issue_refund_with_reason(
        order_id: str, amount_cents: int, reason: str, ctx: Context
    ) -> str:
        """Refund an order (the changed schema: a reason is required)."""
        return _refund(order_id, amount_cents, ctx)

else:

    @server.tool()
    def issue_refund(order_id: str, amount_cents: int, ctx: Context) -> str:
        """Refund an order."""
        return _refund(order_id, amount_cents, ctx)


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def wipe_account(account: str, ctx: Context) -> str:
    """Delete an account and everything in it."""
    _ledger({"tool": "wipe_account", "account": account, "key": _key(ctx)})
    return f"wiped {account}"


@server.tool()
def always_fails(ctx: Context) -> str:
    """A tool that fails."""
    raise ValueError("the billing backend is down")


def main() -> None:
    if OPTIONS.transport == "http":
        server.run("streamable-http", host="127.0.0.1", port=OPTIONS.port)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
