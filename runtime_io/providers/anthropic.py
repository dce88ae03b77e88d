"""A provider for Anthropic's Messages API (Claude), spoken natively.

::

    model = "anthropic:claude-sonnet-4-5"
    [provider]                         # every key optional
    base_url = "https://api.anthropic.com/v1"  # else RATCHET_ANTHROPIC_BASE_URL; ends before /messages
    api_key_env = "ANTHROPIC_API_KEY"  # the NAME of the variable; else RATCHET_ANTHROPIC_API_KEY
    max_tokens = 4096                  # the API requires one; 4096 when unset
    timeout_s = 60                     # per HTTP request
    max_attempts = 4                   # requests per model call, first one included
    max_retry_s = 60
    temperature = 0.2                  # sent only when set (the API takes 0 to 1)
    stream = true                      # ask for server-sent events (default false)

It shares the OpenAI provider's HTTP call, key rules and retry policy
(:mod:`runtime_io.providers.openai`, whose docstring states them): one request is one
attempt, tenacity owns the retries, and the observer hears of each. The
differences are the wire format and these:

- **The key** travels in ``x-api-key`` (with ``anthropic-version: 2023-06-01``),
  may only come from a variable ``RATCHET_ANTHROPIC_KEY_VARIABLES`` allows (default
  ``RATCHET_ANTHROPIC_API_KEY,*_API_KEY``, so ``ANTHROPIC_API_KEY`` is allowed), and is
  never sent over plain ``http://`` beyond loopback.
- **529 "overloaded"** is a 5xx: retried within ``max_attempts`` and ``max_retry_s``,
  honouring ``retry-after``. **429** is not retried in the worker: it raises
  ``ProviderRateLimited`` with its ``retry-after``, and the turn waits on the queue
  through the fleet's rate limits (tasks/limits.py), as for OpenAI.
- **The transcript** becomes Messages-API turns: the run's system messages join into
  ``system``; an assistant's tool calls become ``tool_use`` blocks; the results of one
  turn's calls become ``tool_result`` blocks (``is_error`` for a failed or refused
  call) in the one user turn that follows, as the API requires; consecutive turns
  of one role are merged, and empty text blocks (which the API refuses) are left out.
- **The answer**: its ``text`` blocks joined, its ``tool_use`` blocks as tool calls
  in order (parallel tool use); other blocks (thinking, server tools) are not part
  of the run's transcript. ``stop_reason`` is not needed: a response with tool
  calls runs them, one without answers.
- **Streaming** (``stream = true``): the request asks for ``stream: true`` and the
  Messages API's events are read as they come (``message_start``, ``content_block_*``,
  ``message_delta``, ``message_stop``; ``ping`` is read past): each piece of text and of a
  ``tool_use`` block's input goes to ``deltas`` as for OpenAI, and the message is put back
  together whole, usage from ``message_start`` and ``message_delta``. An ``error`` event
  (``overloaded_error`` mid-stream) or a stream that stops before ``message_stop`` is the
  failed attempt it was, retried as one.
- **Usage**: ``input_tokens`` counts the request's input *including* the cache's
  reads and writes (``cache_read_input_tokens``, ``cache_creation_input_tokens``),
  since each is input the model processed; that sum and ``output_tokens`` are
  what budgets and token rate limits count.

It speaks HTTP through ``httpx`` rather than the ``anthropic`` SDK for the same
reason the OpenAI provider does: the SDK retries on its own, under tenacity that
would multiply attempts the run's event log never sees, and it would be a large
dependency for one POST.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from runtime.errors import ProviderError
from runtime.models import Message, TokenUsage
from runtime.provider import INVALID_ARGUMENTS_KEY, Deltas, ModelRequest, ModelResponse
from runtime_io.providers.openai import OpenAIProvider, ProviderTable, StreamAssembly

DEFAULT_BASE_URL = "https://api.anthropic.com/v1"
BASE_URL_ENV = "RATCHET_ANTHROPIC_BASE_URL"
API_KEY_ENV = "RATCHET_ANTHROPIC_API_KEY"
KEY_VARIABLES_ENV = "RATCHET_ANTHROPIC_KEY_VARIABLES"
DEFAULT_KEY_VARIABLES = f"{API_KEY_ENV},*_API_KEY"
API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
"""The Messages API requires ``max_tokens``; this one when the agent file sets none."""


class AnthropicTable(ProviderTable):
    """The ``[provider]`` table of an ``anthropic:`` agent: the OpenAI table's keys."""

    KEY_VARIABLES: ClassVar[tuple[str, str]] = (KEY_VARIABLES_ENV, DEFAULT_KEY_VARIABLES)


