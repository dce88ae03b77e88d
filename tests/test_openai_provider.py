"""The OpenAI-compatible provider against a real HTTP server on 127.0.0.1.

Canned responses are recorded OpenAI bodies from ``tests/fixtures/openai/``;
the server records every request, so each test can say how many were made.
"""

from __future__ import annotations

import logging
import pickle
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.errors import ProviderError, ProviderRateLimited
from runtime.models import Message, TokenUsage, ToolCall
from runtime.provider import INVALID_ARGUMENTS_KEY, ModelRequest
from runtime_io.agent_files import load_agent
from runtime_io.providers import openai
from runtime_io.providers.known import make_provider
from runtime_io.providers.openai import (
    OpenAIProvider,
    parse_arguments,
    retry_after_s,
    to_openai_message,
)
from tests.openai_server import OpenAIServer, load_fixture, serve

pytestmark = pytest.mark.timeout(30)

KEY = "sk-test-ratchet-5f0c9a1e7b3d4c2a8e6f0b1d3c5a7e9f"
KEY_VAR = "TEST_API_KEY"

LOOKUP = {
    "name": "lookup_order",
    "description": "Look up an order by id.",
    "parameters": {
        "type": "object",
        "properties": {"order_id": {"type": "string"}},
        "required": ["order_id"],
    },
    "idempotent": True,
}
REFUND = {
    "name": "issue_refund",
    "description": "Refund an order.",
    "parameters": {
        "type": "object",
        "properties": {"order_id": {"type": "string"}, "amount_cents": {"type": "integer"}},
        "required": ["order_id", "amount_cents"],
    },
    "idempotent": False,
}


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RATCHET_OPENAI_BASE_URL", "RATCHET_OPENAI_API_KEY", KEY_VAR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(KEY_VAR, KEY)


def provider_for(server: OpenAIServer, **table: Any) -> OpenAIProvider:
    settings = {"provider": {"base_url": server.url, "api_key_env": KEY_VAR, **table}}
    return OpenAIProvider.from_settings("gpt-test", settings)


def simple_request(model_call: int = 0) -> ModelRequest:
    return ModelRequest(
        messages=(Message(role="user", content="Refund order A-1001."),),
        tools=(LOOKUP,),
        model_call=model_call,
    )


class Observed:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        self.events.append((kind, data))


# --- the request ------------------------------------------------------------------


def test_the_request_is_the_recorded_one_with_the_key_as_a_bearer_token(
    server: OpenAIServer,
) -> None:
    # Given a transcript with every role, including an earlier tool call and its result
    pair = server.enqueue_fixture("two_tool_calls")
    earlier = ToolCall(
        id="call_q2nV8dXbWm3L", name="lookup_order", arguments={"order_id": "A-1000"}
    )
    request = ModelRequest(
        messages=(
            Message(role="system", content="You are a refund desk."),
            Message(role="user", content="Refund orders A-1001 and A-1002; A-1000 was fine."),
            Message(role="assistant", tool_calls=(earlier,)),
            Message(
                role="tool",
                content='{"status": "delivered", "total_cents": 1299}',
                tool_call_id="call_q2nV8dXbWm3L",
                name="lookup_order",
            ),
        ),
        tools=(LOOKUP, REFUND),
        model_call=1,
    )

    # When the provider asks the model
    provider_for(server).complete(request)

    # Then exactly the recorded request went out, our `idempotent` key left behind
    (sent,) = server.requests
    assert sent.path == pair["request"]["path"]
    assert sent.body == pair["request"]["body"]
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert "idempotent" not in str(sent.body)


def test_no_tools_means_no_tools_key_and_temperature_is_sent_only_when_set(
    server: OpenAIServer,
) -> None:
    server.enqueue_fixture("text_answer")
    server.enqueue_fixture("text_answer")
    bare = ModelRequest(messages=(Message(role="user", content="hi"),), model_call=0)

    provider_for(server).complete(bare)
    provider_for(server, temperature=0.2).complete(bare)

    first, second = server.requests
    assert "tools" not in first.body and "temperature" not in first.body
    assert second.body["temperature"] == 0.2


