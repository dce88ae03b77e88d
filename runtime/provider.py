"""The model provider's contract: one small protocol, its implementations in runtime_io/providers/.

A provider turns a :class:`ModelRequest` into a :class:`ModelResponse`. It
raises :class:`~runtime.errors.ProviderError` (``retryable`` set when another
attempt may succeed) and nothing else. ``identity()`` is what of the provider
decides the run's behaviour; it goes into the binding (never a secret).

``model = "scripted"`` plays a JSON script; ``model = "openai:<name>"`` and
others plug in through :func:`runtime_io.providers.known.make_provider`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pydantic import Field

from runtime import json_values
from runtime.errors import NotStorable, ProviderError
from runtime.models import INVALID_ARGUMENTS_KEY as INVALID_ARGUMENTS_KEY
from runtime.models import UNUSABLE_ARGUMENTS_KEY, Message, Strict, TokenUsage, ToolCall

Observer = Callable[[str, dict[str, Any]], None]
Deltas = Callable[[dict[str, Any]], None]
"""Told each piece of a streamed answer as it comes (``runtime_io/providers/openai.py``)."""


class ModelRequest(Strict):
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()
    model_call: int = Field(ge=0)
    """Index of this model call among the run's responses, 0-based: 0 for the first."""


class ModelResponse(Strict):
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    usage: TokenUsage | None = None
    """``None`` when the provider did not report usage."""


class Provider(Protocol):
    def identity(self) -> dict[str, Any]:
        """What of this provider decides behaviour (goes into the binding; no secrets)."""
        ...

    def complete(self, request: ModelRequest, *, observer: Observer | None = None) -> ModelResponse:
        """Ask the model (retrying transient failures within bounds). Raises ProviderError only.

        ``observer(event_type, data)`` is told of each retry (`model.retrying`) so the
        run's event log shows every attempt.

        A provider whose ``streams`` attribute is true also takes ``deltas=f`` and calls
        ``f({"attempt": n, "text": piece})`` (or a tool call's piece, or ``{"attempt": n,
        "aborted": why}``) as the answer forms; it still returns the whole answer, which
        is what the run journals (tasks/live.py carries the pieces to observers).

        A provider whose ``bounds_calls`` attribute is true ends a call by the deadline
        ``runtime_io.providers.http.call_deadline`` sets (raising its DeadlineExceeded),
        and the turn calls it on its own thread; any other is called on a caller thread,
        abandoned at ``model_timeout_s``.
        """
        ...


MAX_CALL_ID_CHARS = 256
MAX_TOKENS = 10**15
"""More tokens than any response reports: a usage beyond it is the provider's mistake."""


def checked_response(response: ModelResponse) -> ModelResponse:
    """A provider's response as it may be journaled, checked where it crosses into ratchet
    (runtime/json_values.py), whatever provider made it.

    A lone surrogate in the text, a call's id or name is replaced by U+FFFD; a call whose
    arguments hold one, or cannot be stored otherwise (NaN, an integer of more than 4300
    digits, over :data:`~runtime.json_values.MAX_OUTPUT_BYTES`), keeps only
    ``{UNUSABLE_ARGUMENTS_KEY: why}``, which the runtime answers with a tool error instead
    of running the tool. Text over that size, an id over :data:`MAX_CALL_ID_CHARS` or a
    usage beyond :data:`MAX_TOKENS` is a ProviderError (not retryable): the model answered,
    and asking again costs another answer that may be as large.
    """
    content = json_values.without_surrogates(response.content)
    size = len(content.encode())
    if size > json_values.MAX_OUTPUT_BYTES:
        raise ProviderError(
            f"the model's answer is {size} bytes, over the "
            f"{json_values.MAX_OUTPUT_BYTES}-byte limit a response may hold; ask for a "
            "shorter answer (the system prompt) or a lower max_tokens"
        )
    usage = response.usage
    if usage is not None and not all(
        0 <= n < MAX_TOKENS for n in (usage.input_tokens, usage.output_tokens)
    ):
        raise ProviderError("the response reports a token usage out of range")
    calls = []
    for call in response.tool_calls:
        if len(call.id) > MAX_CALL_ID_CHARS:
            raise ProviderError(
                f"a tool call id of {len(call.id)} characters, over "
                f"{MAX_CALL_ID_CHARS}; the provider is not one ratchet can record"
            )
        try:
            arguments, _ = json_values.checked(call.arguments, surrogates="refuse")
        except NotStorable as exc:
            arguments = {UNUSABLE_ARGUMENTS_KEY: exc.problem}
        calls.append(
            ToolCall(
                id=json_values.without_surrogates(call.id),
                name=json_values.without_surrogates(call.name),
                arguments=arguments,
            )
        )
    return ModelResponse(content=content, tool_calls=tuple(calls), usage=usage)
