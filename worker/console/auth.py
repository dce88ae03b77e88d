"""Who may use the console: one shared token, then a session cookie and a CSRF token.

- The token comes from ``RATCHET_CONSOLE_TOKEN`` and is compared in constant time
  (:func:`hmac.compare_digest`); it is never written to a page, a log or an error.
- A login makes a session: a random id in an ``HttpOnly``, ``SameSite=Strict``
  cookie, held in this process's memory (a restart logs everyone out), with a CSRF
  token of its own that every action form carries and every POST must return.
- Scripts may send ``Authorization: Bearer TOKEN`` instead of a cookie, for reads.
- Wrong tokens are rate-limited per client address (:class:`LoginThrottle`): past
  ``MAX_FAILURES`` in ``FAILURE_WINDOW_S`` the address is answered 429 until the
  oldest failure leaves the window, right token or not. Behind a reverse proxy every
  client is the proxy's address: limit logins there too.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.errors import ConfigInvalid

COOKIE = "ratchet_console"
SESSION_S = 12 * 3600
"""How long a login lasts."""
MIN_TOKEN_CHARS = 16
MAX_FAILURES = 10
"""Wrong tokens an address may send in ``FAILURE_WINDOW_S`` before it must wait."""
FAILURE_WINDOW_S = 60.0
MAX_ADDRESSES = 10_000
"""Addresses whose failures are remembered; past it the one that failed least lately goes."""


class ConsoleSettings(BaseSettings):
    """The console's settings live with its optional extra, not in the core Settings."""

    model_config = SettingsConfigDict(env_prefix="RATCHET_CONSOLE_", extra="ignore")

    token: SecretStr | None = None
    """The secret an operator types to log in; at least 16 characters."""
    host: str = "127.0.0.1"
    """Where the console listens; anything but loopback is plain HTTP to the network."""
    port: int = Field(default=8765, ge=1, le=65535)
    max_streams: int = Field(default=64, ge=1, le=10_000)
    """Run pages streamed to at once (each holds a thread); past it, 503 with Retry-After."""
    keepalive_s: float = Field(default=15.0, ge=0.5, le=3600, allow_inf_nan=False)
    """A quiet stream gets a comment line this often (proxies keep it open; a page that
    went away gives its stream back at the latest then)."""


def console_settings() -> ConsoleSettings:
    """The console's settings from the environment; ConfigInvalid naming a bad variable."""
    try:
        return ConsoleSettings()
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        variable = "RATCHET_CONSOLE_" + str(error["loc"][0] if error["loc"] else "").upper()
        problem = str(error["msg"])
        raise ConfigInvalid(
            variable,
            f"{variable} is refused: {problem[:1].lower()}{problem[1:]}; set a valid value, "
            "or unset it for the default",
        ) from None


def console_token(settings: ConsoleSettings) -> str:
    """The configured token; ConfigInvalid saying how to set one if it is missing or short."""
    token = settings.token.get_secret_value() if settings.token is not None else ""
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigInvalid(
            "RATCHET_CONSOLE_TOKEN",
            "the console needs RATCHET_CONSOLE_TOKEN, a secret of at least "
            f"{MIN_TOKEN_CHARS} characters (make one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return token


def same_secret(given: str | None, expected: str) -> bool:
    """Constant-time comparison; an absent value is never equal."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


@dataclass
class Session:
    csrf: str
    expires_at: float
    flashes: list[str] = field(default_factory=list)
    """Outcomes of actions, shown once on the next page (post, redirect, get)."""


class Sessions:
    """Logged-in browsers of this process. Thread-safe."""

    def __init__(self, lifetime_s: float = SESSION_S) -> None:
        self.lifetime_s = lifetime_s
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self) -> tuple[str, Session]:
        session_id = secrets.token_urlsafe(32)
        session = Session(secrets.token_urlsafe(32), time.monotonic() + self.lifetime_s)
        with self._lock:
            now = time.monotonic()
            for old in [k for k, s in self._sessions.items() if s.expires_at < now]:
                del self._sessions[old]
            self._sessions[session_id] = session
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and session.expires_at < time.monotonic():
                del self._sessions[session_id]
                return None
        return session

    def close(self, session_id: str | None) -> None:
        with self._lock:
            self._sessions.pop(session_id or "", None)


class LoginThrottle:
    """Wrong tokens per client address, in bounded memory. Thread-safe.

    An address that sent ``max_failures`` wrong tokens within ``window_s`` is refused
    until the oldest of them is ``window_s`` old: a guesser gets ``max_failures`` tries
    a window. At most ``max_addresses`` addresses are remembered (each with at most
    ``max_failures`` times); a new one pushes out the one whose last failure is oldest.
    """

    def __init__(
        self,
        max_failures: int = MAX_FAILURES,
        window_s: float = FAILURE_WINDOW_S,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures, self.window_s, self.max_addresses = max_failures, window_s, max_addresses
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def wait_s(self, address: str) -> float:
        """How long ``address`` must wait before its next try; 0 when it may try now."""
        with self._lock:
            times = self._failures.get(address)
            if times is None or len(times) < self.max_failures:
                return 0.0
            return max(0.0, times[0] + self.window_s - self._clock())

    def failed(self, address: str) -> None:
        """``address`` sent a wrong token."""
        with self._lock:
            now = self._clock()
            times = self._failures.pop(address, None) or deque(maxlen=self.max_failures)
            while times and times[0] + self.window_s <= now:
                times.popleft()
            times.append(now)
            self._failures[address] = times  # last: the most recent failure
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """``address`` logged in: its failures are forgotten."""
        with self._lock:
            self._failures.pop(address, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._failures)
