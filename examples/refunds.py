"""Tools of the example refund desk.

``lookup_order`` only reads, so it is idempotent; ``issue_refund`` moves money,
so it is not: after a crash with its outcome unknown, ratchet parks the run
for an operator instead of refunding twice. Each refund appends one line to a
ledger file (``RATCHET_EXAMPLE_LEDGER``, default ``.ratchet/refunds.ledger``),
which the crash tests read to prove no refund ran twice.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime import tool

ORDERS = {
    "A1": {"order_id": "A1", "item": "kettle", "amount_cents": 4900, "status": "delivered"},
    "B2": {"order_id": "B2", "item": "toaster", "amount_cents": 2900, "status": "lost in transit"},
}


@tool(idempotent=True)
def lookup_order(order_id: str) -> dict[str, object]:
    """Find an order by id."""
    if order_id not in ORDERS:
        raise KeyError(f"no order {order_id}")
    return ORDERS[order_id]


@tool(idempotent=True)
def refund_policy(reason: str) -> dict[str, object]:
    """Say whether a refund reason is covered by policy."""
    covered = any(word in reason.lower() for word in ("lost", "broken", "damaged", "late"))
    return {"reason": reason, "covered": covered}


@tool
def issue_refund(order_id: str, amount_cents: int) -> dict[str, object]:
    """Refund an order. Not idempotent: it moves money."""
    ledger = Path(os.environ.get("RATCHET_EXAMPLE_LEDGER", ".ratchet/refunds.ledger"))
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a", encoding="utf-8") as handle:
        handle.write(f"refund {order_id} {amount_cents}\n")
        handle.flush()
        os.fsync(handle.fileno())
    return {"order_id": order_id, "refunded_cents": amount_cents, "status": "refunded"}