def test_without_any_key_configured_no_authorization_header_is_sent(
    server: OpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A local server (Ollama) needs no key: RATCHET_OPENAI_API_KEY unset, no api_key_env.
    server.enqueue_fixture("text_answer")
    provider = OpenAIProvider.from_settings("llama3.2", {"provider": {"base_url": server.url}})

    provider.complete(simple_request())

    assert "authorization" not in server.requests[0].headers


def test_the_default_key_variable_and_base_url_come_from_the_environment(
    server: OpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_OPENAI_BASE_URL", server.url)
    monkeypatch.setenv("RATCHET_OPENAI_API_KEY", KEY)
    server.enqueue_fixture("text_answer")

    provider = OpenAIProvider.from_settings("gpt-test", {})
    provider.complete(simple_request())

    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert provider.identity()["base_url_host"] == f"127.0.0.1:{server.port}"


# --- the response -------------------------------------------------------------------


def test_a_response_with_two_tool_calls_gives_both_in_order(server: OpenAIServer) -> None:
    server.enqueue_fixture("two_tool_calls")

    response = provider_for(server).complete(simple_request())

    assert response.content == ""
    assert [(c.id, c.name, c.arguments) for c in response.tool_calls] == [
        ("call_Hk7pT2mQw9sR", "lookup_order", {"order_id": "A-1001"}),
        ("call_Zb4nV6xLc1dF", "lookup_order", {"order_id": "A-1002"}),
    ]
    assert response.usage == TokenUsage(input_tokens=182, output_tokens=48)


def test_arguments_that_are_not_a_json_object_become_a_call_carrying_the_raw_text(
    server: OpenAIServer,
) -> None:
    # Given a model that wrote truncated JSON for one call and an array for another
    server.enqueue_fixture("invalid_arguments")

    # When the response is parsed, nothing crashes
    response = provider_for(server).complete(simple_request())

    # Then each call carries only the marker key with the raw string, for the runtime to refuse
    truncated, array = response.tool_calls
    assert truncated.name == "issue_refund"
    assert truncated.arguments == {
        INVALID_ARGUMENTS_KEY: '{"order_id": "A-1001", "amount_cents": 12'
    }
    assert array.arguments == {INVALID_ARGUMENTS_KEY: '["A-1002"]'}


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [
        ('{"a": 1}', {"a": 1}),
        ("", {}),
        (None, {}),
        ({"already": "an object"}, {"already": "an object"}),
        ("not json", {INVALID_ARGUMENTS_KEY: "not json"}),
        ("42", {INVALID_ARGUMENTS_KEY: "42"}),
    ],
)
def test_arguments_are_parsed_leniently_but_never_silently_wrong(raw: Any, parsed: Any) -> None:
    assert parse_arguments(raw) == parsed


def test_usage_is_read_and_a_response_without_usage_has_none(server: OpenAIServer) -> None:
    server.enqueue_fixture("text_answer")
    server.enqueue_fixture("text_answer_without_usage")
    provider = provider_for(server)

    with_usage = provider.complete(simple_request())
    without = provider.complete(simple_request())

    assert with_usage.content.startswith("Both refunds are issued")
    assert with_usage.usage == TokenUsage(input_tokens=260, output_tokens=22)
    assert without.content == "Hello from a local model."
    assert without.usage is None


@pytest.mark.parametrize(
    ("fixture", "problem"),
    [("html_instead_of_json", "the body is not JSON"), ("no_choices", "no `choices`")],
)
def test_a_body_that_is_not_a_chat_completion_is_a_clear_error(
    server: OpenAIServer, fixture: str, problem: str
) -> None:
    server.enqueue_fixture(fixture)

    with pytest.raises(ProviderError) as caught:
        provider_for(server).complete(simple_request())

    assert problem in str(caught.value)
    assert "base_url" in str(caught.value)
    assert caught.value.retryable is False
    assert len(server.requests) == 1


# --- retries ------------------------------------------------------------------------


def test_a_429_is_not_retried_in_process_and_hands_its_retry_after_to_the_turn(
    server: OpenAIServer,
) -> None:
    # Given a rate limit that asks for one second, and an answer behind it
    server.enqueue_fixture("rate_limited")
    server.enqueue_fixture("text_answer")
    observed = Observed()

    # When the provider is asked
    with pytest.raises(ProviderRateLimited) as caught:
        provider_for(server).complete(simple_request(), observer=observed)

    # Then it did not sleep or retry (that would hold the worker's slot): one request,
    # no retry told, and the server's Retry-After is handed on for the queue's countdown
    assert len(server.requests) == 1
    assert observed.events == []
    assert caught.value.retry_after_s == 1.0 and caught.value.retryable is True
    assert "HTTP 429" in str(caught.value) and "Rate limit reached" in str(caught.value)


def test_a_500_is_retried_and_the_next_answer_is_returned(server: OpenAIServer) -> None:
    server.enqueue_fixture("server_error")
    server.enqueue_fixture("two_tool_calls")
    observed = Observed()

    response = provider_for(server).complete(simple_request(), observer=observed)

    assert len(response.tool_calls) == 2
    assert [data["status"] for _, data in observed.events] == [500]
    assert 0 < observed.events[0][1]["wait_s"] <= 0.5


def test_a_server_slower_than_timeout_s_is_retried(server: OpenAIServer) -> None:
    server.enqueue_fixture("text_answer", delay_s=3.0)
    server.enqueue_fixture("text_answer")
    observed = Observed()

    response = provider_for(server, timeout_s=0.5).complete(simple_request(), observer=observed)

    assert response.content.startswith("Both refunds are issued")
    assert len(server.requests) == 2
    [(_, data)] = observed.events
    assert data["status"] is None and "timeout_s=0.5" in data["error"]


def test_a_refused_connection_is_retried_then_reported_as_retryable() -> None:
    # Given a port nobody listens on
    with serve() as gone:
        url = gone.url
    provider = OpenAIProvider.from_settings(
        "gpt-test", {"provider": {"base_url": url, "max_attempts": 2}}
    )
    observed = Observed()

    with pytest.raises(ProviderError) as caught:
        provider.complete(simple_request(), observer=observed)

    assert caught.value.retryable is True
    assert "2 attempt(s)" in str(caught.value) and "no HTTP status" in str(caught.value)
    assert [data["status"] for _, data in observed.events] == [None]


def test_exhausted_retries_raise_a_retryable_error_naming_attempts_and_last_status(
    server: OpenAIServer,
) -> None:
    for _ in range(3):
        server.enqueue_fixture("overloaded")
    observed = Observed()

    with pytest.raises(ProviderError) as caught:
        provider_for(server, max_attempts=3).complete(simple_request(), observer=observed)

    message = str(caught.value)
    assert caught.value.retryable is True
    assert "3 attempt(s)" in message and "HTTP 503" in message
    assert "engine is currently overloaded" in message
    assert len(server.requests) == 3
    assert [data["attempt"] for _, data in observed.events] == [1, 2]


def test_a_retry_after_beyond_max_retry_s_gives_up_at_once_instead_of_sleeping(
    server: OpenAIServer,
) -> None:
    server.enqueue(503, {"error": {"message": "slow down"}}, {"Retry-After": "30"})

    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        provider_for(server, max_retry_s=2).complete(simple_request())

    assert time.monotonic() - started < 1.5
    assert caught.value.retryable is True
    assert "max_retry_s=2" in str(caught.value) and "wait 30 s" in str(caught.value)
    assert len(server.requests) == 1


def test_the_retry_budget_counts_the_first_attempts_own_time(server: OpenAIServer) -> None:
    # The first attempt takes 1.5 s to fail and asks for 1 s more: 2.5 s, past max_retry_s=2
    server.enqueue(503, {"error": {"message": "slow down"}}, {"Retry-After": "1"}, delay_s=1.5)
    server.enqueue_fixture("text_answer")  # (what a second attempt would get)

    with pytest.raises(ProviderError) as caught:
        provider_for(server, max_retry_s=2, max_attempts=3).complete(simple_request())

    assert "max_retry_s=2" in str(caught.value)
    assert len(server.requests) == 1


def test_retry_after_is_read_as_seconds_or_as_an_http_date() -> None:
    in_3_s = format_datetime(datetime.now(UTC) + timedelta(seconds=3), usegmt=True)
    past = format_datetime(datetime.now(UTC) - timedelta(seconds=30), usegmt=True)

    def read(value: str) -> float | None:
        return retry_after_s(httpx.Headers({"Retry-After": value}))

    assert read("2") == 2.0
    assert 1.0 < (read(in_3_s) or 0) <= 3.0
    assert read(past) == 0.0
    assert read("soon") is None and read("nan") is None
    assert retry_after_s(httpx.Headers()) is None


@pytest.mark.parametrize(
    ("fixture", "status", "words"),
    [
        ("unauthorized", 401, "Incorrect API key provided"),
        ("model_not_found", 404, "does not exist or you do not have access"),
        ("bad_request", 400, "Invalid schema for function"),
    ],
)
def test_a_4xx_is_not_retried_and_quotes_the_server(
    server: OpenAIServer, fixture: str, status: int, words: str
) -> None:
    server.enqueue_fixture(fixture)
    server.enqueue_fixture("text_answer")  # would be taken by a wrong retry
    observed = Observed()

    with pytest.raises(ProviderError) as caught:
        provider_for(server).complete(simple_request(), observer=observed)

    assert caught.value.retryable is False
    assert f"HTTP {status}" in str(caught.value) and words in str(caught.value)
    assert len(server.requests) == 1
    assert observed.events == []


def test_a_redirect_is_not_followed_and_says_which_url_to_use(server: OpenAIServer) -> None:
    # Following it could send the key to another host, or drop it and get a confusing 401.
    server.enqueue(308, "", {"Location": "https://api.example.com/v1/chat/completions"})

    with pytest.raises(ProviderError) as caught:
        provider_for(server).complete(simple_request())

    assert "redirected to https://api.example.com/v1/chat/completions" in str(caught.value)
    assert caught.value.retryable is False and len(server.requests) == 1


def test_an_observer_that_raises_ends_the_call_with_its_own_exception(
    server: OpenAIServer,
) -> None:
    # A turn whose lease was lost must stop, not keep retrying.
    class Fenced(Exception):
        pass

    def fenced(kind: str, data: dict[str, Any]) -> None:
        raise Fenced()

    server.enqueue_fixture("server_error")
    server.enqueue_fixture("text_answer")

    with pytest.raises(Fenced):
        provider_for(server).complete(simple_request(), observer=fenced)
    assert len(server.requests) == 1


# --- the key stays secret ------------------------------------------------------------


def test_the_key_never_appears_in_errors_reprs_identity_observer_payloads_or_logs(
    server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a server that echoes the Authorization header in its error messages
    echo = {"error": {"message": f"header was `Authorization: Bearer {KEY}`"}}
    server.enqueue(500, echo)
    server.enqueue(503, f"upstream said: Bearer {KEY}", {"Content-Type": "text/plain"})
    server.enqueue(401, echo)
    provider = provider_for(server, max_attempts=2)
    observed = Observed()
    errors: list[ProviderError] = []

    # When one call is retried until it gives up, and another is refused
    caplog.set_level(logging.DEBUG)
    for _ in range(2):
        with pytest.raises(ProviderError) as caught:
            provider.complete(simple_request(), observer=observed)
        errors.append(caught.value)

    # Then the key is nowhere, though the server's words are
    assert "upstream said: Bearer [redacted]" in str(errors[0])
    assert "header was `Authorization: Bearer [redacted]`" in str(errors[1])
    exposed = [repr(provider), str(provider.identity()), str(observed.events), caplog.text]
    for error in errors:
        exposed += [str(error), repr(error), str(error.args)]
        assert KEY.encode() not in pickle.dumps(error)
    assert len(observed.events) == 1
    for text in exposed:
        assert KEY not in text


def test_a_key_in_the_agent_file_is_refused_without_echoing_it() -> None:
    with pytest.raises(ValueError, match="api_key_env") as caught:
        OpenAIProvider.from_settings("gpt-test", {"provider": {"api_key": KEY}})
    assert KEY not in str(caught.value)

    # A key pasted where the variable's name belongs is refused too, and not quoted.
    with pytest.raises(ValueError, match="NAME of an environment variable") as caught:
        OpenAIProvider.from_settings("gpt-test", {"provider": {"api_key_env": KEY}})
    assert KEY not in str(caught.value)


def test_a_named_key_variable_that_is_not_set_fails_before_any_request(
    server: OpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VAR)

    with pytest.raises(ProviderError, match=f"{KEY_VAR} .* is not set") as caught:
        provider_for(server).complete(simple_request())

    assert caught.value.retryable is False
    assert server.requests == []


# --- configuration -------------------------------------------------------------------


def test_identity_names_provider_model_and_host_only(server: OpenAIServer) -> None:
    assert provider_for(server).identity() == {
        "provider": "openai",
        "model": "gpt-test",
        "base_url_host": f"127.0.0.1:{server.port}",
    }
    hosted = OpenAIProvider.from_settings("gpt-4o-mini", {})
    assert hosted.identity()["base_url_host"] == "api.openai.com"


@pytest.mark.parametrize(
    ("model", "settings", "problem"),
    [
        ("openai:", {}, "model name is empty"),
        ("openai:gpt-test", {"provider": {"timeout": 5}}, "`[provider] timeout`: unknown key"),
        ("openai:gpt-test", {"provider": {"max_attempts": 0}}, "max_attempts"),
        ("openai:gpt-test", {"provider": {"base_url": "127.0.0.1:11434"}}, "http(s) URL"),
        ("openai:gpt-test", {"provider": "fast"}, "must be a table"),
    ],
)
def test_a_bad_configuration_is_a_value_error_naming_the_problem(
    model: str, settings: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError) as caught:
        make_provider(model, Path("agent.toml"), settings)
    assert problem in str(caught.value)


def test_make_provider_routes_openai_models_to_this_provider(server: OpenAIServer) -> None:
    provider = make_provider("openai:gpt-test", Path("agent.toml"), {"provider": {}})
    assert isinstance(provider, OpenAIProvider)
    assert provider.identity()["model"] == "gpt-test"


def test_an_agent_file_points_a_run_at_the_server(server: OpenAIServer, tmp_path: Path) -> None:
    # Given an agent file naming the server and the key's variable
    agent_file = tmp_path / "desk.toml"
    agent_file.write_text(
        'name = "desk"\n'
        'model = "openai:gpt-test"\n'
        'system = "You are a refund desk."\n'
        "[provider]\n"
        f'base_url = "{server.url}"\n'
        f'api_key_env = "{KEY_VAR}"\n'
        "timeout_s = 5\n",
        encoding="utf-8",
    )
    server.enqueue_fixture("text_answer")

    # When it is loaded and its provider asked
    agent = load_agent(agent_file)
    response = agent.provider.complete(simple_request())

    # Then the binding names the server's host and never the key
    assert agent.binding_document["provider"] == {
        "provider": "openai",
        "model": "gpt-test",
        "base_url_host": f"127.0.0.1:{server.port}",
    }
    assert KEY not in str(agent.binding_document)
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert response.usage == TokenUsage(input_tokens=260, output_tokens=22)


def test_every_fixture_is_a_recorded_pair() -> None:
    for path in sorted((Path(__file__).parent / "fixtures" / "openai").glob("*.json")):
        pair = load_fixture(path.stem)
        assert set(pair) == {"description", "request", "response"}, path.name
        assert pair["request"]["path"] == "/v1/chat/completions", path.name


def test_a_transcript_message_is_put_in_wire_form_once_and_every_request_carries_it_whole(
    server: OpenAIServer,
) -> None:
    # Given a transcript, sent twice (as two turns of one run send it, the same objects)
    call = ToolCall(id="call_1", name="lookup_order", arguments={"order_id": "A-1", "note": "ä"})
    transcript = (
        Message(role="user", content="Refund order A-1."),
        Message(role="assistant", content="", tool_calls=(call,)),
        Message(role="tool", content='{"status": "shipped"}', tool_call_id="call_1"),
    )
    provider = provider_for(server)
    for _ in range(2):
        server.enqueue_fixture("text_answer")
        provider.complete(ModelRequest(messages=transcript, tools=(LOOKUP,), model_call=0))

    # Then both requests carried it as to_openai_message writes it, made once per message
    fresh = [to_openai_message(message) for message in transcript]
    assert [request.body["messages"] for request in server.requests] == [fresh, fresh]
    assert [openai._wire_messages.get(message) for message in transcript] == fresh
    # and an equal message that is another object is made afresh, the same
    copy = transcript[1].model_copy()
    assert openai._wire_messages.get(copy) is None
    assert openai._wire_message(copy) == fresh[1]


def test_the_wire_form_memo_stays_bounded_and_keeps_its_messages_own() -> None:
    memo = openai._wire_messages
    messages = [
        Message(role="tool", content=f"result {i}", tool_call_id=f"c{i}")
        for i in range(memo.entries + 50)
    ]
    for message in messages:
        openai._wire_message(message)
    kept = memo.items()
    assert len(kept) <= memo.entries and memo.size <= memo.max_bytes
    for key, (message, made) in kept:
        assert id(message) == key and made == to_openai_message(message)
