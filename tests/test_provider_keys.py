"""Which key the OpenAI provider may send, where to, and that DEBUG logs never carry it.

Against the stand-in OpenAI server on 127.0.0.1 (tests/openai_server.py). No request
in this file goes anywhere else: a non-loopback base_url is refused before any
connection is opened.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from runtime.errors import AgentFileError, ProviderError
from runtime.models import Message
from runtime.provider import ModelRequest
from runtime_io.agent_files import load_agent
from runtime_io.providers.openai import OpenAIProvider
from tests.openai_server import OpenAIServer, load_fixture

pytestmark = pytest.mark.timeout(30)

KEY = "sk-test-ratchet-echoed-4b1e8c2d9f7a6e5d3c1b0a9f8e7d6c5b"
SECRET = "aws-secret-9f8e7d6c5b4a3f2e1d0c9b8a7f6e5d4c3b2a1f0e"
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model_call=0)


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RATCHET_OPENAI_BASE_URL", "RATCHET_OPENAI_KEY_VARIABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RATCHET_OPENAI_API_KEY", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)


def agent_file(directory: Path, provider_lines: str) -> Path:
    path = directory / "desk.toml"
    path.write_text(
        f'name = "desk"\nmodel = "openai:gpt-test"\n[provider]\n{provider_lines}\n',
        encoding="utf-8",
    )
    return path


# --- 11: which variable, and over which transport -----------------------------------


def test_an_agent_file_cannot_name_a_worker_secret_as_its_key(
    server: OpenAIServer, tmp_path: Path
) -> None:
    # Given an agent file that names the worker's AWS secret as its "API key"
    path = agent_file(tmp_path, f'base_url = "{server.url}"\napi_key_env = "AWS_SECRET_ACCESS_KEY"')

    # When it is loaded, it is refused in one line naming the file and the key
    with pytest.raises(AgentFileError) as refused:
        load_agent(path)
    message = str(refused.value)
    assert str(path) in message and "api_key_env" in message
    assert "RATCHET_OPENAI_KEY_VARIABLES" in message and "\n" not in message
    assert SECRET not in message
    # And the secret never reached the server
    assert server.requests == []


def test_an_operator_can_allow_another_key_variable(
    server: OpenAIServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_OPENAI_KEY_VARIABLES", "RATCHET_OPENAI_API_KEY,DESK_TOKEN")
    monkeypatch.setenv("DESK_TOKEN", "desk-token-value")
    server.enqueue_fixture("text_answer")

    agent = load_agent(
        agent_file(tmp_path, f'base_url = "{server.url}"\napi_key_env = "DESK_TOKEN"')
    )
    agent.provider.complete(REQUEST)

    assert server.requests[0].headers["authorization"] == "Bearer desk-token-value"
    # The default pattern `*_API_KEY` is gone once the operator lists their own.
    with pytest.raises(AgentFileError, match="api_key_env"):
        load_agent(agent_file(tmp_path, f'base_url = "{server.url}"\napi_key_env = "X_API_KEY"'))


def test_the_default_patterns_allow_api_key_variables(server: OpenAIServer, tmp_path: Path) -> None:
    server.enqueue_fixture("text_answer")
    agent = load_agent(
        agent_file(tmp_path, f'base_url = "{server.url}"\napi_key_env = "RATCHET_OPENAI_API_KEY"')
    )
    agent.provider.complete(REQUEST)
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"


def test_a_named_key_is_refused_over_plain_http_to_a_host_that_is_not_loopback(
    tmp_path: Path,
) -> None:
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): refused at load, so nothing is ever sent there.
    path = agent_file(
        tmp_path, 'base_url = "http://192.0.2.7:8080/v1"\napi_key_env = "RATCHET_OPENAI_API_KEY"'
    )
    with pytest.raises(AgentFileError) as refused:
        load_agent(path)
    assert "plain http" in str(refused.value) and KEY not in str(refused.value)


def test_the_default_key_is_not_sent_over_plain_http_to_a_host_that_is_not_loopback() -> None:
    # Given the worker's default key and an agent pointing at a plain-http remote host
    provider = OpenAIProvider.from_settings(
        "gpt-test", {"provider": {"base_url": "http://192.0.2.7:8080/v1", "timeout_s": 1}}
    )
    # When it is asked, it refuses before opening any connection
    with pytest.raises(ProviderError, match="refusing to send the API key over plain http") as no:
        provider.complete(REQUEST)
    assert no.value.retryable is False and KEY not in str(no.value)


def test_a_plain_http_host_without_a_key_is_still_reachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A local model server needs no key; with none set nothing secret is at stake.
    monkeypatch.delenv("RATCHET_OPENAI_API_KEY")
    provider = OpenAIProvider.from_settings(
        "gpt-test", {"provider": {"base_url": "http://192.0.2.7:8080/v1"}}
    )
    assert provider.identity()["base_url_host"] == "192.0.2.7:8080"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "localhost", "[::1]"])
def test_loopback_over_plain_http_may_carry_a_key(host: str) -> None:
    OpenAIProvider.from_settings(
        "gpt-test",
        {"provider": {"base_url": f"http://{host}:1/v1", "api_key_env": "RATCHET_OPENAI_API_KEY"}},
    )


# --- 15: DEBUG logs -------------------------------------------------------------------


def echo_the_key(server: OpenAIServer) -> None:
    response = load_fixture("text_answer")["response"]
    server.enqueue(200, response["body"], {"X-Echo-Authorization": f"Bearer {KEY}"})


def provider(server: OpenAIServer) -> OpenAIProvider:
    return OpenAIProvider.from_settings(
        "gpt-test", {"provider": {"base_url": server.url, "api_key_env": "RATCHET_OPENAI_API_KEY"}}
    )


def test_a_worker_at_debug_logs_no_key_a_server_echoes(
    server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a worker logging everything at DEBUG and a server that echoes the key back
    caplog.set_level(logging.DEBUG)
    echo_the_key(server)

    # When the provider makes a real call
    provider(server).complete(REQUEST)

    # Then the call happened with the key, and the key is nowhere in the log
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert caplog.records, "nothing was logged at all: the test would prove nothing"
    assert KEY not in caplog.text
    assert all(KEY not in record.getMessage() for record in caplog.records)


def test_httpcore_at_debug_by_the_operators_choice_is_redacted(
    server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an operator who turned httpcore's DEBUG logging on explicitly
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="httpcore")
    echo_the_key(server)

    provider(server).complete(REQUEST)

    # Then httpcore's header lines are there, the key in them replaced
    headers = [
        r.getMessage() for r in caplog.records if "receive_response_headers" in r.getMessage()
    ]
    assert any("X-Echo-Authorization" in line and "[redacted]" in line for line in headers)
    assert KEY not in caplog.text
