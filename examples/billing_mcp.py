"""A small MCP server for the examples: ``python billing_mcp.py`` (stdio).

Built with the ``mcp`` SDK's ``MCPServer`` (2.x; 1.x called it ``FastMCP``).
``examples/mcp-desk.toml`` starts it over stdio. Its annotations are what ratchet's
durability rules read: ``lookup_order`` is read-only (run again after a crash),
``issue_refund`` is idempotent *because it deduplicates on the idempotency key ratchet
sends in ``_meta``*, and ``close_account`` is destructive (a person approves it first).

The keys are kept in a SQLite file (``RATCHET_MCP_BILLING_DB``, default
``.ratchet/billing_mcp.sqlite3`` in the server's folder), not in the server's memory: a
stdio server lives and dies with its worker process, and the call a crash cut off is
sent again to the *next* worker's server, which must still know the key.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("billing")
ORDERS = {
    "A1": {"order_id": "A1", "item": "kettle", "amount_cents": 4900, "status": "delivered"},
    "B2": {"order_id": "B2", "item": "toaster", "amount_cents": 2900, "status": "lost in transit"},
}


def _book(key: str, result: str) -> str:
    """Book ``result`` under ``key`` unless the key was booked before; the booked result."""
    path = Path(os.environ.get("RATCHET_MCP_BILLING_DB") or ".ratchet/billing_mcp.sqlite3")
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path, timeout=30)) as db, db:
        db.execute("CREATE TABLE IF NOT EXISTS refunds (key TEXT PRIMARY KEY, result TEXT)")
        db.execute("INSERT OR IGNORE INTO refunds VALUES (?, ?)", (key, result))
        (booked,) = db.execute("SELECT result FROM refunds WHERE key = ?", (key,)).fetchone()
    return str(booked)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup_order(order_id: str) -> dict[str, Any]:
    """Find an order by id."""
    if order_id not in ORDERS:
        raise ValueError(f"no order {order_id}")
    return ORDERS[order_id]


@server.tool(annotations=ToolAnnotations(idempotent_hint=True, destructive_hint=False))
def issue_refund(order_id: str, amount_cents: int, ctx: Context) -> str:
    """Refund an order; the same idempotency key books one refund however often it comes."""
    meta = ctx.request_context.meta or {}
    key = str(meta.get("ratchet/idempotency_key") or f"{order_id}:{amount_cents}")
    return _book(key, f"refunded {amount_cents} on {order_id}")


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def close_account(customer: str) -> str:
    """Close a customer's account for good."""
    return f"closed {customer}"


if __name__ == "__main__":
    server.run("stdio")
