"""Keys out of the HTTP libraries' logs, whatever level an operator sets.

httpcore logs response headers at DEBUG (``receive_response_headers.complete
return_value=(…, [(b'X-Echo', b'Bearer sk-…')])``), so a server that echoes the
key back puts it in the worker's log. :func:`guard_http_logs` raises the
``httpcore`` logger to WARNING unless the operator set its level, and filters
every ``httpx``/``httpcore`` logger so that a key in use by a call (registered
with :func:`redacted_in_logs` for the call's duration) is replaced by
``[redacted]`` in any record, at any level.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

_HTTP_LOGGERS = (
    "httpx",
    "httpcore",
    "httpcore.connection",
    "httpcore.http11",
    "httpcore.http2",
    "httpcore.proxy",
    "httpcore.socks",
)
"""A logger's filters see only records logged on that very logger, so each is named."""

_keys_in_use: Counter[str] = Counter()
_keys_lock = threading.Lock()


class _RedactKeys(logging.Filter):
    """Replaces every key a call is using, wherever it appears in a record's message."""

    def filter(self, record: logging.LogRecord) -> bool:
        with _keys_lock:
            keys = [k for k in _keys_in_use if k]
        if not keys:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the handler's to report, not ours
            return True
        redacted = message
        for key in keys:
            redacted = redacted.replace(key, "[redacted]")
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


@contextmanager
def redacted_in_logs(key: str | None) -> Iterator[None]:
    """While inside, ``key`` is redacted from every httpx/httpcore record."""
    if not key:
        yield
        return
    with _keys_lock:
        _keys_in_use[key] += 1
    try:
        yield
    finally:
        with _keys_lock:
            _keys_in_use[key] -= 1
            if _keys_in_use[key] <= 0:
                del _keys_in_use[key]


def guard_http_logs() -> None:
    """Install the filter on every httpx/httpcore logger (once) and quiet httpcore."""
    redact = _RedactKeys()
    for name in _HTTP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactKeys) for f in logger.filters):
            logger.addFilter(redact)
    core = logging.getLogger("httpcore")
    if core.level == logging.NOTSET:
        # httpcore logs only at DEBUG, headers included; a worker at --loglevel DEBUG
        # would print what a server echoes back. An operator's explicit level is kept.
        core.setLevel(logging.WARNING)
