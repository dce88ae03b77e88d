"""A provider for any OpenAI-compatible chat-completions endpoint (OpenAI, Ollama, vLLM, …).

::

    model = "openai:gpt-4o-mini"
    [provider]                         # every key optional
    base_url = "http://127.0.0.1:11434/v1"   # else RATCHET_OPENAI_BASE_URL, else OpenAI
    api_key_env = "MY_KEY_VAR"         # the NAME of the variable; else RATCHET_OPENAI_API_KEY
    timeout_s = 60                     # per HTTP request
    max_attempts = 4                   # requests per model call, first one included
    max_retry_s = 60                   # no retry starts (or sleeps) past this many seconds
    temperature = 0.2                  # sent only when set
    stream = true                      # ask for server-sent events (default false)

It speaks HTTP through ``httpx`` rather than the ``openai`` SDK: one small
dependency instead of a large one, and full control of retries. The SDK
retries on its own (twice by default, with its own backoff); stacked under
tenacity that multiplies attempts invisibly, and a hidden retry is an attempt
the run's event log never sees. Here every request is one attempt, tenacity
owns the policy, and the observer hears about each retry.

Guarantees:

- **429 is not retried here**: it raises ``ProviderRateLimited`` at once with
  the server's ``Retry-After`` (seconds or an HTTP-date), and the turn goes back
  on the queue with that countdown, holding no worker slot (tasks/limits.py).
- **Retries**: 408, 5xx, timeouts and connection errors are retried,
  honouring ``Retry-After``, at most
  ``max_attempts`` requests, and no sleep reaches past ``max_retry_s`` after
  the first request (a ``Retry-After`` beyond that ends the call at once).
  Without ``Retry-After`` the wait is exponential from 0.5 s (capped at 8 s),
  with jitter. Exhausted retries raise ``ProviderError(retryable=True)``
  naming the attempts and the last status. Any other 4xx, a body that is not
  a chat completion, or a missing ``api_key_env`` variable raise
  ``ProviderError(retryable=False)`` after one request (or none).
- **Observer**: ``complete(request, observer=f)`` calls
  ``f("model.retrying", {"attempt": n, "status": code | None, "error": text,
  "wait_s": seconds})`` before each retry sleep; ``attempt`` is the 1-based
  number of the request that just failed, ``status`` its HTTP status (``None``
  for a timeout or connection error). An exception from the observer ends the
  call and propagates unchanged (a worker that lost its lease must stop).
- **Malformed tool arguments**: a tool call whose ``arguments`` is not JSON,
  or is JSON but not an object, does not fail the call. Its
  :class:`~runtime.models.ToolCall` carries exactly one argument,
  :data:`runtime.provider.INVALID_ARGUMENTS_KEY` (``"__invalid_json__"``), holding the raw
  string; the runtime answers such a call with a ``tool.failed`` result
  ("arguments were not valid JSON: …") without running the tool, so the model
  can correct itself. Sent back in a later request, the call's arguments are
  that one-key object, so the model sees its own text beside the error.
  Empty ``arguments`` (some servers send ``""`` for a tool without
  parameters) mean ``{}``; an object instead of a string is taken as is.
- **Streaming** (``stream = true``): the request asks for ``stream: true`` (with
  ``stream_options.include_usage``, so usage comes in the final chunk where the server
  gives it) and the events are read as they come; ``complete(request, deltas=f)`` calls
  ``f({"attempt": n, "text": piece})`` for each piece of text and ``f({"attempt": n,
  "call": index, "id": id, "name": name, "arguments": piece})`` for each piece of a tool
  call, and ``f({"attempt": n, "aborted": reason})`` when a stream is cut off before its
  ``[DONE]``. The response is assembled and returned whole, exactly as without streaming,
  so durability does not change; a stream cut off (a reset, a read timeout, an end before
  ``[DONE]``, an ``error`` event) is the failed attempt it was and is retried as one. An
  exception from ``f`` ends the call and propagates unchanged, as the observer's does.
- **Which key, sent where**: ``api_key_env`` may only name a variable the
  operator allows in ``RATCHET_OPENAI_KEY_VARIABLES`` (comma-separated names or
  ``fnmatch`` patterns; default ``RATCHET_OPENAI_API_KEY,*_API_KEY``), so an
  agent file cannot send ``AWS_SECRET_ACCESS_KEY`` as a Bearer token. A key is
  never sent over plain ``http://`` to a host other than loopback (``localhost``,
  127.0.0.0/8, ``::1``): refused at load when the file names a key variable, and
  at each call before any request when a key would be sent.
- **DEBUG logs**: httpcore logs response headers at DEBUG, and a server that
  echoes the key puts it there. Importing this module raises the ``httpcore``
  logger to WARNING unless the operator set its level, and every
  ``httpx``/``httpcore`` record has the key of a call in flight redacted,
  whatever its level (:mod:`runtime_io.providers.redaction`).
- **The API key** is read from the environment at each call and never kept
  on the provider. It is not in ``identity()``, the repr, logs, observer
  payloads or exceptions; text quoted from a server's response is redacted
  too, since servers sometimes echo the header back.
"""

