"""Tools that take as long as they are told to: for the bounded-hang tests."""

from __future__ import annotations

import os
import time

from runtime import tool


@tool(idempotent=True)
def slow_lookup(sleep_s: float) -> dict[str, object]:
    """Look something up, slowly. Safe to repeat."""
    time.sleep(sleep_s)
    return {"found": True}


@tool
def slow_charge(sleep_s: float) -> dict[str, object]:
    """Charge a card, slowly. Not idempotent."""
    time.sleep(sleep_s)
    return {"charged": True}


def _note(what: str) -> None:
    """One line per invocation in RATCHET_TEST_CALLS, for tests that count tries."""
    path = os.environ.get("RATCHET_TEST_CALLS")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(what + "\n")


@tool(idempotent=True)
def counted_lookup(sleep_s: float, fast_after: int = 0) -> dict[str, object]:
    """Look something up, slowly; from the ``fast_after``-th try on (if > 0), at once."""
    path = os.environ.get("RATCHET_TEST_CALLS")
    tries = 0
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            tries = len(handle.read().splitlines())
    _note("lookup")
    if not (fast_after and tries + 1 >= fast_after):
        time.sleep(sleep_s)
    return {"found": True}


@tool(idempotent=True)
def lookup_by_try(first_s: float, second_s: float) -> dict[str, object]:
    """Look something up: the first try takes ``first_s``, the second ``second_s``, any
    later one returns at once; each answers which try it was (RATCHET_TEST_CALLS counts)."""
    path = os.environ["RATCHET_TEST_CALLS"]
    with open(path, "a+", encoding="utf-8") as handle:
        handle.seek(0)
        tries = len(handle.read().splitlines()) + 1
        handle.write("lookup\n")
    time.sleep({1: first_s, 2: second_s}.get(tries, 0.0))
    return {"try": tries}


@tool
def counted_charge(sleep_s: float) -> dict[str, object]:
    """Charge a card, slowly. Not idempotent."""
    _note("charge")
    time.sleep(sleep_s)
    return {"charged": True}


def _host() -> str:
    """The host a tool runs on, for the multi-host tests (RATCHET_TEST_HOST), else ``?``."""
    return os.environ.get("RATCHET_TEST_HOST", "?")


def _tries(kind: str, key: str) -> int:
    path = os.environ.get("RATCHET_TEST_CALLS")
    if not path or not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as handle:
        return sum(1 for line in handle if line.split(" ")[:2] == [kind, key])


@tool
def charge_once(charge_id: str, sleep_s: float) -> dict[str, object]:
    """Charge a card, slowly. Not idempotent: each invocation notes ``charge <id> <host>``."""
    _note(f"charge {charge_id} {_host()}")
    time.sleep(sleep_s)
    return {"charged": charge_id}


@tool(idempotent=True)
def lookup_slow_first(key: str, sleep_s: float) -> dict[str, object]:
    """Look ``key`` up: slowly the first time (the try a partition cut off), at once after.

    Safe to repeat; each invocation notes ``lookup <key> <host>``.
    """
    first = _tries("lookup", key) == 0
    _note(f"lookup {key} {_host()}")
    if first:
        time.sleep(sleep_s)
    return {"found": key}