class AnthropicProvider(OpenAIProvider):
    """Claude over the Messages API. Holds no secret; safe to share between threads."""

    NAME: ClassVar[str] = "anthropic"
    TABLE: ClassVar[type[ProviderTable]] = AnthropicTable
    DEFAULT_BASE_URL: ClassVar[str] = DEFAULT_BASE_URL
    BASE_URL_ENV: ClassVar[str] = BASE_URL_ENV
    API_KEY_ENV: ClassVar[str] = API_KEY_ENV
    ENDPOINT: ClassVar[str] = "/messages"
    WIRE: ClassVar[str] = "the Messages API, ending in /v1 (e.g. https://api.anthropic.com/v1)"

    def auth_headers(self, key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if key:
            headers["x-api-key"] = key
        return headers

    def stream_fields(self) -> dict[str, Any]:
        return {"stream": True}

    def assembly(self, attempt: int, deltas: Deltas | None) -> StreamAssembly:
        return MessageAssembly(attempt, deltas)

    def payload(self, request: ModelRequest) -> dict[str, Any]:
        """The JSON body of ``POST /messages`` for ``request``."""
        system, turns = to_anthropic_turns(request.messages)
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self._table.max_tokens or DEFAULT_MAX_TOKENS,
            "messages": turns,
        }
        if system:
            payload["system"] = system
        if request.tools:
            payload["tools"] = [to_anthropic_tool(d) for d in request.tools]
        if self._table.temperature is not None:
            payload["temperature"] = self._table.temperature
        return payload

    def parse(self, body: Any, model_call: int) -> ModelResponse:
        return parse_message(body, model_call, self._describe())


# --- wire format ----------------------------------------------------------------


def to_anthropic_turns(messages: tuple[Message, ...]) -> tuple[str, list[dict[str, Any]]]:
    """The run's transcript as the Messages API's ``system`` and alternating turns."""
    system = "\n\n".join(m.content for m in messages if m.role == "system" and m.content)
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "system":
            continue
        role = "assistant" if message.role == "assistant" else "user"
        blocks = _blocks(message)
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns


def _blocks(message: Message) -> list[dict[str, Any]]:
    if message.role == "tool":
        result: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": message.tool_call_id,
            "content": message.content,
        }
        if message.is_error:
            result["is_error"] = True
        return [result]
    blocks: list[dict[str, Any]] = []
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        )
    return blocks


def to_anthropic_tool(declaration: dict[str, Any]) -> dict[str, Any]:
    """A tool declaration as the Messages API wants it; ratchet's own keys stay home."""
    return {
        "name": declaration["name"],
        "description": declaration.get("description", ""),
        "input_schema": declaration.get("parameters", {"type": "object", "properties": {}}),
    }


