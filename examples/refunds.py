"""Tools of the example refund desk.

``lookup_order`` only reads, so it is idempotent; ``issue_refund`` moves money,
so it is not: after a crash with its outcome unknown, ratchet parks the run
for an operator instead of refunding twice. ``send_refund`` is the refund as a
payment API takes it: it passes the call's idempotency key to the ledger,
which refunds a key once, and its probe ``find_refund`` asks the ledger about
the key — so after a crash the run goes on by itself instead of parking (the
demo desk uses it). Each refund appends one line to a ledger file
(``RATCHET_EXAMPLE_LEDGER``, default ``.ratchet/refunds.ledger``), which the
crash tests read to prove no refund ran twice.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import IO

from runtime import NotRun, Ran, ToolContext, tool
from runtime.probes import ProbeResult

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


@tool(idempotent=True)
def scan_history(order_id: str, pages: int, call: ToolContext) -> dict[str, object]:
    """Read an order's tracking history, page by page (reports its progress as it goes)."""
    pause_s = float(os.environ.get("RATCHET_EXAMPLE_PAGE_S", "0.05"))
    for page in range(1, pages + 1):
        time.sleep(pause_s)
        call.progress(f"read page {page} of {pages}")
    return {"order_id": order_id, "pages": pages, "last_scan": "left the depot, not seen since"}


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


# --- the refund as a payment API would take it: an idempotency key and a probe ---------


def _ledger() -> Path:
    return Path(os.environ.get("RATCHET_EXAMPLE_LEDGER", ".ratchet/refunds.ledger"))


def _refunded(handle: IO[str], key: str) -> dict[str, object] | None:
    handle.seek(0)
    for line in handle.read().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[3] == key:
            return {"order_id": parts[1], "refunded_cents": int(parts[2]), "status": "refunded"}
    return None


def find_refund(call: ToolContext) -> ProbeResult:
    """The probe of ``send_refund``: asks the ledger about the call's key, changes nothing."""
    path = _ledger()
    if not path.exists():
        return NotRun()
    with path.open("r", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        found = _refunded(handle, call.idempotency_key)
    return Ran(found) if found is not None else NotRun()


def _api_latency() -> None:
    """Half of ``RATCHET_EXAMPLE_REFUND_LATENCY_S`` (default 0): a payment API's round trip,
    half before the refund is booked and half after, as bench/chaos.py sets it."""
    latency_s = float(os.environ.get("RATCHET_EXAMPLE_REFUND_LATENCY_S", "0") or 0)
    if latency_s > 0:
        time.sleep(latency_s / 2)


@tool(probe=find_refund)
def send_refund(order_id: str, amount_cents: int, call: ToolContext) -> dict[str, object]:
    """Refund an order. Not idempotent, but the ledger deduplicates on the call's key."""
    _api_latency()
    path = _ledger()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", encoding="utf-8") as handle:
        # The ledger is the "payment API": a second request with a key it has seen
        # returns the first refund instead of moving money again (an abandoned
        # attempt that finishes after its probe said "not run" included).
        fcntl.flock(handle, fcntl.LOCK_EX)
        found = _refunded(handle, call.idempotency_key)
        if found is not None:
            return found
        handle.write(f"refund {order_id} {amount_cents} {call.idempotency_key}\n")
        handle.flush()
        os.fsync(handle.fileno())
    _api_latency()
    return {"order_id": order_id, "refunded_cents": amount_cents, "status": "refunded"}
