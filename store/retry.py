"""Bounded retries of transient store errors, shared by every backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from runtime.errors import StoreUnavailable

T = TypeVar("T")

ATTEMPTS = 4
"""Tries in all, for one store call, before the error reaches the caller."""
MAX_DELAY_S = 2.0


def with_retries(call: Callable[[], T], run_id: str | None = None) -> T:
    """Run ``call``; retry it on StoreUnavailable a few times within ~2 s, then re-raise.

    ``run_id``: the run the call is for; the error that reaches the caller names it.
    """
    try:
        return _retried(call)
    except StoreUnavailable as exc:
        if run_id is None or exc.run_id is not None:
            raise
        raise exc.for_run(run_id) from exc


def _retried(call: Callable[[], T]) -> T:
    try:
        return call()
    except StoreUnavailable as exc:
        first_failure: list[StoreUnavailable] = [exc]

    def again() -> T:
        # The policy's first attempt is the call that just failed: tenacity then waits
        # and retries as if it had made it. A tenacity.Retrying costs more to build than
        # most store calls (a thread-local each, a greenlet-local under gevent), so the
        # call that succeeds at once — nearly every one — never builds it.
        if first_failure:
            raise first_failure.pop()
        return call()

    for attempt in Retrying(
        retry=retry_if_exception_type(StoreUnavailable),
        stop=stop_after_attempt(ATTEMPTS) | stop_after_delay(MAX_DELAY_S),
        wait=wait_exponential_jitter(multiplier=0.02, max=0.5, jitter=0.05),
        reraise=True,
    ):
        with attempt:
            return again()
    raise AssertionError("unreachable: tenacity re-raises the last error")
