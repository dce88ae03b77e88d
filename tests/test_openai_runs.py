"""Runs of an ``openai:`` agent through the turn loop, against a real HTTP server on 127.0.0.1.

The provider's own behaviour is in ``test_openai_provider.py``; here the same
recorded responses (``tests/fixtures/openai/``) drive whole runs — on the
in-process Celery worker with Redis stores, and on file + SQLite stores — and
the tests read what the run recorded: events, usage, status, error. The API
key is a fresh ``sk-test-<uuid>`` per test; the last tests look for it in every
byte the runs left behind.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from runtime.fsm import rebuild
from runtime.models import Event, RunStatus
from store import open_run_store, open_snapshot_store
from store.packing import is_packed
from store.runs import RunRecord
from tasks.context import Context, set_context
from tasks.settings import Settings
from tasks.start import create_run
from tasks.turn import advance
from tests import probed_tools
from tests.helpers import drive, fresh_key, memory_context, tool_turn_events
from tests.openai_server import OpenAIServer, RecordedRequest, load_fixture, serve
from tests.redis_server import RedisServer
from tests.workers import BROKER_DB
from worker.api import Ratchet
from worker.cli import main as cli

pytestmark = pytest.mark.timeout(30)

KEY_VAR = "OPENAI_RUNS_TEST_API_KEY"
TOOLS = ["examples.refunds:lookup_order", "examples.refunds:issue_refund"]
LOOKUP_ID, REFUND_ID = "call_Hk7pT2mQw9sR", "call_Zb4nV6xLc1dF"
"""Call ids as the recording has them."""
ANSWER = load_fixture("text_answer")["response"]["body"]["choices"][0]["message"]["content"]
RECORDED_USAGE = load_fixture("two_tool_calls")["response"]["body"]["usage"]
WAIT_S = 15.0


# --- fixtures and building blocks ---------------------------------------------------------


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    """A key no other test uses, in the variable the agent names (the worker shares our env)."""
    return fresh_key(
        monkeypatch,
        KEY_VAR,
        "sk-test-",
        unset=("RATCHET_OPENAI_BASE_URL", "RATCHET_OPENAI_API_KEY"),
    )


def write_openai_agent(
    directory: Path,
    server: OpenAIServer,
    *,
    name: str = "openai-desk",
    provider: dict[str, Any] | None = None,
    budgets: dict[str, Any] | None = None,
    tools: list[str] = TOOLS,
) -> Path:
    table = {"timeout_s": 5, "max_retry_s": 10, **(provider or {})}
    lines = [
        f'name = "{name}"',
        'model = "openai:gpt-test"',
        'system = "You are a refund desk."',
        "tools = [" + ", ".join(f'"{t}"' for t in tools) + "]",
        "[provider]",
        f'base_url = "{server.url}"',
        f'api_key_env = "{KEY_VAR}"',
        *(f"{k} = {v}" for k, v in table.items()),
        "[budgets]",
        *(f"{k} = {v}" for k, v in (budgets or {}).items()),
    ]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def asks_for(*calls: dict[str, Any], usage: bool = True) -> dict[str, Any]:
    """The recorded tool-calling completion, asking for ``calls`` (with or without usage)."""
    body: dict[str, Any] = copy.deepcopy(load_fixture("two_tool_calls")["response"]["body"])
    body["choices"][0]["message"]["tool_calls"] = list(calls)
    if not usage:
        del body["usage"]
    return body


LOOKUP_B2 = asks_for(tool_call(LOOKUP_ID, "lookup_order", '{"order_id":"B2"}'))
REFUND_B2 = asks_for(tool_call(REFUND_ID, "issue_refund", '{"order_id":"B2","amount_cents":2900}'))


def queue_refund_conversation(server: OpenAIServer) -> None:
    """Turn 1 looks the order up, turn 2 refunds it, turn 3 answers."""
    server.enqueue(200, LOOKUP_B2)
    server.enqueue(200, REFUND_B2)
    server.enqueue_fixture("text_answer")


def queue_rate_limit_and_server_error(server: OpenAIServer) -> None:
    server.enqueue_fixture("rate_limited")  # Retry-After: 1
    server.enqueue_fixture("server_error")
    server.enqueue_fixture("text_answer")


def queue_timeout(server: OpenAIServer) -> None:
    server.enqueue_fixture("text_answer", delay_s=2.0)  # over timeout_s = 0.5
    server.enqueue_fixture("text_answer")


def queue_malformed_second_turn(server: OpenAIServer) -> None:
    server.enqueue(200, LOOKUP_B2)
    server.enqueue_fixture("html_instead_of_json")


def queue_unauthorized(server: OpenAIServer) -> None:
    server.enqueue_fixture("unauthorized")
    server.enqueue_fixture("text_answer")  # would be taken by a wrong retry


def queue_answer_without_usage(server: OpenAIServer) -> None:
    server.enqueue(
        200, asks_for(tool_call(LOOKUP_ID, "lookup_order", '{"order_id":"B2"}'), usage=False)
    )
    server.enqueue_fixture("text_answer")  # would be taken if the run went on


Queue = Callable[[OpenAIServer], None]
SCENARIOS: dict[str, tuple[Queue, dict[str, Any], dict[str, Any], RunStatus]] = {
    # name: (responses, [provider] table, [budgets], final status)
    "refund": (queue_refund_conversation, {}, {}, RunStatus.COMPLETED),
    "retried": (queue_rate_limit_and_server_error, {}, {}, RunStatus.COMPLETED),
    "timeout": (queue_timeout, {"timeout_s": 0.5}, {}, RunStatus.COMPLETED),
    "malformed": (queue_malformed_second_turn, {}, {}, RunStatus.FAILED),
    "unauthorized": (queue_unauthorized, {}, {}, RunStatus.FAILED),
    "no-usage": (queue_answer_without_usage, {}, {"max_total_tokens": 5000}, RunStatus.FAILED),
}


def run_on_worker(
    ratchet: Ratchet, directory: Path, server: OpenAIServer, scenario: str
) -> tuple[RunRecord, list[Event]]:
    """Start a run of ``scenario`` on the Celery worker; its final record and events."""
    queue, provider, budgets, _ = SCENARIOS[scenario]
    queue(server)
    agent = write_openai_agent(
        directory / scenario, server, name=scenario, provider=provider, budgets=budgets
    )
    run_id = ratchet.start(agent, "My toaster never arrived (order B2). Can I get a refund?")
    record = ratchet.wait(run_id, timeout_s=WAIT_S)
    assert not record.status.is_live, f"run {run_id} is still {record.status.value}"
    return record, ratchet.events(run_id)


def types_of(events: list[Event]) -> list[str]:
    return [e.type for e in events]


# --- runs on a real worker ------------------------------------------------------------------


def test_a_multi_turn_run_with_tool_calls_completes_on_a_worker_counting_the_recorded_usage(
    ratchet: Ratchet, server: OpenAIServer, key: str, ledger: Path, tmp_path: Path
) -> None:
    # Given recorded completions: look the order up, refund it, answer
    # When a run of an openai: agent goes through the Celery worker
    record, events = run_on_worker(ratchet, tmp_path, server, "refund")

    # Then it completed with the recorded answer, and the tools really ran
    assert record.status == RunStatus.COMPLETED
    assert record.output == ANSWER
    assert ledger.read_text().splitlines() == ["refund B2 2900"]
    assert types_of(events) == tool_turn_events(2)
    # And usage is the sum of what the server reported, one attempt per turn
    answer_usage = load_fixture("text_answer")["response"]["body"]["usage"]
    input_tokens = 2 * RECORDED_USAGE["prompt_tokens"] + answer_usage["prompt_tokens"]
    output_tokens = 2 * RECORDED_USAGE["completion_tokens"] + answer_usage["completion_tokens"]
    assert (record.usage.input_tokens, record.usage.output_tokens) == (input_tokens, output_tokens)
    assert record.usage.total_tokens == input_tokens + output_tokens == 742
    assert (record.usage.model_attempts, record.usage.model_turns) == (3, 3)
    assert record.usage.tool_calls == 2
    # And each request carried the key and every earlier tool result
    assert len(server.requests) == 3
    assert {r.headers["authorization"] for r in server.requests} == {f"Bearer {key}"}
    last = server.requests[2].body["messages"]
    assert [m.get("tool_call_id") for m in last if m["role"] == "tool"] == [LOOKUP_ID, REFUND_ID]
    assert '"refunded_cents": 2900' in last[-1]["content"]


def test_a_429_waits_on_the_queue_with_its_retry_after_and_is_not_counted_as_an_attempt(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    # Given a provider that answers 429 (Retry-After: 1), then 500, then the answer
    record, events = run_on_worker(ratchet, tmp_path, server, "retried")

    # Then the 429 ended the turn (run.throttled, a countdown of the Retry-After on the
    # broker), the next delivery asked again, and the 500 was retried in-process
    assert record.status == RunStatus.COMPLETED and record.output == ANSWER
    assert types_of(events) == [
        "run.created",
        "model.requested",
        "run.throttled",
        "model.requested",
        "model.retrying",
        "model.responded",
        "run.completed",
    ]
    throttled = next(e for e in events if e.type == "run.throttled")
    assert throttled.data["reason"] == "429" and throttled.data["refused"] is True
    assert throttled.data["wait_s"] == 1.0 and throttled.data["turn"] == 1
    second = next(e for e in events if e.seq > throttled.seq and e.type == "model.requested")
    # The countdown really was on the queue: the next request came after Retry-After
    assert second.at_ms - throttled.at_ms >= 950
    retrying = next(e.data for e in events if e.type == "model.retrying")
    assert (retrying["turn"], retrying["attempt"], retrying["status"]) == (1, 1, 500)
    # Three requests, one model call; the refused one is given back: two attempts
    assert len(server.requests) == 3
    assert record.usage.model_attempts == 2 and record.usage.model_turns == 1


def test_a_server_slower_than_timeout_s_is_retried_within_the_turn(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    record, events = run_on_worker(ratchet, tmp_path, server, "timeout")

    assert record.status == RunStatus.COMPLETED and record.output == ANSWER
    [retrying] = [e.data for e in events if e.type == "model.retrying"]
    assert retrying["status"] is None and "timeout_s=0.5" in retrying["error"]
    assert "model.failed" not in types_of(events)
    assert len(server.requests) == 2
    assert record.usage.model_attempts == 2


def test_parallel_results_finishing_out_of_order_reach_the_server_in_the_order_asked(
    server: OpenAIServer, key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a response asking for three calls, journaled last first: each returns once the
    # call after it has its outcome in the log
    ctx = memory_context()

    def journaled(label: str) -> bool:
        return any(
            e.type == "tool.completed" and e.data["result"]["label"] == label
            for e in ctx.runs.events(run_id)
        )

    monkeypatch.setattr(probed_tools, "JOURNALED", [journaled])
    server.enqueue(
        200,
        asks_for(
            tool_call("call_a", "finishes_after", '{"label":"a","after":"b"}'),
            tool_call("call_b", "finishes_after", '{"label":"b","after":"c"}'),
            tool_call("call_c", "finishes_after", '{"label":"c"}'),
        ),
    )
    server.enqueue_fixture("text_answer")
    agent = write_openai_agent(tmp_path, server, tools=["tests.probed_tools:finishes_after"])
    run_id = create_run(ctx, agent, "go").run_id
    # When the run goes through the turn loop
    assert drive(ctx, run_id).outcome == "completed"
    # Then the results were journaled and folded as they finished, the last first ...
    state = rebuild(ctx.runs.events(run_id))
    assert state is not None
    folded = [m.tool_call_id for m in state.transcript if m.role == "tool"]
    assert folded == ["call_c", "call_b", "call_a"]
    # ... and the provider sent them in the order the model asked, right after its response
    sent = server.requests[1].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "tool", "tool"]
    assert [m["tool_call_id"] for m in sent[3:]] == ["call_a", "call_b", "call_c"]
    assert [json.loads(m["content"])["label"] for m in sent[3:]] == ["a", "b", "c"]


def assert_failed_saying(record: RunRecord, *parts: str) -> None:
    """The run failed, its error saying each of ``parts``."""
    assert record.status == RunStatus.FAILED
    assert record.error is not None
    for part in parts:
        assert part in record.error, record.error


def test_a_malformed_body_fails_the_run_clearly_and_keeps_every_earlier_event(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    # Given turn 1 asks for a lookup, and turn 2's answer is an HTML page
    record, events = run_on_worker(ratchet, tmp_path, server, "malformed")

    # Then the run failed, saying what was wrong and where to look
    assert_failed_saying(record, "model call for turn 2 failed", "the body is not JSON", "base_url")
    # And nothing was lost: the log is contiguous and ends with the failure
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert record.last_seq == len(events)
    assert types_of(events) == [
        "run.created",
        "model.requested",
        "model.responded",
        "tool.requested",
        "tool.completed",
        "model.requested",
        "model.failed",
        "run.failed",
    ]
    # And turn 1's tool result is in the log, in the rebuilt transcript, and was sent to turn 2
    [completed] = [e for e in events if e.type == "tool.completed"]
    assert completed.data["result"]["status"] == "lost in transit"
    state = rebuild(events)
    assert state is not None and state.status == RunStatus.FAILED
    [tool_message] = [m for m in state.transcript if m.role == "tool"]
    assert tool_message.tool_call_id == LOOKUP_ID and "lost in transit" in tool_message.content
    sent = server.requests[1].body["messages"][-1]
    assert sent["role"] == "tool" and sent["tool_call_id"] == LOOKUP_ID
    assert "lost in transit" in sent["content"]


def test_a_401_fails_the_run_after_one_request_quoting_the_server(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    record, events = run_on_worker(ratchet, tmp_path, server, "unauthorized")

    assert len(server.requests) == 1
    assert_failed_saying(
        record, "HTTP 401", "Incorrect API key provided", f"check the key in {KEY_VAR}"
    )
    assert types_of(events) == ["run.created", "model.requested", "model.failed", "run.failed"]
    assert record.usage.model_attempts == 1 and record.usage.model_turns == 0


def test_a_response_without_usage_stops_a_run_whose_token_budget_cannot_then_be_enforced(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    record, events = run_on_worker(ratchet, tmp_path, server, "no-usage")

    assert_failed_saying(record, "`max_total_tokens` cannot be enforced")
    assert record.usage.responses_without_usage == 1
    # The run asked the model once and never again
    assert len(server.requests) == 1
    assert types_of(events).count("model.requested") == 1
    assert types_of(events)[-1] == "run.failed"


# --- the key stays out of everything a run leaves behind --------------------------------------


def needles(key: str) -> dict[str, bytes]:
    """The key as it could show up: raw, its random part, and base64 at every alignment."""
    raw = key.encode()
    found = {"key": raw, "key's random part": key.removeprefix("sk-test-").encode()}
    for pad in (b"", b"\0", b"\0\0"):
        total_bits = (len(pad) + len(raw)) * 8
        start, end = -(-len(pad) * 8 // 6), total_bits // 6  # characters of key bits only
        found[f"base64 (offset {len(pad)})"] = base64.b64encode(pad + raw)[start:end]
        found[f"urlsafe base64 (offset {len(pad)})"] = base64.urlsafe_b64encode(pad + raw)[
            start:end
        ]
    return found


def with_inflated(where: str, value: bytes) -> Iterator[tuple[str, bytes]]:
    """``value``, and every zlib stream inside it inflated (packed values, pages of a file)."""
    yield where, value
    offset = value.find(b"\x78")
    while offset != -1:
        if is_packed(value[offset : offset + 2]):
            try:
                inflated = zlib.decompressobj().decompress(value[offset:], 1 << 24)
            except zlib.error:
                inflated = b""
            if inflated:
                yield f"{where} (zlib stream at byte {offset})", inflated
        offset = value.find(b"\x78", offset + 1)


def assert_key_nowhere(key: str, blobs: list[tuple[str, bytes]]) -> None:
    assert blobs, "nothing was scanned"
    forms = needles(key)
    leaks = []
    for where, value in blobs:
        for place, data in with_inflated(where, value):
            leaks += [f"{form} in {place}" for form, needle in forms.items() if needle in data]
    assert leaks == [], "the API key leaked:\n" + "\n".join(leaks)


def redis_blobs(url: str) -> list[tuple[str, bytes]]:
    """Every key and value of one Redis database, as stored."""
    client: Any = redis.Redis.from_url(url)  # redis-py types every reply as a broad union
    blobs: list[tuple[str, bytes]] = []
    try:
        for name in client.scan_iter(count=1000):
            where = f"{url} {name!r}"
            blobs.append((f"{where} (name)", name))
            kind = client.type(name).decode()
            parts: list[bytes]
            if kind == "string":
                parts = [client.get(name) or b""]
            elif kind == "hash":
                parts = [b for pair in client.hgetall(name).items() for b in pair]
            elif kind == "list":
                parts = list(client.lrange(name, 0, -1))
            elif kind == "set":
                parts = list(client.smembers(name))
            elif kind == "zset":
                parts = [m for m, _ in client.zrange(name, 0, -1, withscores=True)]
            elif kind == "stream":
                parts = [
                    b for _, fields in client.xrange(name) for pair in fields.items() for b in pair
                ]
            else:
                raise AssertionError(f"{where}: a {kind} the scan cannot read")
            blobs += [(f"{where} ({kind})", part) for part in parts]
    finally:
        client.close()
    return blobs


def directory_blobs(directory: Path) -> list[tuple[str, bytes]]:
    """Every byte of every file under ``directory``, and every cell of its SQLite databases."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    blobs = [(str(p), p.read_bytes()) for p in files]
    for path in files:
        if path.read_bytes()[:16] != b"SQLite format 3\0":
            continue
        with sqlite3.connect(path) as db:
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for table in tables:
                for row in db.execute(f'SELECT * FROM "{table}"'):  # noqa: S608 - our own tables
                    for cell in row:
                        value = cell if isinstance(cell, bytes) else str(cell).encode()
                        blobs.append((f"{path} table {table}", value))
    return blobs


