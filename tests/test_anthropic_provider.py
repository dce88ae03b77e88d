"""The Anthropic Messages-API provider against a real HTTP server on 127.0.0.1.

The server (``tests/openai_server.py``, which answers any POST path from a queue and
records every request) plays Messages-API bodies shaped as Anthropic documents them;
the last tests drive whole runs through a Celery worker: the in-process session
worker, and ``celery -A worker worker`` subprocesses on each pool.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import AgentFileError, ProviderError, ProviderRateLimited
from runtime.models import Message, RunStatus, ToolCall
from runtime.provider import INVALID_ARGUMENTS_KEY, ModelRequest
from runtime_io.agent_files import load_agent
from runtime_io.providers.anthropic import API_VERSION, AnthropicProvider
from runtime_io.providers.known import make_provider
from tasks.limits import limit_store
from tests.helpers import fresh_key
from tests.openai_server import OpenAIServer
from tests.workers import WorkerProcesses, run_on_workers
from worker.api import Ratchet

pytestmark = pytest.mark.timeout(60)

KEY_VAR = "ANTHROPIC_TEST_API_KEY"
LOOKUP = {
    "name": "lookup_order",
    "description": "Look up an order by id.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
}


def message(*blocks: dict[str, Any], usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A Messages-API response body, as the API documents it."""
    calls = any(b["type"] == "tool_use" for b in blocks)
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": list(blocks),
        "stop_reason": "tool_use" if calls else "end_turn",
        "stop_sequence": None,
        "usage": usage or {"input_tokens": 10, "output_tokens": 5},
    }


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def tool_use(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def error(kind: str, text_: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": text_}}


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    return fresh_key(
        monkeypatch,
        KEY_VAR,
        "sk-ant-test-",
        unset=("RATCHET_ANTHROPIC_BASE_URL", "RATCHET_ANTHROPIC_API_KEY"),
    )


def provider(server: OpenAIServer, **table: Any) -> AnthropicProvider:
    built = AnthropicProvider.from_settings(
        "claude-test",
        {"provider": {"base_url": server.url, "api_key_env": KEY_VAR, "max_retry_s": 5, **table}},
    )
    assert isinstance(built, AnthropicProvider)
    return built


TRANSCRIPT = (
    Message(role="system", content="You are a refund desk."),
    Message(role="user", content="Where are orders B2 and C3?"),
    Message(
        role="assistant",
        content="Looking both up.",
        tool_calls=(
            ToolCall(id="toolu_1", name="lookup_order", arguments={"order_id": "B2"}),
            ToolCall(id="toolu_2", name="lookup_order", arguments={"order_id": "C3"}),
        ),
    ),
    Message(role="tool", tool_call_id="toolu_1", name="lookup_order", content='{"status": "lost"}'),
    Message(
        role="tool",
        tool_call_id="toolu_2",
        name="lookup_order",
        content="no such order",
        is_error=True,
    ),
)


def test_the_request_speaks_the_messages_api_with_the_key_in_x_api_key(
    server: OpenAIServer, key: str
) -> None:
    # Given a transcript with a system prompt, two parallel calls and their results
    server.enqueue(200, message(text("B2 is lost; C3 does not exist.")))

    # When the provider asks the model
    response = provider(server).complete(
        ModelRequest(messages=TRANSCRIPT, tools=(LOOKUP,), model_call=1)
    )

    # Then one POST /v1/messages went, with the key and the version, and no bearer token
    assert response.content == "B2 is lost; C3 does not exist."
    (request,) = server.requests
    assert request.path == "/v1/messages"
    assert request.headers["x-api-key"] == key
    assert request.headers["anthropic-version"] == API_VERSION
    assert "authorization" not in request.headers
    # And the transcript became the API's turns: system apart, the two results in one
    # user turn right after the assistant's tool_use blocks, the error marked
    assert request.body == {
        "model": "claude-test",
        "max_tokens": 4096,
        "system": "You are a refund desk.",
        "tools": [
            {
                "name": "lookup_order",
                "description": "Look up an order by id.",
                "input_schema": LOOKUP["parameters"],
            }
        ],
        "messages": [
            {"role": "user", "content": [text("Where are orders B2 and C3?")]},
            {
                "role": "assistant",
                "content": [
                    text("Looking both up."),
                    tool_use("toolu_1", "lookup_order", {"order_id": "B2"}),
                    tool_use("toolu_2", "lookup_order", {"order_id": "C3"}),
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": '{"status": "lost"}',
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": "no such order",
                        "is_error": True,
                    },
                ],
            },
        ],
    }


def test_parallel_tool_use_blocks_become_calls_in_order_and_cache_tokens_count_as_input(
    server: OpenAIServer, key: str
) -> None:
    server.enqueue(
        200,
        message(
            text("Let me look."),
            tool_use("toolu_a", "lookup_order", {"order_id": "B2"}),
            {"type": "thinking", "thinking": "not part of the transcript", "signature": "x"},
            tool_use("toolu_b", "lookup_order", "not an object"),
            usage={
                "input_tokens": 12,
                "output_tokens": 30,
                "cache_read_input_tokens": 100,
                "cache_creation_input_tokens": 7,
            },
        ),
    )
    response = provider(server, max_tokens=256).complete(
        ModelRequest(messages=TRANSCRIPT[:2], model_call=0)
    )
    assert server.requests[0].body["max_tokens"] == 256
    assert "tools" not in server.requests[0].body
    assert response.content == "Let me look."
    assert [(c.id, c.arguments) for c in response.tool_calls] == [
        ("toolu_a", {"order_id": "B2"}),
        ("toolu_b", {INVALID_ARGUMENTS_KEY: "'not an object'"}),
    ]
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (119, 30)


def test_a_529_overloaded_is_retried_and_the_next_answer_returned(
    server: OpenAIServer, key: str
) -> None:
    server.enqueue(529, error("overloaded_error", "Overloaded"), {"retry-after": "0"})
    server.enqueue(200, message(text("done")))
    seen: list[dict[str, Any]] = []
    response = provider(server).complete(
        ModelRequest(messages=TRANSCRIPT[:2], model_call=0),
        observer=lambda _type, data: seen.append(data),
    )
    assert response.content == "done" and len(server.requests) == 2
    assert [(s["attempt"], s["status"], s["error"]) for s in seen] == [(1, 529, "Overloaded")]


def test_a_429_is_not_retried_in_process_and_hands_its_retry_after_to_the_turn(
    server: OpenAIServer, key: str
) -> None:
    server.enqueue(429, error("rate_limit_error", "slow down"), {"retry-after": "7"})
    with pytest.raises(ProviderRateLimited) as limited:
        provider(server).complete(ModelRequest(messages=TRANSCRIPT[:2], model_call=0))
    assert limited.value.retry_after_s == 7.0 and "slow down" in str(limited.value)
    assert len(server.requests) == 1


def test_a_refusal_quotes_the_server_without_the_key_and_is_not_retried(
    server: OpenAIServer, key: str
) -> None:
    server.enqueue(401, error("authentication_error", f"invalid x-api-key {key}"))
    with pytest.raises(ProviderError) as refused:
        provider(server).complete(ModelRequest(messages=TRANSCRIPT[:2], model_call=0))
    assert "HTTP 401" in str(refused.value) and KEY_VAR in str(refused.value)
    assert key not in str(refused.value) and len(server.requests) == 1


def test_a_body_that_is_not_a_message_is_a_clear_error(server: OpenAIServer, key: str) -> None:
    server.enqueue(200, {"choices": []})
    with pytest.raises(ProviderError, match="not a Messages-API message"):
        provider(server).complete(ModelRequest(messages=TRANSCRIPT[:2], model_call=0))


def test_the_key_is_never_sent_over_plain_http_beyond_loopback(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): refused before any request, so nothing is sent.
    far = {"provider": {"base_url": "http://192.0.2.7:8080/v1", "api_key_env": KEY_VAR}}
    with pytest.raises(ValueError, match="plain http") as at_load:
        AnthropicProvider.from_settings("claude-test", far)
    assert key not in str(at_load.value)
    # The default variable, set after load: refused at the call, before any request
    monkeypatch.setenv("RATCHET_ANTHROPIC_API_KEY", key)
    quiet = AnthropicProvider.from_settings(
        "claude-test", {"provider": {"base_url": "http://192.0.2.7:8080/v1"}}
    )
    with pytest.raises(ProviderError, match="refusing to send the API key over plain http"):
        quiet.complete(ModelRequest(messages=TRANSCRIPT[:2], model_call=0))


def test_the_key_variable_must_be_one_the_operator_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_ANTHROPIC_KEY_VARIABLES", "DESK_ANTHROPIC_KEY")
    with pytest.raises(ValueError, match="RATCHET_ANTHROPIC_KEY_VARIABLES"):
        AnthropicProvider.from_settings("claude-test", {"provider": {"api_key_env": "OTHER_KEY"}})
    allowed = AnthropicProvider.from_settings(
        "claude-test", {"provider": {"api_key_env": "DESK_ANTHROPIC_KEY"}}
    )
    assert allowed.identity() == {
        "provider": "anthropic",
        "model": "claude-test",
        "base_url_host": "api.anthropic.com",
    }
    assert allowed.limit_key() == "anthropic/api.anthropic.com/claude-test/DESK_ANTHROPIC_KEY"


def test_make_provider_routes_anthropic_models_and_names_it_among_the_known(
    tmp_path: Path,
) -> None:
    assert isinstance(make_provider("anthropic:claude-x", tmp_path, {}), AnthropicProvider)
    with pytest.raises(ValueError, match="`anthropic:<model-name>`"):
        make_provider("gemini:x", tmp_path, {})
    agent = tmp_path / "empty.toml"
    agent.write_text('name = "x"\nmodel = "anthropic:"\n', encoding="utf-8")
    with pytest.raises(AgentFileError, match='model = "anthropic:<model-name>"'):
        load_agent(agent)


# --- whole runs on a worker --------------------------------------------------------------


def write_agent(
    directory: Path, server: OpenAIServer, name: str = "claude-desk", *extra: str
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text(
        "\n".join(
            [
                f'name = "{name}"',
                'model = "anthropic:claude-test"',
                'system = "You are a refund desk."',
                'tools = ["examples.refunds:lookup_order"]',
                "[provider]",
                f'base_url = "{server.url}"',
                f'api_key_env = "{KEY_VAR}"',
                "timeout_s = 5",
                "max_retry_s = 10",
                *extra,
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    return path


def queue_two_lookups_then_answer(server: OpenAIServer) -> None:
    server.enqueue(
        200,
        message(
            tool_use("toolu_b2", "lookup_order", {"order_id": "B2"}),
            tool_use("toolu_a1", "lookup_order", {"order_id": "A1"}),
            usage={"input_tokens": 40, "output_tokens": 20, "cache_read_input_tokens": 60},
        ),
    )
    server.enqueue(529, error("overloaded_error", "Overloaded"), {"retry-after": "0"})
    server.enqueue(
        200, message(text("Both found."), usage={"input_tokens": 90, "output_tokens": 8})
    )


def test_a_run_with_two_parallel_calls_and_a_529_completes_counting_the_usage(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    # Given Claude asks for two look-ups at once, is overloaded once, then answers
    queue_two_lookups_then_answer(server)

    # When a run of an anthropic: agent goes through the Celery worker
    run_id = ratchet.start(write_agent(tmp_path, server), "Where are B2 and A1?")
    record = ratchet.wait(run_id, timeout_s=20)

    # Then it completed, both calls ran in one turn, and the 529 was retried in the turn
    assert record.status == RunStatus.COMPLETED and record.output == "Both found."
    types = [e.type for e in ratchet.events(run_id)]
    assert types.count("tool.completed") == 2 and types.count("model.retrying") == 1
    assert (record.usage.model_turns, record.usage.tool_calls) == (2, 2)
    # And usage is what the server reported, cache reads counted as input
    assert (record.usage.input_tokens, record.usage.output_tokens) == (190, 28)
    # And the second request carried both results in one user turn
    last = server.requests[-1].body["messages"][-1]
    assert last["role"] == "user"
    assert [b["tool_use_id"] for b in last["content"]] == ["toolu_b2", "toolu_a1"]


def test_a_429_waits_on_the_queue_with_its_retry_after_and_is_not_counted_as_an_attempt(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    server.enqueue(429, error("rate_limit_error", "slow down"), {"retry-after": "1"})
    server.enqueue(200, message(text("done")))
    run_id = ratchet.start(write_agent(tmp_path, server), "hello")
    record = ratchet.wait(run_id, timeout_s=20)
    assert record.status == RunStatus.COMPLETED
    events = ratchet.events(run_id)
    throttled = next(e for e in events if e.type == "run.throttled")
    assert throttled.data["reason"] == "429" and throttled.data["wait_s"] == 1.0
    # held off through the fleet's limit of the provider's key, not slept out in the worker
    assert throttled.data["refused"] is True
    assert throttled.data["limit"] == f"anthropic/127.0.0.1:{server.port}/claude-test/{KEY_VAR}"
    second = next(e for e in events if e.seq > throttled.seq and e.type == "model.requested")
    assert second.at_ms - throttled.at_ms >= 950
    # The refused request is given back: one attempt, one turn
    assert record.usage.model_attempts == 1 and record.usage.model_turns == 1


def test_cache_reads_and_writes_count_against_the_token_budget_and_the_token_limit(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    # Given a 1000-token budget, a token limit of 10 a second, and a first answer whose
    # 1330 tokens are mostly the cache's reads and writes
    limit = f"claude-test-{uuid.uuid4().hex[:8]}"
    server.enqueue(
        200,
        message(
            tool_use("toolu_1", "lookup_order", {"order_id": "B2"}),
            usage={
                "input_tokens": 10,
                "output_tokens": 20,
                "cache_read_input_tokens": 600,
                "cache_creation_input_tokens": 700,
            },
        ),
    )
    agent = write_agent(
        tmp_path,
        server,
        "claude-desk",
        "max_tokens = 16",  # the limiter's estimate before the call: about 150 tokens
        "[budgets]",
        "max_total_tokens = 1000",
        "[limits]",
        f'key = "{limit}"',
        "tokens_per_minute = 600",
    )

    # When the run goes through the worker
    run_id = ratchet.start(agent, "Where is B2?")
    record = ratchet.wait(run_id, timeout_s=20)

    # Then it stopped on the token budget without asking the model again
    assert record.status == RunStatus.FAILED, record.error
    (failed,) = [e for e in ratchet.events(run_id) if e.type == "run.failed"]
    assert failed.data["budget"] == "max_total_tokens", failed.data
    assert (record.usage.input_tokens, record.usage.output_tokens) == (1310, 20)
    assert len(server.requests) == 1
    # And the limit's token schedule was charged the same 1330 tokens: 133 s at 10 a
    # second (the estimate alone is about 15 s; without the cache's writes, 63 s)
    ahead_s = limit_store(ratchet.ctx).use(limit).ahead_s["tokens"]
    assert 120 < ahead_s <= 133, ahead_s


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_an_anthropic_run_completes_on_each_pool(
    worker_processes: WorkerProcesses,
    server: OpenAIServer,
    key: str,
    redis_url: str,
    tmp_path: Path,
    pool: str,
) -> None:
    # Given a worker of each pool on Redis, and Claude asking for two look-ups at once
    queue_two_lookups_then_answer(server)
    worker_processes.start("--pool", pool, "--concurrency", "4", **{KEY_VAR: key})
    # When a run starts on that worker's broker
    agent = write_agent(tmp_path, server)
    record = run_on_workers(redis_url, agent, "Where are B2 and A1?", timeout_s=40)
    # Then it completed there, with both calls and the 529 retried
    assert record.status == RunStatus.COMPLETED and record.output == "Both found."
    assert record.usage.tool_calls == 2 and len(server.requests) == 3


# --- streaming: the Messages API's server-sent events -----------------------------


def message_events(*events: dict[str, Any]) -> list[Any]:
    """A streamed message: start (input usage), ``events``, then its end (output usage)."""
    start = {"type": "message_start", "message": {"type": "message", "content": [],
             "usage": {"input_tokens": 30, "cache_read_input_tokens": 5, "output_tokens": 1}}}  # fmt: skip
    end = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 12}}  # fmt: skip
    return [start, {"type": "ping"}, *events, end, {"type": "message_stop"}]


def block(index: int, content_block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": content_block}


def piece(index: int, **delta: Any) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def test_a_streamed_message_is_told_piece_by_piece_and_put_back_together_whole(
    server: OpenAIServer, key: str
) -> None:
    # Given a Messages-API stream with text and two tool_use blocks formed across events
    server.enqueue_stream(
        message_events(
            block(0, {"type": "text", "text": ""}),
            piece(0, type="text_delta", text="Looking "),
            piece(0, type="text_delta", text="both up."),
            block(1, {"type": "tool_use", "id": "toolu_1", "name": "lookup_order", "input": {}}),
            piece(1, type="input_json_delta", partial_json='{"order_'),
            piece(1, type="input_json_delta", partial_json='id": "B2"}'),
            block(2, {"type": "tool_use", "id": "toolu_2", "name": "lookup_order", "input": {}}),
            piece(2, type="input_json_delta", partial_json='{"order_id": "C3"}'),
        )
    )
    told: list[dict[str, Any]] = []
    # When it is asked for as a stream
    response = provider(server, stream=True).complete(
        ModelRequest(messages=TRANSCRIPT[:2], model_call=0), deltas=told.append
    )
    # Then the pieces were told as they came, and the answer is the whole message
    assert server.requests[-1].body["stream"] is True
    assert "stream_options" not in server.requests[-1].body  # OpenAI's, not the Messages API's
    assert [t.get("text") for t in told if "text" in t] == ["Looking ", "both up."]
    assert [t.get("arguments") for t in told if t.get("call") == 1 and "arguments" in t] == [
        '{"order_',
        'id": "B2"}',
    ]
    assert response.content == "Looking both up."
    assert [(c.id, c.arguments) for c in response.tool_calls] == [
        ("toolu_1", {"order_id": "B2"}),
        ("toolu_2", {"order_id": "C3"}),
    ]
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (35, 12)


def test_an_overloaded_error_mid_stream_is_a_failed_attempt_retried_as_one(
    server: OpenAIServer, key: str
) -> None:
    server.enqueue_stream(
        [
            message_events()[0],
            block(0, {"type": "text", "text": ""}),
            piece(0, type="text_delta", text="Half"),
            {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        ]
    )
    server.enqueue_stream(message_events(block(0, {"type": "text", "text": "Whole."})))
    told: list[dict[str, Any]] = []
    response = provider(server, stream=True).complete(
        ModelRequest(messages=TRANSCRIPT[:2], model_call=0), deltas=told.append
    )
    assert response.content == "Whole."
    assert told[:2] == [
        {"attempt": 1, "text": "Half"},
        {"attempt": 1, "aborted": "the server sent an error event: Overloaded"},
    ]


def test_a_stream_that_stops_before_message_stop_is_cut_off(server: OpenAIServer, key: str) -> None:
    server.enqueue_stream(message_events(block(0, {"type": "text", "text": "Hi"}))[:-1], done=False)
    server.enqueue_stream(message_events(block(0, {"type": "text", "text": "Hi again"})))
    told: list[dict[str, Any]] = []
    response = provider(server, stream=True).complete(
        ModelRequest(messages=TRANSCRIPT[:2], model_call=0), deltas=told.append
    )
    assert response.content == "Hi again"
    assert {"attempt": 1, "aborted": "the stream ended before its message_stop"} in told
