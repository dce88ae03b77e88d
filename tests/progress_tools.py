"""A tool that reports its progress page by page, each page gated by the test.

``paged`` reports ``page K of N`` through its ToolContext, then waits (at most 10 s) for
the file ``page-K`` in ``RATCHET_TEST_GATES``: the test creates it once every observer has
shown that progress, which proves they showed it while the tool was still running. A
wait that runs out is written to ``missed`` there, for the test to fail on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from runtime import ToolContext, tool


@tool(idempotent=True)
def paged(pages: int, call: ToolContext) -> dict[str, object]:
    """Read an order's history, page by page."""
    gates = Path(os.environ["RATCHET_TEST_GATES"])
    for page in range(1, pages + 1):
        call.progress(f"page {page} of {pages}")
        deadline = time.monotonic() + 10
        while not (gates / f"page-{page}").exists():
            if time.monotonic() > deadline:
                with (gates / "missed").open("a") as missed:
                    missed.write(f"page {page}\n")
                break
            time.sleep(0.01)
    return {"pages": pages}