def cli_blobs(run_ids: list[str]) -> list[tuple[str, bytes]]:
    """What an operator sees, through the installed context: ``runs show`` / ``runs events``
    (table and JSON), ``runs list``, ``snapshots show``."""
    runner = CliRunner()
    commands = [["runs", "list", "--json"], ["runs", "list"]]
    for run_id in run_ids:
        commands += [
            ["runs", "show", run_id, "--json"],
            ["runs", "show", run_id],
            ["runs", "events", run_id, "--json"],
            ["runs", "events", run_id],
            ["snapshots", "show", run_id],
        ]
    outputs = []
    for args in commands:
        result = runner.invoke(cli, args, catch_exceptions=False)
        if args[0] == "runs":
            assert result.exit_code == 0, (args, result.output)
        outputs.append((" ".join(args), result.output.encode() + result.stderr_bytes))
    assert any(b"model.retrying" in output for _, output in outputs)
    return outputs


def queue_echoes_of_the_key(server: OpenAIServer, key: str) -> None:
    """A server that quotes the Authorization header back: in a 500, then in a body that is not
    JSON (the run fails quoting the body), then in a 401 (the run fails quoting the error)."""
    server.enqueue(500, {"error": {"message": f"upstream saw `Authorization: Bearer {key}`"}})
    server.enqueue(
        200, f"<html>Bearer {key} is not welcome here</html>", {"Content-Type": "text/html"}
    )
    server.enqueue(401, {"error": {"message": f"Incorrect API key provided: {key}."}})


