"""The providers an agent file can name in ``model``, and how each is built.

Apart from the protocol (:mod:`runtime.provider`) so that the implementations,
which import the protocol, are not imported by it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.provider import Provider


def make_provider(model: str, agent_file: Path, settings: dict[str, Any]) -> Provider:
    """Build the provider an agent file names in ``model``.

    Raises ``ValueError`` with the list of known providers when ``model`` is unknown;
    the agent loader turns it into an error naming the file and the key.
    """
    from runtime_io.providers.scripted import ScriptedProvider

    if model == "scripted":
        script = settings.get("script")
        if not script:
            raise ValueError('the scripted provider needs `script = "file.json"`')
        return ScriptedProvider(agent_file.parent / str(script))
    if model.startswith("openai:"):
        from runtime_io.providers.openai import OpenAIProvider

        return OpenAIProvider.from_settings(model.removeprefix("openai:"), settings)
    if model.startswith("anthropic:"):
        from runtime_io.providers.anthropic import AnthropicProvider

        return AnthropicProvider.from_settings(model.removeprefix("anthropic:"), settings)
    raise ValueError(
        f"unknown provider `{model}`; known: `scripted`, `openai:<model-name>`, "
        "`anthropic:<model-name>`"
    )
