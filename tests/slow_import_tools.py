"""A tool module that takes 2.5 s to import: a first load of its agent outlasts a 1 s lease."""

from __future__ import annotations

import time

from runtime import tool

time.sleep(2.5)


@tool(idempotent=True)
def answer(question: str) -> str:
    """Answer a question."""
    return f"answered {question}"