def test_after_every_kind_of_run_the_key_is_nowhere_in_redis_the_logs_or_the_cli_output(
    ratchet: Ratchet,
    server: OpenAIServer,
    key: str,
    tmp_path: Path,
    redis_url: str,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    # Given every scenario above, run one after another on the worker
    # (each on a server of its own: a response a scenario leaves unasked stays there)
    run_ids: list[str] = []
    requests: list[RecordedRequest] = []
    for scenario, (*_, status) in SCENARIOS.items():
        with serve() as own:
            record, _ = run_on_worker(ratchet, tmp_path, own, scenario)
        assert record.status == status, (scenario, record.error)
        run_ids.append(record.run_id)
        requests += own.requests
    # And a server that echoes the key, in a retried 500, a non-JSON body and a 401
    queue_echoes_of_the_key(server, key)
    echo_agent = write_openai_agent(tmp_path / "echo", server, name="echo")
    for expected in ("[redacted] is not welcome", "Incorrect API key provided: [redacted]"):
        run_id = ratchet.start(echo_agent, "refund B2")
        record = ratchet.wait(run_id, timeout_s=WAIT_S)
        assert record.status == RunStatus.FAILED and expected in (record.error or ""), record
        run_ids.append(run_id)
    echoed = [e for e in ratchet.events(run_ids[-2]) if e.type == "model.retrying"]
    assert echoed and "Bearer [redacted]" in echoed[0].data["error"]
    # And a run left between turns, so a snapshot is stored too
    before = len(server.requests)
    server.enqueue(200, LOOKUP_B2)
    halfway = create_run(ratchet.ctx, echo_agent, "refund B2").run_id
    assert advance(ratchet.ctx, halfway, None).outcome == "next"
    assert len(server.requests) == before + 1
    assert ratchet.snapshot_document(halfway) is not None
    run_ids.append(halfway)

    # Then every request carried the key (the scan below looks for something real)
    requests += server.requests
    assert {r.headers["authorization"] for r in requests} == {f"Bearer {key}"}
    # And the worker's logs were captured, retries included, without the key
    assert "ratchet.providers.openai" in caplog.text and "retrying in" in caplog.text
    logs = [("caplog", caplog.text.encode())]
    logs += [("log record", repr(r.__dict__).encode()) for r in caplog.records]
    # And neither the test's Redis database, nor the broker's, nor the CLI shows it
    broker_url = f"{redis_server.url}/{BROKER_DB}"
    stored = redis_blobs(redis_url)
    assert any(halfway.encode() in value for _, value in stored)
    assert_key_nowhere(
        key,
        stored + redis_blobs(broker_url) + logs + cli_blobs(run_ids),
    )


def test_after_every_kind_of_run_the_key_is_nowhere_in_a_file_and_sqlite_data_dir(
    server: OpenAIServer,
    key: str,
    ledger: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    data = tmp_path / "data"
    ctx = Context(
        Settings(),
        open_snapshot_store(f"file://{data / 'snapshots'}"),
        open_run_store(f"sqlite://{data / 'runs.sqlite3'}"),
    )
    run_ids: list[str] = []
    requests: list[RecordedRequest] = []
    try:
        # Given every scenario, each on a server of its own, driven in-process as chained
        # turns would be
        for scenario, (queue, provider, budgets, status) in SCENARIOS.items():
            with serve() as own:
                queue(own)
                agent = write_openai_agent(
                    tmp_path / "agents", own, name=scenario, provider=provider, budgets=budgets
                )
                run_id = create_run(ctx, agent, "refund B2").run_id
                done = drive(ctx, run_id)
            assert done.outcome == status.value, (scenario, ctx.runs.get(run_id))
            run_ids.append(run_id)
            requests += own.requests
        # And the echoing server, and a run left between turns with its snapshot stored
        queue_echoes_of_the_key(server, key)
        server.enqueue(200, LOOKUP_B2)
        echo = write_openai_agent(tmp_path / "agents", server, name="echo")
        for _ in range(2):
            run_id = create_run(ctx, echo, "refund B2").run_id
            assert drive(ctx, run_id).outcome == "failed"
            run_ids.append(run_id)
        halfway = create_run(ctx, echo, "refund B2").run_id
        assert advance(ctx, halfway, None).outcome == "next"
        run_ids.append(halfway)
        set_context(ctx)
        shown = cli_blobs(run_ids)
    finally:
        set_context(None)
        ctx.close()

    # Then every byte of the data directory (the snapshot file, the SQLite database) is clean
    on_disk = directory_blobs(data)
    assert any(p.endswith(".head") for p, _ in on_disk), "the halfway run has no snapshot head"
    assert any(p.endswith(".transcript") for p, _ in on_disk), "nor a transcript"
    assert any(halfway.encode() in value for _, value in on_disk)
    requests += server.requests
    assert {r.headers["authorization"] for r in requests} == {f"Bearer {key}"}
    assert "retrying in" in caplog.text
    logs = [("caplog", caplog.text.encode())]
    assert_key_nowhere(key, on_disk + shown + logs)


def test_a_provider_still_failing_after_its_retries_stalls_the_run_for_a_resume(
    ratchet: Ratchet, server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    # Given a model server that answers 500 to every attempt of turn 1
    server.enqueue_fixture("server_error")
    server.enqueue_fixture("server_error")
    agent = write_openai_agent(tmp_path, server, provider={"max_attempts": 2})
    run_id = ratchet.start(agent, "My toaster never arrived (order B2). Can I get a refund?")
    # When the provider gives up, the run is parked, not ended
    record = ratchet.wait(run_id, timeout_s=WAIT_S)
    assert record.status == RunStatus.STALLED
    assert record.error is not None and f"ratchet runs resume {run_id}" in record.error
    assert types_of(ratchet.events(run_id))[-2:] == ["model.failed", "run.stalled"]
    # And once the server is back, a resume completes it
    server.enqueue_fixture("text_answer")
    ratchet.resume(run_id)
    deadline = time.monotonic() + WAIT_S
    while ratchet.get(run_id).status == RunStatus.STALLED and time.monotonic() < deadline:
        time.sleep(0.05)
    record = ratchet.wait(run_id, timeout_s=WAIT_S)
    assert record.status == RunStatus.COMPLETED
    assert len(server.requests) == 3


def test_a_provider_outage_ends_its_turn_with_the_outcome_stalled_not_idle(
    server: OpenAIServer, key: str, tmp_path: Path
) -> None:
    # Given a model server that answers 500 to both attempts the provider makes
    server.enqueue_fixture("server_error")
    server.enqueue_fixture("server_error")
    agent = write_openai_agent(tmp_path, server, provider={"max_attempts": 2})
    ctx = memory_context()
    run_id = create_run(ctx, agent, "My toaster never arrived (order B2).").run_id
    # When a turn calls the model and the provider gives up
    done = advance(ctx, run_id, None)
    # Then the turn's outcome (the label of ratchet_turns_total) says the run stalled:
    # counted as idle, an outage would look like a turn that found nothing to do
    assert str(done.outcome) == "stalled"
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.STALLED