from __future__ import annotations

import email.utils
import fnmatch
import ipaddress
import json
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any, ClassVar

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tenacity import RetryCallState, Retrying, retry_if_exception_type

from runtime.errors import ProviderError, ProviderRateLimited, plain_problem
from runtime.memo import IdentityMemo
from runtime.models import Message, TokenUsage
from runtime.numbers import Finite
from runtime.provider import (
    INVALID_ARGUMENTS_KEY,
    Deltas,
    ModelRequest,
    ModelResponse,
    Observer,
)
from runtime_io.providers.http import (
    bounds_calls,
    build_shared_client,
    pause,
    pool_size,
    shared_client,
    time_left,
)
from runtime_io.providers.redaction import guard_http_logs, redacted_in_logs

log = logging.getLogger("ratchet.providers.openai")
guard_http_logs()

DEFAULT_BASE_URL = "https://api.openai.com/v1"
BASE_URL_ENV = "RATCHET_OPENAI_BASE_URL"
API_KEY_ENV = "RATCHET_OPENAI_API_KEY"
KEY_VARIABLES_ENV = "RATCHET_OPENAI_KEY_VARIABLES"
DEFAULT_KEY_VARIABLES = f"{API_KEY_ENV},*_API_KEY"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 8.0
_QUOTE_CHARS = 300


class ProviderTable(BaseModel):
    """The agent file's ``[provider]`` table; every key is optional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    KEY_VARIABLES: ClassVar[tuple[str, str]] = (KEY_VARIABLES_ENV, DEFAULT_KEY_VARIABLES)
    """The operator's allow-list variable for ``api_key_env``, and its default."""

    base_url: str | None = None
    """Overrides ``RATCHET_OPENAI_BASE_URL``; ends before ``/chat/completions``."""
    api_key_env: str | None = None
    """Name of the environment variable holding the key; overrides ``RATCHET_OPENAI_API_KEY``."""
    timeout_s: Finite = Field(default=60.0, gt=0)
    """Per request: the longest wait to connect, send, or for the next bytes of the answer."""
    max_attempts: int = Field(default=4, ge=1)
    """Requests per model call, the first included."""
    max_retry_s: Finite = Field(default=60.0, ge=0)
    """No retry sleeps past this many seconds after the first request."""
    temperature: Finite | None = Field(default=None, ge=0, le=2)
    """Sampling temperature; the server's default when unset."""
    max_tokens: int | None = Field(default=None, ge=1)
    """The completion's length limit, sent when set (and the rate limiter's estimate)."""
    stream: bool = False
    """Ask for server-sent events and hand their pieces to ``deltas`` as they come."""

    @field_validator("api_key_env")
    @classmethod
    def _is_a_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            # The message must not quote the value: it may be the key pasted by mistake.
            raise ValueError(
                "must be the NAME of an environment variable (letters, digits, `_`), "
                "not the key itself"
            )
        setting, default = cls.KEY_VARIABLES
        if value is not None and not key_variable_allowed(value, setting, default):
            raise ValueError(
                f"names the variable {value}, which is not one the operator allows as a key "
                f"({setting}={allowed_key_variables(setting, default)}); name an allowed "
                f"variable, or ask the operator to add it to {setting}"
            )
        return value


def allowed_key_variables(
    setting: str = KEY_VARIABLES_ENV, default: str = DEFAULT_KEY_VARIABLES
) -> str:
    """The operator's list of key variables (names or fnmatch patterns), comma-separated,
    from the variable ``setting`` (each provider has its own)."""
    return os.environ.get(setting) or default


