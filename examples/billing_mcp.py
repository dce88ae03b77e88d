"""A small MCP server for the examples (the ``mcp`` SDK's MCPServer): ``python billing_mcp.py``.

``examples/mcp-desk.toml`` starts it over stdio. Its annotations are what ratchet's
durability rules read: ``lookup_order`` is read-only (run again after a crash),
``issue_refund`` is idempotent *because it deduplicates on the idempotency key ratchet
sends in ``_meta``*, and ``close_account`` is destructive (a person approves it first).
"""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("billing")
ORDERS = {
    "A1": {"order_id": "A1", "item": "kettle", "amount_cents": 4900, "status": "delivered"},
    "B2": {"order_id": "B2", "item": "toaster", "amount_cents": 2900, "status": "lost in transit"},
}
_refunds: dict[str, str] = {}
"""Refunds booked, by the idempotency key they came with (one process: the example's)."""


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
    _refunds.setdefault(key, f"refunded {amount_cents} on {order_id}")
    return _refunds[key]


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def close_account(customer: str) -> str:
    """Close a customer's account for good."""
    return f"closed {customer}"


if __name__ == "__main__":
    server.run("stdio")
