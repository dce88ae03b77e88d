"""A provider that plays a JSON script, one entry per model call, by position.

The entry for a call is chosen by the call's turn index, never by how often
the provider was asked: a crash that makes ratchet ask again for the same turn
gets the same answer, exactly as a deterministic model would give.

Set ``RATCHET_SCRIPTED_CALL_LOG`` to a file path to append one line per call
(``turn`` and process id): crash tests count real model calls with it.

A script with a ``stream`` table plays each answer in pieces at a set pace, as a
streaming model would (tasks/live.py carries them to observers)::

    {"stream": {"chunk_chars": 4, "interval_s": 0.05}, "turns": [...]}

``chunk_chars`` characters of the text every ``interval_s`` seconds, then each tool
call's name and arguments. The answer returned, and journaled, is the same either way.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.errors import ProviderError
from runtime.models import TokenUsage
from runtime.numbers import Finite
from runtime.provider import Deltas, ModelRequest, ModelResponse, Observer
from runtime_io.providers.http import pause


class _ScriptCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: dict[str, Any] = {}
    id: str | None = None


class _ScriptTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str = ""
    tool_calls: list[_ScriptCall] = []
    usage: TokenUsage | None = None
    sleep_s: Finite = 0.0
    """Seconds to wait before answering: stands in for a slow model in tests and demos."""


class _Pace(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunk_chars: int = Field(default=8, ge=1, le=100_000)
    """Characters of the answer's text in each piece."""
    interval_s: Finite = Field(default=0.02, ge=0, le=60)
    """Seconds between two pieces."""


class _Script(BaseModel):
    model_config = ConfigDict(extra="forbid")
    turns: list[_ScriptTurn]
    stream: _Pace | None = None
    """Play each answer in pieces at this pace (``deltas``), as a streaming model does."""


def _where(exc: ValidationError) -> str:
    """Pydantic's first error as position and problem, without the input it quotes."""
    err = exc.errors(include_input=False, include_url=False, include_context=False)[0]
    if err["type"] == "json_invalid":
        return "not JSON (" + err["msg"].removeprefix("Invalid JSON: ") + ")"
    loc = list(err["loc"])
    if err["type"] == "extra_forbidden":
        # The unknown key is the file's own text: say where it is, not what it says.
        return f"an unknown key in `{'.'.join(map(str, loc[:-1])) or '(top)'}`"
    return f"`{'.'.join(map(str, loc)) or '(top)'}`: {err['msg']}"


class ScriptedProvider:
    def __init__(self, path: Path) -> None:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"script {path} cannot be read: {exc.strerror}") from exc
        try:
            self._script = _Script.model_validate_json(raw)
        except ValidationError as exc:
            # Name the place, never the value: the file may not be a script at all.
            raise ValueError(f"script {path} is not a valid script: {_where(exc)}") from None
        self._path = path
        self._digest = hashlib.sha256(raw).hexdigest()

    def identity(self) -> dict[str, Any]:
        # The script is the model: editing it changes the run's behaviour.
        return {"provider": "scripted", "model": self._path.name, "script_sha256": self._digest}

    @property
    def streams(self) -> bool:
        return self._script.stream is not None

    bounds_calls = True
    """A call ends by the deadline ``call_deadline`` sets: its only waits, the script's
    ``sleep_s`` and a stream's pace, end there (runtime_io/providers/http.py)."""

    def complete(
        self,
        request: ModelRequest,
        *,
        observer: Observer | None = None,
        deltas: Deltas | None = None,
    ) -> ModelResponse:
        turns = self._script.turns
        if request.model_call >= len(turns):
            raise ProviderError(
                f"script {self._path.name} has {len(turns)} turns; turn {request.model_call + 1} was asked"
            )
        entry = turns[request.model_call]
        log = os.environ.get("RATCHET_SCRIPTED_CALL_LOG")
        if log:
            with open(log, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"turn": request.model_call, "pid": os.getpid()}) + "\n")
        if entry.sleep_s:
            pause(entry.sleep_s)
        calls = tuple(
            {
                "id": call.id or f"call_{request.model_call + 1}_{index + 1}",
                "name": call.name,
                "arguments": call.arguments,
            }
            for index, call in enumerate(entry.tool_calls)
        )
        if self._script.stream is not None and deltas is not None:
            _play(self._script.stream, entry.content, calls, deltas)
        return ModelResponse.model_validate(
            {"content": entry.content, "tool_calls": calls, "usage": entry.usage}
        )


def _play(pace: _Pace, text: str, calls: tuple[dict[str, Any], ...], deltas: Deltas) -> None:
    """Hand the answer to ``deltas`` piece by piece, ``pace.interval_s`` apart."""
    step = pace.chunk_chars
    for start in range(0, len(text), step):
        if start:
            pause(pace.interval_s)
        deltas({"attempt": 1, "text": text[start : start + step]})
    for index, call in enumerate(calls):
        arguments = json.dumps(call["arguments"], separators=(",", ":"))
        deltas(
            {
                "attempt": 1,
                "call": index,
                "id": call["id"],
                "name": call["name"],
                "arguments": arguments,
            }
        )