def key_variable_allowed(
    name: str, setting: str = KEY_VARIABLES_ENV, default: str = DEFAULT_KEY_VARIABLES
) -> bool:
    """Whether ``api_key_env`` may name ``name`` (case-sensitive match of any pattern)."""
    patterns = [p.strip() for p in allowed_key_variables(setting, default).split(",")]
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns if pattern)


def is_loopback(host: str) -> bool:
    """``localhost`` (and its subdomains, RFC 6761), 127.0.0.0/8 or ``::1``."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_provider_table(
    settings: dict[str, Any], table_type: type[ProviderTable] = ProviderTable
) -> ProviderTable:
    """Read the ``[provider]`` table of a raw agent file; ``ValueError`` names the bad key."""
    table = settings.get("provider", {})
    if not isinstance(table, dict):
        raise ValueError("`[provider]` must be a table")
    if "api_key" in table:
        raise ValueError(
            "`[provider] api_key` is refused: a key in an agent file ends up in version "
            "control; put it in an environment variable and name that variable with "
            '`api_key_env = "MY_KEY_VAR"`'
        )
    try:
        return table_type.model_validate(table)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(table)"
        problem = "unknown key" if err["type"] == "extra_forbidden" else plain_problem(err["msg"])
        raise ValueError(f"`[provider] {key}`: {problem}") from None


class _RetryableFailure(Exception):
    """One request failed in a way another request may not (internal to the retry loop)."""

    def __init__(self, status: int | None, error: str, retry_after_s: float | None = None):
        super().__init__(error)
        self.status, self.error, self.retry_after_s = status, error, retry_after_s


class OpenAIProvider:
    """Chat completions over HTTP. Holds no secret; safe to share between threads.

    The HTTP call, the key rules, the retry policy and the error texts are shared with
    other wire formats (:class:`runtime_io.providers.anthropic.AnthropicProvider`): a
    subclass names its variables and endpoint below and overrides ``payload``,
    ``auth_headers`` and ``parse``.
    """

    NAME: ClassVar[str] = "openai"
    TABLE: ClassVar[type[ProviderTable]] = ProviderTable
    DEFAULT_BASE_URL: ClassVar[str] = DEFAULT_BASE_URL
    BASE_URL_ENV: ClassVar[str] = BASE_URL_ENV
    API_KEY_ENV: ClassVar[str] = API_KEY_ENV
    ENDPOINT: ClassVar[str] = "/chat/completions"
    WIRE: ClassVar[str] = "an OpenAI-compatible API, usually ending in /v1"
    """What ``base_url`` must point at, for the errors that suspect it does not."""

    def __init__(self, model: str, base_url: str, table: ProviderTable | None = None) -> None:
        if not model.strip():
            raise ValueError(f'the model name is empty: write `model = "{self.NAME}:<model-name>"`')
        try:
            url = httpx.URL(base_url.rstrip("/"))
        except httpx.InvalidURL:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            # Not quoted: a URL may carry credentials.
            raise ValueError(
                "`[provider] base_url`: not an http(s) URL with a host, e.g. "
                f"{self.DEFAULT_BASE_URL}"
            )
        self.model = model
        self._url = url
        self._table = table or ProviderTable()
        if self._table.api_key_env is not None and not self._key_may_travel():
            raise ValueError(
                f"`[provider] api_key_env`: a key would be sent over plain http to "
                f"{self._host}; use https, or a loopback base_url"
            )

    def _key_may_travel(self) -> bool:
        return self._url.scheme == "https" or is_loopback(self._url.host)

    @classmethod
    def from_settings(cls, model: str, settings: dict[str, Any]) -> OpenAIProvider:
        """Build from the raw agent file: ``[provider]`` table first, then the environment."""
        table = parse_provider_table(settings, cls.TABLE)
        base_url = table.base_url or os.environ.get(cls.BASE_URL_ENV) or cls.DEFAULT_BASE_URL
        return cls(model, base_url, table)

    @property
    def _host(self) -> str:
        host = f"[{self._url.host}]" if ":" in self._url.host else self._url.host
        return f"{host}:{self._url.port}" if self._url.port is not None else host

    @property
    def max_tokens(self) -> int | None:
        return self._table.max_tokens

    @property
    def streams(self) -> bool:
        """Whether ``complete`` hands the answer's pieces to ``deltas`` as they come."""
        return self._table.stream

    @property
    def bounds_calls(self) -> bool:
        """Whether a call ends within the deadline ``call_deadline`` gives it
        (runtime_io/providers/http.py): its requests, and the pauses between them, do."""
        return bounds_calls()

    def limit_key(self) -> str:
        """The default name of this provider's shared rate limit: host, model and key variable
        (the variable's name, never the key)."""
        key_variable = self._table.api_key_env or self.API_KEY_ENV
        return f"{self.NAME}/{self._host}/{self.model}/{key_variable}"

    def prepare(self) -> None:
        """Build what a request needs before it can go (the process's HTTP client), so that
        one a rate limit lets through is sent at once, not after a fresh process's setup."""
        build_shared_client()

    def identity(self) -> dict[str, Any]:
        # The host, not the URL: a URL may carry credentials, and the key never goes here.
        return {"provider": self.NAME, "model": self.model, "base_url_host": self._host}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, host={self._host!r})"

    # --- one model call -------------------------------------------------------

    def complete(
        self,
        request: ModelRequest,
        *,
        observer: Observer | None = None,
        deltas: Deltas | None = None,
    ) -> ModelResponse:
        """One model call: up to ``max_attempts`` requests, within ``max_retry_s``.

        Raises ProviderError only (and whatever ``observer`` or ``deltas`` raise, unchanged).
        """
        key = self._api_key()
        if key and not self._key_may_travel():
            raise ProviderError(
                f"{self._describe()}: refusing to send the API key over plain http to a "
                "host that is not loopback; use an https base_url (or unset the key "
                "variable for a server that needs none)"
            )
        streams = self._table.stream and deltas is not None  # nobody to tell: read it whole
        accept = "text/event-stream" if streams else "application/json"
        headers = {"Accept": accept, **self.auth_headers(key)}
        payload = self.payload(request)
        if streams:
            payload.update(self.stream_fields())
        started = time.monotonic()
        client = shared_client()
        attempts = 0

        def attempt() -> Any:
            nonlocal attempts
            attempts += 1
            return self._post(client, payload, key, headers, attempts, deltas)

        try:
            with redacted_in_logs(key):
                try:
                    body = attempt()  # most calls need no other: no retry machinery for them
                except _RetryableFailure as first:
                    body = self._retried(first, started, attempt, key, observer)
        except _RetryableFailure as last:
            raise self._gave_up(last, attempts, time.monotonic() - started, key) from None
        return self.parse(body, request.model_call)

    def _retried(
        self,
        first: _RetryableFailure,
        started: float,
        attempt: Callable[[], Any],
        key: str | None,
        observer: Observer | None,
    ) -> Any:
        """The attempts after a ``first`` that failed, by tenacity's rules (this provider's
        stop, wait and warning), as if tenacity had made the first too: it sees ``first`` as
        its attempt 1, timed from ``started``, the call's start. (A tenacity loop costs ~30 µs
        even when its first attempt succeeds, and that is most calls.)"""
        failed = [first]

        def from_the_call_start(state: RetryCallState) -> None:
            if state.attempt_number == 1:
                state.start_time = started

        retrying = Retrying(
            retry=retry_if_exception_type(_RetryableFailure),
            stop=self._should_stop,
            wait=self._wait_s,
            before=from_the_call_start,
            before_sleep=lambda state: self._before_sleep(state, key, observer),
            sleep=pause,
            reraise=True,
        )
        body: Any = None
        for each in retrying:
            with each:
                if failed:
                    raise failed.pop()  # the first attempt, already made
                body = attempt()
        return body

    def stream_fields(self) -> dict[str, Any]:
        """What a streamed request adds to the payload (usage comes in the last chunk)."""
        return {"stream": True, "stream_options": {"include_usage": True}}

    def assembly(self, attempt: int, deltas: Deltas | None) -> StreamAssembly:
        """What puts one attempt's stream of events back together as one body."""
        return _Assembly(attempt, deltas)

    def auth_headers(self, key: str | None) -> dict[str, str]:
        """The headers that carry ``key`` (none without one) and name the API's version."""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def parse(self, body: Any, model_call: int) -> ModelResponse:
        """A response body as a :class:`ModelResponse`; ProviderError if it is not one."""
        return parse_response(body, model_call, self._describe())

    def payload(self, request: ModelRequest) -> dict[str, Any]:
        """The JSON body of ``POST /chat/completions`` for ``request``."""
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [_wire_message(m) for m in request.messages],
        }
        if request.tools:
            # OpenAI refuses an empty `tools` array, so it is left out rather than sent empty.
            payload["tools"] = [to_openai_tool(d) for d in request.tools]
        if self._table.temperature is not None:
            payload["temperature"] = self._table.temperature
        if self._table.max_tokens is not None:
            payload["max_tokens"] = self._table.max_tokens
        return payload

    def _api_key(self) -> str | None:
        name = self._table.api_key_env
        if name is None:
            return os.environ.get(self.API_KEY_ENV) or None
        setting, default = self.TABLE.KEY_VARIABLES
        if not key_variable_allowed(name, setting, default):
            # Checked again here: the operator's list may have changed since the file loaded.
            raise ProviderError(
                f"{self._describe()}: `[provider] api_key_env` names {name}, which "
                f"{setting} does not allow as a key; name an allowed variable"
            )
        key = os.environ.get(name)
        if not key:
            raise ProviderError(
                f"{self._describe()}: environment variable {name} (named by `[provider] "
                f"api_key_env`) is not set on this worker; export it where the worker runs"
            )
        return key

    def _describe(self) -> str:
        return f"model `{self.model}` at {self._host}"

    def _post(
        self,
        client: httpx.Client,
        payload: dict[str, Any],
        key: str | None,
        headers: dict[str, str],
        attempt: int = 1,
        deltas: Deltas | None = None,
    ) -> Any:
        """One request: the response body as JSON (a stream's events assembled into one)."""
        timeout_s = self._table.timeout_s
        streams = bool(payload.get("stream"))
        try:
            response = client.send(
                client.build_request(
                    "POST",
                    f"{self._url}{self.ENDPOINT}",
                    json=payload,
                    headers=headers,
                    timeout=timeout_s,
                ),
                stream=streams,
            )
        except httpx.PoolTimeout:
            raise _RetryableFailure(
                None,
                f"all {pool_size()} connections of this process's HTTP pool stayed busy for "
                f"{timeout_s:g} s (more model calls at once than the worker's concurrency?)",
            ) from None
        except httpx.TimeoutException:
            time_left()  # the call's deadline, if it has passed, not the request's timeout
            timeout_s = self._table.timeout_s
            raise _RetryableFailure(None, f"no answer within timeout_s={timeout_s:g}") from None
        except httpx.TransportError as exc:
            raise _RetryableFailure(None, _redact(f"connection failed: {exc}", key)) from None
        except httpx.HTTPError as exc:
            raise ProviderError(_redact(f"{self._describe()}: {exc}", key)) from None
        try:
            if streams and response.status_code == 200:
                return self._read_stream(response, key, attempt, deltas)
            if streams:
                self._read(response, key)
            return self._answer(response, key)
        finally:
            response.close()

    def _read(self, response: httpx.Response, key: str | None) -> None:
        """The whole body of a streamed response (an error's), as a failed attempt if cut."""
        try:
            response.read()
        except httpx.TimeoutException:
            time_left()
            raise _RetryableFailure(
                response.status_code, f"no answer within timeout_s={self._table.timeout_s:g}"
            ) from None
        except httpx.TransportError as exc:
            raise _RetryableFailure(response.status_code, _redact(f"cut off: {exc}", key)) from None

    def _read_stream(
        self, response: httpx.Response, key: str | None, attempt: int, deltas: Deltas | None
    ) -> dict[str, Any]:
        """A 200 stream's events, each piece handed to ``deltas``, assembled into a body."""
        stream = self.assembly(attempt, deltas)
        lines = response.iter_lines()
        try:
            for data in server_sent_data(lines):
                if stream.feed(data, key):
                    _drain(lines)
                    return stream.body()
        except httpx.TimeoutException:
            time_left()
            raise stream.cut(f"no event within timeout_s={self._table.timeout_s:g}") from None
        except httpx.TransportError as exc:
            raise stream.cut(_redact(f"cut off: {exc}", key)) from None
        raise stream.cut(f"the stream ended before its {stream.END}")

    def _answer(self, response: httpx.Response, key: str | None) -> Any:
        """The JSON body of a response read whole, or the failure its status says."""
        status = response.status_code
        if status == 429:
            # Not retried here: sleeping out Retry-After would hold the worker's slot. The
            # turn goes back on the queue with a countdown instead (tasks/limits.py).
            after = retry_after_s(response.headers)
            raise ProviderRateLimited(
                f"{self._describe()}: HTTP 429: {_server_message(response, key)}"
                + (f"; the server asks to wait {after:g} s" if after is not None else ""),
                after,
            )
        if status == 408 or status >= 500:
            raise _RetryableFailure(
                status, _server_message(response, key), retry_after_s(response.headers)
            )
        if status >= 400:
            raise ProviderError(self._refusal_text(response, key))
        if status >= 300:
            raise ProviderError(
                f"{self._describe()}: HTTP {status}, redirected to "
                f"{_quote(response.headers.get('location', '?'), key, 200)}; redirects are not "
                "followed (they can drop the Authorization header): set base_url to the final URL"
            )
        try:
            return response.json()
        except ValueError:
            raise ProviderError(
                f"{self._describe()}: HTTP {status} but the body is not JSON "
                f"(starts {_quote(response.text, key, 80)!r}); check that base_url points at "
                f"{self.WIRE}"
            ) from None

    def _refusal_text(self, response: httpx.Response, key: str | None) -> str:
        status = response.status_code
        hint = {
            401: f"check the key in {self._table.api_key_env or self.API_KEY_ENV}"
            + ("" if key else f" (none was sent: {self.API_KEY_ENV} is not set)"),
            403: "the key is not allowed to use this model or endpoint",
            404: "check the model name and base_url",
        }.get(status, "the request was refused; it is not retried")
        return f"{self._describe()}: HTTP {status}: {_server_message(response, key)}; {hint}"

    # --- the retry policy (tenacity hooks) ------------------------------------

    def _should_stop(self, state: RetryCallState) -> bool:
        if state.attempt_number >= self._table.max_attempts:
            return True
        after = _failure(state).retry_after_s or 0.0
        return _elapsed_s(state) + after > self._table.max_retry_s

    def _wait_s(self, state: RetryCallState) -> float:
        after = _failure(state).retry_after_s
        if after is not None:
            return after
        backoff = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2.0 ** (state.attempt_number - 1))
        left = max(0.0, self._table.max_retry_s - _elapsed_s(state))
        return min(backoff * random.uniform(0.5, 1.0), left)

    def _before_sleep(
        self, state: RetryCallState, key: str | None, observer: Observer | None
    ) -> None:
        failure = _failure(state)
        wait_s = round(state.next_action.sleep if state.next_action else 0.0, 3)
        data = {
            "attempt": state.attempt_number,
            "status": failure.status,
            "error": _redact(failure.error, key),
            "wait_s": wait_s,
        }
        log.warning(
            "%s: attempt %d failed (%s); retrying in %.2f s",
            self._describe(),
            data["attempt"],
            data["error"],
            wait_s,
        )
        if observer is not None:
            observer("model.retrying", data)

    def _gave_up(
        self, last: _RetryableFailure, attempts: int, elapsed_s: float, key: str | None
    ) -> ProviderError:
        t = self._table
        what = f"HTTP {last.status}" if last.status is not None else "no HTTP status"
        why = f"max_attempts={t.max_attempts}"
        if attempts < t.max_attempts:
            why = f"max_retry_s={t.max_retry_s:g}"
            if last.retry_after_s is not None:
                why += f"; the server asked to wait {last.retry_after_s:g} s more"
        return ProviderError(
            _redact(
                f"{self._describe()}: gave up after {attempts} attempt(s) in {elapsed_s:.1f} s "
                f"({why}); last: {what}: {last.error}; the server may recover — try again later",
                key,
            ),
            retryable=True,
        )


