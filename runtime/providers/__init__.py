"""Model providers: one small protocol, several implementations.

A provider turns a :class:`ModelRequest` into a :class:`ModelResponse`. It
raises :class:`~runtime.errors.ProviderError` (``retryable`` set when another
attempt may succeed) and nothing else. ``identity()`` is what of the provider
decides the run's behaviour; it goes into the binding (never a secret).

``model = "scripted"`` plays a JSON script; ``model = "openai:<name>"`` and
others plug in through :func:`runtime.providers.known.make_provider`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pydantic import Field

from runtime.models import INVALID_ARGUMENTS_KEY as INVALID_ARGUMENTS_KEY
from runtime.models import Message, Strict, TokenUsage, ToolCall

Observer = Callable[[str, dict[str, Any]], None]


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
        """
        ...
