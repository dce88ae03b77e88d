"""The OpenAI-compatible provider with ``stream = true``: server-sent events, read as they
come, handed to ``deltas`` piece by piece, and assembled into the same whole response the
run journals and checkpoints. A stream cut off is the failed attempt it was.

Against the suite's server on 127.0.0.1 writing real chunked server-sent events.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import ProviderError, ProviderRateLimited
from runtime.models import RunStatus
from runtime.provider import ModelRequest
from runtime_io.providers.openai import OpenAIProvider, server_sent_data
from tasks.start import create_run
from tests.helpers import drive, memory_context
from tests.openai_server import OpenAIServer, text_chunks
from tests.test_openai_provider import LOOKUP, REFUND, Observed, simple_request

pytestmark = pytest.mark.timeout(60)

KEY_VAR = "TEST_API_KEY"


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_VAR, "sk-test-streaming-not-a-secret")


def streaming(server: OpenAIServer, **table: Any) -> OpenAIProvider:
    settings = {
        "provider": {"base_url": server.url, "api_key_env": KEY_VAR, "stream": True, **table}
    }
    return OpenAIProvider.from_settings("gpt-test", settings)


class Deltas:
    def __init__(self) -> None:
        self.pieces: list[dict[str, Any]] = []

    def __call__(self, piece: dict[str, Any]) -> None:
        self.pieces.append(piece)

    def text(self, attempt: int) -> str:
        return "".join(p.get("text", "") for p in self.pieces if p["attempt"] == attempt)


def test_the_answer_is_assembled_from_its_events_with_usage_from_the_last_chunk(
    server: OpenAIServer,
) -> None:
    usage = {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38}
    server.enqueue_stream(text_chunks(["Order ", "A-1001 ", "is refunded."], usage))
    deltas = Deltas()
    response = streaming(server).complete(simple_request(), deltas=deltas)
    assert response.content == "Order A-1001 is refunded."
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (31, 7)
    assert deltas.pieces == [
        {"attempt": 1, "text": "Order "},
        {"attempt": 1, "text": "A-1001 "},
        {"attempt": 1, "text": "is refunded."},
    ]
    (request,) = server.requests
    assert request.body["stream"] is True
    assert request.body["stream_options"] == {"include_usage": True}
    assert request.headers["accept"] == "text/event-stream"


def test_each_piece_reaches_deltas_before_the_server_sends_the_next(
    server: OpenAIServer,
) -> None:
    # The server sends each event only once the client has told `deltas` of the one
    # before: a provider that waited for the whole body would leave every gate shut
    pieces = ["one ", "two ", "three"]
    gates = {i: threading.Event() for i in range(2, 2 + len(pieces))}  # after role, piece 1
    server.enqueue_stream(text_chunks(pieces), gates=gates)
    seen: list[str] = []

    def deltas(piece: dict[str, Any]) -> None:
        seen.append(piece["text"])
        gates[1 + len(seen)].set()

    response = streaming(server).complete(simple_request(), deltas=deltas)
    assert server.gate_misses == []
    assert seen == pieces and response.content == "one two three"


def test_tool_calls_formed_across_events_become_the_same_calls_in_order(
    server: OpenAIServer,
) -> None:
    def part(index: int, **fields: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": index, **fields}]}}]}

    server.enqueue_stream(
        [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
            part(0, id="call_a", type="function", function={"name": "lookup_order"}),
            part(0, function={"arguments": '{"order_'}),
            part(1, id="call_b", type="function", function={"name": "issue_refund"}),
            part(0, function={"arguments": 'id": "A-1001"}'}),
            part(1, function={"arguments": '{"order_id": "A-1001", "amount_cents": 2900}'}),
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        ]
    )
    deltas = Deltas()
    request = ModelRequest(messages=simple_request().messages, tools=(LOOKUP, REFUND), model_call=0)
    response = streaming(server).complete(request, deltas=deltas)
    assert [(c.id, c.name, c.arguments) for c in response.tool_calls] == [
        ("call_a", "lookup_order", {"order_id": "A-1001"}),
        ("call_b", "issue_refund", {"order_id": "A-1001", "amount_cents": 2900}),
    ]
    assert response.content == ""
    assert deltas.pieces[0] == {"attempt": 1, "call": 0, "id": "call_a", "name": "lookup_order"}
    assert "".join(p.get("arguments", "") for p in deltas.pieces if p["call"] == 0) == (
        '{"order_id": "A-1001"}'
    )


@pytest.mark.parametrize(
    ("cut", "reason"),
    [
        ({"cut_after": 3}, "cut off"),
        ({"done": False}, "ended before its [DONE]"),
        ({"error": True}, "error event"),
    ],
    ids=["reset", "no-done", "error-event"],
)
def test_a_stream_cut_off_is_a_failed_attempt_and_the_next_attempt_streams_afresh(
    server: OpenAIServer, cut: dict[str, Any], reason: str
) -> None:
    first = text_chunks(["Ord", "er A-", "1001"])
    if cut.pop("error", False):
        first = [*first[:3], {"error": {"message": "the model server overloaded"}}]
    server.enqueue_stream(first, **cut)
    server.enqueue_stream(text_chunks(["Order A-1001 ", "is refunded."]))
    deltas, observed = Deltas(), Observed()
    provider = streaming(server, max_retry_s=5)
    response = provider.complete(simple_request(), deltas=deltas, observer=observed)
    # Then attempt 1 is marked aborted before attempt 2's pieces, and the answer is
    # attempt 2's alone, equal to what an observer assembles from that attempt
    aborted = [i for i, p in enumerate(deltas.pieces) if "aborted" in p]
    assert len(aborted) == 1 and deltas.pieces[aborted[0]]["attempt"] == 1
    assert reason in deltas.pieces[aborted[0]]["aborted"]
    assert all(p["attempt"] == 1 for p in deltas.pieces[: aborted[0]])
    assert all(p["attempt"] == 2 for p in deltas.pieces[aborted[0] + 1 :])
    assert response.content == deltas.text(2) == "Order A-1001 is refunded."
    assert [(kind, data["attempt"]) for kind, data in observed.events] == [("model.retrying", 1)]
    assert reason in observed.events[0][1]["error"]
    assert len(server.requests) == 2


def test_streams_cut_off_every_time_give_up_as_a_retryable_error(server: OpenAIServer) -> None:
    for _ in range(2):
        server.enqueue_stream(text_chunks(["Ord", "er"]), cut_after=2)
    with pytest.raises(ProviderError) as failed:
        streaming(server, max_attempts=2, max_retry_s=5).complete(simple_request(), deltas=Deltas())
    assert failed.value.retryable and "gave up after 2 attempt(s)" in str(failed.value)
    assert "the stream was cut off" in str(failed.value)


def test_a_429_to_a_streaming_request_still_goes_to_the_queue_with_its_retry_after(
    server: OpenAIServer,
) -> None:
    server.enqueue(429, {"error": {"message": "slow down"}}, {"Retry-After": "7"})
    with pytest.raises(ProviderRateLimited) as limited:
        streaming(server).complete(simple_request(), deltas=Deltas())
    assert limited.value.retry_after_s == 7 and "slow down" in str(limited.value)


def test_server_sent_events_are_read_as_the_format_says() -> None:
    lines = [": a comment", "event: message", "data: {\"a\":", "data: 1}", "", "id: 4", "",
             "data:[DONE]", ""]  # fmt: skip
    assert list(server_sent_data(lines)) == ['{"a":\n1}', "[DONE]"]


def test_a_run_with_a_streaming_model_checkpoints_the_whole_answer(
    server: OpenAIServer, tmp_path: Path
) -> None:
    # Given an agent file that streams, and a server that sends the answer in pieces
    agent = tmp_path / "streams.toml"
    agent.write_text(
        "\n".join(
            [
                'name = "streams"',
                'model = "openai:gpt-test"',
                'system = "You are a refund desk."',
                "tools = []",
                "[provider]",
                f'base_url = "{server.url}"',
                f'api_key_env = "{KEY_VAR}"',
                "stream = true",
            ]
        )
        + "\n"
    )
    server.enqueue_stream(text_chunks(["Order A-1001 ", "is ", "refunded."]))
    ctx = memory_context()
    run = create_run(ctx, agent, "Refund A-1001.", "streamed-run")
    live = ctx.runs.live()
    assert live is not None
    live.watch(run.run_id, 60)  # someone watches: the call streams
    # When the run is driven
    drive(ctx, run.run_id)
    # Then the run's journal holds the assembled answer, whole, as without streaming
    record = ctx.runs.get(run.run_id)
    assert record is not None and record.status == RunStatus.COMPLETED, record
    responded = [e for e in ctx.runs.events(run.run_id, after_seq=0) if e.type == "model.responded"]
    assert [e.data["content"] for e in responded] == ["Order A-1001 is refunded."]
    assert server.requests[-1].body["stream"] is True
    assert [e.data.get("text") for e in live.read(run.run_id)] == [
        "Order A-1001 ",
        "is ",
        "refunded.",
    ]


def test_a_run_nobody_watches_asks_for_its_answer_whole(
    server: OpenAIServer, tmp_path: Path
) -> None:
    # Given an agent that streams, whose run nobody watches
    agent = tmp_path / "streams.toml"
    agent.write_text(
        f'name = "streams"\nmodel = "openai:gpt-test"\ntools = []\n[provider]\n'
        f'base_url = "{server.url}"\napi_key_env = "{KEY_VAR}"\nstream = true\n'
    )
    server.enqueue(200, {"choices": [{"message": {"content": "Done."}}]})
    ctx = memory_context()
    run = create_run(ctx, agent, "Refund A-1001.", "unwatched-run")
    # When it is driven
    drive(ctx, run.run_id)
    # Then its model call was not streamed: reading pieces costs, and nobody reads them
    assert "stream" not in server.requests[-1].body
    assert ctx.runs.live().read(run.run_id) == []  # type: ignore[union-attr]
    record = ctx.runs.get(run.run_id)
    assert record is not None and record.output == "Done."


def test_a_streamed_answer_read_to_its_end_leaves_the_connection_for_the_next_call(
    server: OpenAIServer,
) -> None:
    # Given a provider that streams, and three answers in a row
    provider = streaming(server)
    for _ in range(3):
        server.enqueue_stream(text_chunks(["Hel", "lo"]))
    # When it is asked three times
    for _ in range(3):
        assert provider.complete(simple_request(), deltas=Deltas()).content == "Hello"
    # Then all three went over one connection (each new one is a TLS handshake elsewhere)
    assert len({r.client_port for r in server.requests[-3:]}) == 1, server.requests