def _elapsed_s(state: RetryCallState) -> float:
    return state.seconds_since_start or 0.0


def _failure(state: RetryCallState) -> _RetryableFailure:
    exc = state.outcome.exception() if state.outcome is not None else None
    assert isinstance(exc, _RetryableFailure), "only _RetryableFailure is retried"
    return exc


def retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or HTTP-date); ``None`` if
    absent or unreadable."""
    value = headers.get("retry-after", "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


# --- wire format ----------------------------------------------------------------


def to_openai_message(message: Message) -> dict[str, Any]:
    """One transcript entry in the chat-completions format."""
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        # `null`, not "", is the documented content of an assistant turn that only calls tools.
        out["content"] = message.content or None
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": json.dumps(call.arguments, ensure_ascii=False),
                },
            }
            for call in message.tool_calls
        ]
    return out


def _wire_message(message: Message) -> dict[str, Any]:
    """:func:`to_openai_message`, made once per message in this process: every call of a run
    sends its whole transcript, and a turn of a run this process holds has the same message
    objects (frozen) as the turn before. The dict is shared: nothing may change it."""
    made = _wire_messages.get(message)
    if made is None:
        made = to_openai_message(message)
        _wire_messages.put(message, made)
    return made


def _wire_size(made: dict[str, Any]) -> int:
    """Roughly the bytes a wire message adds to the message it was made from."""
    calls = made.get("tool_calls") or ()
    return 200 + sum(len(call["function"]["arguments"]) + 100 for call in calls)


_wire_messages: IdentityMemo[Message, dict[str, Any]] = IdentityMemo(
    4096, 16 * 1024 * 1024, _wire_size, threading.Lock()
)
os.register_at_fork(after_in_child=lambda: _wire_messages.renew_lock(threading.Lock()))


def to_openai_tool(declaration: dict[str, Any]) -> dict[str, Any]:
    """A tool declaration as OpenAI wants it; ratchet's own keys (``idempotent``) stay home."""
    return {
        "type": "function",
        "function": {
            "name": declaration["name"],
            "description": declaration.get("description", ""),
            "parameters": declaration.get("parameters", {"type": "object", "properties": {}}),
        },
    }