def parse_message(body: Any, model_call: int, where: str) -> ModelResponse:
    """A Messages-API response body as a :class:`ModelResponse`; ProviderError if not one."""

    def malformed(problem: str) -> ProviderError:
        return ProviderError(
            f"{where}: the response is not a Messages-API message ({problem}); check that "
            "base_url points at the Messages API, ending in /v1"
        )

    if not isinstance(body, dict):
        raise malformed(f"the body is a JSON {type(body).__name__}, not an object")
    content = body.get("content")
    if body.get("type") != "message" or not isinstance(content, list):
        raise malformed("no `content` list in a `message`")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise malformed(f"`content[{index}].text` is not a string")
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise malformed(f"`content[{index}]` is a tool_use without a name")
            arguments = block.get("input")
            calls.append(
                {
                    "id": block.get("id") or f"call_{model_call + 1}_{len(calls) + 1}",
                    "name": block["name"],
                    "arguments": arguments
                    if isinstance(arguments, dict)
                    else {INVALID_ARGUMENTS_KEY: repr(arguments)},
                }
            )
    return ModelResponse.model_validate(
        {"content": "".join(texts), "tool_calls": calls, "usage": _usage(body.get("usage"))}
    )


def _usage(usage: Any) -> TokenUsage | None:
    if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
        return None
    cached = sum(
        value
        for name in ("cache_read_input_tokens", "cache_creation_input_tokens")
        if isinstance(value := usage.get(name), int)
    )
    return TokenUsage(
        input_tokens=usage["input_tokens"] + cached,
        output_tokens=int(usage.get("output_tokens") or 0),
    )


class MessageAssembly(StreamAssembly):
    """One attempt's stream of Messages-API events, put back together as one message."""

    END = "message_stop"

    def __init__(self, attempt: int, deltas: Deltas | None) -> None:
        super().__init__(attempt, deltas)
        self.message: dict[str, Any] = {"type": "message", "content": []}
        self.usage: dict[str, Any] = {}
        self.blocks: dict[int, dict[str, Any]] = {}
        self.inputs: dict[int, list[str]] = {}

    def feed(self, data: str, key: str | None) -> bool:
        event = self.event(data, key)
        if not isinstance(event, dict):
            return False
        kind = event.get("type")
        if kind == "error" or "error" in event and kind is None:
            raise self.error_event(event.get("error"), key)
        if kind == "message_start" and isinstance(event.get("message"), dict):
            self._usage(event["message"].get("usage"))
        elif kind == "content_block_start":
            self._start(event.get("index"), event.get("content_block"))
        elif kind == "content_block_delta":
            self._delta(event.get("index"), event.get("delta"))
        elif kind == "message_delta":
            self._usage(event.get("usage"))
        return kind == "message_stop"

    def _usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.usage.update({k: v for k, v in usage.items() if isinstance(v, int)})

    def _start(self, index: Any, block: Any) -> None:
        if not isinstance(index, int) or not isinstance(block, dict):
            return
        kind = block.get("type")
        if kind == "text":
            self.blocks[index] = {"type": "text", "text": str(block.get("text") or "")}
        elif kind == "tool_use":
            self.blocks[index] = {
                "type": "tool_use",
                "id": block.get("id"),
                "name": block.get("name"),
            }
            self.inputs[index] = []
            told = {"call": index, "id": block.get("id"), "name": block.get("name")}
            self.tell({k: v for k, v in told.items() if isinstance(v, (str, int))})

    def _delta(self, index: Any, delta: Any) -> None:
        block = self.blocks.get(index) if isinstance(index, int) else None
        if block is None or not isinstance(delta, dict):
            return
        if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
            block["text"] += delta["text"]
            if delta["text"]:
                self.tell({"text": delta["text"]})
        elif delta.get("type") == "input_json_delta" and isinstance(delta.get("partial_json"), str):
            self.inputs[index].append(delta["partial_json"])
            if delta["partial_json"]:
                self.tell({"call": index, "arguments": delta["partial_json"]})

    def body(self) -> dict[str, Any]:
        content = []
        for index, block in sorted(self.blocks.items()):
            if block["type"] == "tool_use":
                raw = "".join(self.inputs[index])
                try:
                    # An empty input is a tool without parameters.
                    block = {**block, "input": json.loads(raw) if raw else {}}
                except ValueError:
                    block = {**block, "input": raw}
            content.append(block)
        return {**self.message, "content": content, "usage": self.usage or None}