def parse_arguments(raw: Any) -> dict[str, Any]:
    """A tool call's arguments; ``{INVALID_ARGUMENTS_KEY: raw}`` when they are not an object."""
    if isinstance(raw, dict):  # some compatible servers send an object, not a string
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    text = raw if isinstance(raw, str) else json.dumps(raw)
    try:
        # NaN, a lone surrogate pass here: checked_response refuses them, whatever provider.
        value = json.loads(text)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {INVALID_ARGUMENTS_KEY: text}


def parse_response(body: Any, model_call: int, where: str) -> ModelResponse:
    """A chat-completion body as a :class:`ModelResponse`; ProviderError if it is not one."""

    def malformed(problem: str) -> ProviderError:
        return ProviderError(
            f"{where}: the response is not a chat completion ({problem}); check that base_url "
            "points at an OpenAI-compatible /chat/completions API"
        )

    if not isinstance(body, dict):
        raise malformed(f"the body is a JSON {type(body).__name__}, not an object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise malformed("no `choices`")
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        raise malformed("`choices[0]` has no `message`")
    calls = []
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise malformed(f"`tool_calls[{index}]` has no function name")
        calls.append(
            {
                "id": call.get("id") or f"call_{model_call + 1}_{index + 1}",
                "name": function["name"],
                "arguments": parse_arguments(function.get("arguments")),
            }
        )
    content = message.get("content") or message.get("refusal") or ""
    if not isinstance(content, str):
        raise malformed("`message.content` is not a string")
    return ModelResponse.model_validate(
        {"content": content, "tool_calls": calls, "usage": _usage(body.get("usage"))}
    )


def server_sent_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data`` of each server-sent event (its ``data:`` lines joined by newlines);
    comments, ``event:``, ``id:`` and ``retry:`` lines are read past (the SSE format)."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


_DRAIN_LINES = 64
"""Lines read past a stream's last event, at most, to reach the end of its body."""


def _drain(lines: Iterator[str]) -> None:
    """Read what follows a stream's last event up to the end of the body, so its connection
    goes back to the pool: closed before its body ends, httpx drops it, and the next call
    pays a new connection (a TLS handshake, against a real provider). A server that sends
    more, or holds the body open, costs at most its read timeout and the connection."""
    try:
        for _ in zip(range(_DRAIN_LINES), lines, strict=False):
            pass
    except httpx.HTTPError:
        pass  # the answer is whole: what the server does after its end is not this call's


class StreamAssembly:
    """One attempt's stream of server-sent events, put back together as the body the API
    would have answered whole; each piece handed to ``deltas`` as it comes."""

    END: ClassVar[str] = "end"
    """What the last event is called, for the error when a stream stops before it."""

    def __init__(self, attempt: int, deltas: Deltas | None) -> None:
        self.attempt, self.deltas = attempt, deltas

    def feed(self, data: str, key: str | None) -> bool:
        """Take one event's data; whether it was the last. Raises what :meth:`cut` makes
        for an event that ends the attempt (not JSON, an error event)."""
        raise NotImplementedError

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def event(self, data: str, key: str | None) -> Any:
        """An event's JSON; the attempt cut if it is not JSON."""
        try:
            return json.loads(data)
        except ValueError:
            raise self.cut(f"an event is not JSON (starts {_quote(data, key, 80)!r})") from None

    def error_event(self, error: Any, key: str | None) -> _RetryableFailure:
        said = error.get("message") if isinstance(error, dict) else error
        return self.cut(f"the server sent an error event: {_quote(str(said), key, 200)}")

    def tell(self, piece: dict[str, Any]) -> None:
        if self.deltas is not None:
            self.deltas({"attempt": self.attempt, **piece})

    def cut(self, reason: str) -> _RetryableFailure:
        """The failed attempt a stream cut off is, told to ``deltas`` first."""
        self.tell({"aborted": reason})
        return _RetryableFailure(None, f"the stream was cut off: {reason}")


class _Assembly(StreamAssembly):
    """One attempt's stream of chat-completion chunks, ended by ``data: [DONE]``."""

    END = "[DONE]"

    def __init__(self, attempt: int, deltas: Deltas | None) -> None:
        super().__init__(attempt, deltas)
        self.text: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: Any = None

    def feed(self, data: str, key: str | None) -> bool:
        if data.strip() == "[DONE]":
            return True
        chunk = self.event(data, key)
        if isinstance(chunk, dict) and "error" in chunk:
            raise self.error_event(chunk["error"], key)
        self.add(chunk)
        return False

    def add(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            return
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        delta = first.get("delta") if isinstance(first, dict) else None
        if not isinstance(delta, dict):
            return
        for key, into in (("content", self.text), ("refusal", self.refusal)):
            piece = delta.get(key)
            if isinstance(piece, str) and piece:
                into.append(piece)
                if key == "content":
                    self.tell({"text": piece})
        for position, part in enumerate(delta.get("tool_calls") or ()):
            if isinstance(part, dict):
                self._add_call(part, position)

    def _add_call(self, part: dict[str, Any], position: int) -> None:
        index = part.get("index")
        index = index if isinstance(index, int) and not isinstance(index, bool) else position
        call = self.calls.setdefault(index, {"id": None, "name": "", "arguments": []})
        raw = part.get("function")
        function: dict[str, Any] = raw if isinstance(raw, dict) else {}
        told: dict[str, Any] = {"call": index}
        if isinstance(part.get("id"), str) and part["id"]:
            call["id"] = told["id"] = part["id"]
        if isinstance(function.get("name"), str) and function["name"]:
            call["name"] += function["name"]
            told["name"] = function["name"]
        if isinstance(function.get("arguments"), str) and function["arguments"]:
            call["arguments"].append(function["arguments"])
            told["arguments"] = function["arguments"]
        if len(told) > 1:
            self.tell(told)

    def body(self) -> dict[str, Any]:
        message: dict[str, Any] = {"content": "".join(self.text) or None}
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": "".join(call["arguments"])},
                }
                for _, call in sorted(self.calls.items())
            ]
        return {"choices": [{"message": message}], "usage": self.usage}


def _usage(usage: Any) -> TokenUsage | None:
    if not isinstance(usage, dict):
        return None
    if not any(isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens")):
        return None
    return TokenUsage(
        input_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
    )


def _server_message(response: httpx.Response, key: str | None) -> str:
    """The server's own words: ``error.message`` from a JSON body, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return _quote(message, key, _QUOTE_CHARS)
    text = _quote(response.text, key, _QUOTE_CHARS)
    return text or response.reason_phrase or "(empty body)"


def _quote(text: str, key: str | None, limit: int) -> str:
    # Redact before cutting: a cut could leave a prefix of the key that no longer matches.
    text = " ".join(_redact(text, key).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _redact(text: str, key: str | None) -> str:
    return text.replace(key, "[redacted]") if key else text
