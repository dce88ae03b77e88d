"""What a model or a tool hands back is checked where it crosses into ratchet (issue 30).

On a real Celery worker with Redis stores: lone surrogates from an OpenAI-compatible
server (tests/openai_server.py) and from a tool, a 40 MiB and a ``10**5000`` tool result
(tests/hostile_tools.py). Before the check each of them committed an event that could not
be saved or folded, and the run was resumed — the tool run again, the model asked again —
until it was dead-lettered. Now each run ends by itself, each tool ran once (its ledger
says so), the log folds, and ``ratchet runs show`` / ``runs events`` print it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from runtime.fsm import rebuild
from runtime.models import Event, RunStatus
from store.runs import RunRecord
from tasks.context import Context
from tests.helpers import call, turn, write_agent
from tests.openai_server import OpenAIServer, load_fixture, serve
from tests.workers import ROOT, WorkerProcesses, redis_context, wait_for
from worker.api import Ratchet

pytestmark = pytest.mark.timeout(120)

KEY_VAR = "HOSTILE_OUTPUTS_TEST_API_KEY"
WAIT_S = 60.0
MAX_OUTPUT_BYTES = 1024 * 1024
"""The documented bound on a result or a model's text (runtime/json_values.py; docs/tools.md)."""


def finished(ratchet: Ratchet, run_id: str) -> tuple[RunRecord, list[Event]]:
    """The run once it stops moving by itself, and its events, which must fold."""
    record = ratchet.wait(run_id, timeout_s=WAIT_S)
    assert not record.status.is_live, f"run {run_id} is still {record.status.value}"
    events = ratchet.events(run_id)
    state = rebuild(events)
    assert state is not None and state.status == record.status
    return record, events


def booked(ledger: Path) -> list[str]:
    return ledger.read_text().splitlines() if ledger.exists() else []


def cli(redis_url: str, *args: str) -> str:
    """``ratchet ARGS`` in a process of its own, on the test's stores; its stdout. It must exit 0
    and write nothing to stderr (a traceback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_RUN_STORE=redis_url,
        RATCHET_SNAPSHOT_STORE=redis_url,
        RATCHET_BROKER_URL=redis_url,
        PYTHONPATH=str(ROOT),
    )
    done = subprocess.run(
        [sys.executable, "-m", "worker", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stderr, (args, done)
    return done.stdout.decode("utf-8")


def shown_by_the_cli(redis_url: str, run_id: str) -> tuple[str, dict[str, Any], list[str]]:
    """What `runs show`, `runs show --json` and `runs events` print for the run."""
    text = cli(redis_url, "runs", "show", run_id)
    document = json.loads(cli(redis_url, "runs", "show", run_id, "--json"))
    lines = cli(redis_url, "runs", "events", run_id).splitlines()
    return text, document, lines


def types_of(events: list[Event]) -> list[str]:
    return [e.type for e in events]


# --- from a tool ---------------------------------------------------------------------------


def tool_agent(directory: Path, tool: str, **arguments: Any) -> Path:
    return write_agent(
        directory,
        [turn("asking", call(tool, **arguments)), turn("Done.")],
        tools=[f"tests.hostile_tools:{tool}"],
    )


def test_a_tool_result_with_lone_surrogates_is_stored_with_u_fffd_and_the_tool_runs_once(
    ratchet: Ratchet, ledger: Path, redis_url: str, tmp_path: Path
) -> None:
    # Given a tool whose result holds lone surrogates
    agent = tool_agent(tmp_path, "partial_emoji", order_id="A1")
    # When a run calls it on the worker
    record, events = finished(ratchet, ratchet.start(agent, "look A1 up"))
    # Then the run completed, the tool ran once, and its result reads with U+FFFD
    assert record.status == RunStatus.COMPLETED, record.error
    assert booked(ledger) == ["partial_emoji"]
    [completed] = [e for e in events if e.type == "tool.completed"]
    assert completed.data["result"] == {
        "order_id": "\ufffd",
        "note": "partial emoji \ufffd",
        "asked": ["A1", "\ufffd"],
    }
    # And the CLI prints the run and its log
    text, document, lines = shown_by_the_cli(redis_url, record.run_id)
    assert "status     completed" in text and document["status"] == "completed"
    assert any("partial emoji \ufffd" in line for line in lines)


def test_a_forty_mib_tool_result_is_an_error_result_the_model_reads_and_the_tool_runs_once(
    ratchet: Ratchet, ledger: Path, redis_url: str, tmp_path: Path
) -> None:
    agent = tool_agent(tmp_path, "forty_mib")
    record, events = finished(ratchet, ratchet.start(agent, "fetch it"))
    # The tool ran once; its result did not fit, and the model was told so
    assert record.status == RunStatus.COMPLETED, record.error
    assert booked(ledger) == ["forty_mib"]
    assert types_of(events).count("tool.requested") == 1
    [failed] = [e for e in events if e.type == "tool.failed"]
    assert failed.data["error"].startswith("`forty_mib` ran, but its result is 41943042 bytes")
    assert f"over the {MAX_OUTPUT_BYTES}-byte limit" in failed.data["error"]
    assert "tool.completed" not in types_of(events)
    text, document, _ = shown_by_the_cli(redis_url, record.run_id)
    assert document["usage"]["tool_calls"] == 1 and "tool calls 1 of" in text


def test_a_result_of_ten_to_the_5000_is_an_error_result_and_the_log_still_folds(
    ratchet: Ratchet, ledger: Path, redis_url: str, tmp_path: Path
) -> None:
    agent = tool_agent(tmp_path, "googol_power")
    record, events = finished(ratchet, ratchet.start(agent, "compute it"))
    assert record.status == RunStatus.COMPLETED, record.error
    assert booked(ledger) == ["googol_power"]
    [failed] = [e for e in events if e.type == "tool.failed"]
    assert "holds an integer of about 5000 digits, over 4300" in failed.data["error"]
    _, _, lines = shown_by_the_cli(redis_url, record.run_id)
    assert any("tool.failed" in line and "googol_power" in line for line in lines)


# --- from the model ------------------------------------------------------------------------


@pytest.fixture
def server() -> Any:
    with serve() as running:
        yield running


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    """The agent's API key, in our environment: the session worker runs in this process."""
    secret = f"sk-test-{uuid.uuid4().hex}"
    monkeypatch.setenv(KEY_VAR, secret)
    return secret


def openai_agent(directory: Path, server: OpenAIServer) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "surrogates.toml"
    path.write_text(
        "\n".join(
            [
                'name = "surrogates"',
                'model = "openai:gpt-test"',
                'system = "You look orders up."',
                'tools = ["tests.hostile_tools:booked"]',
                "[provider]",
                f'base_url = "{server.url}"',
                f'api_key_env = "{KEY_VAR}"',
                "timeout_s = 5",
                "max_retry_s = 5",
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    return path


def completion(content: str | None, *calls: tuple[str, str]) -> str:
    """A chat completion as the server's bytes: ``json.dumps`` writes a lone surrogate as the
    escape ``\\ud83d``, as a server that cut a UTF-16 pair in two sends it."""
    body: dict[str, Any] = copy.deepcopy(load_fixture("text_answer")["response"]["body"])
    message = body["choices"][0]["message"]
    message["content"] = content
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": "booked", "arguments": a}}
            for i, (_, a) in enumerate(calls)
        ]
    return json.dumps(body)


def test_lone_surrogates_from_the_model_are_replaced_in_its_text_and_refused_in_arguments(
    ratchet: Ratchet,
    server: OpenAIServer,
    key: str,
    ledger: Path,
    redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a model whose text ends in half an emoji, and which asks for one call whose
    # arguments hold a lone surrogate and one whose arguments are fine
    server.enqueue(
        200,
        completion(
            "partial emoji \ud83d",
            ("bad", json.dumps({"order_id": "\ud800"})),
            ("good", json.dumps({"order_id": "B2"})),
        ),
    )
    server.enqueue(200, completion("Done \ud83d"))
    # When a run of it goes through the worker
    record, events = finished(ratchet, ratchet.start(openai_agent(tmp_path, server), "look up"))
    # Then it completed after two model calls — none asked again — with its text as U+FFFD
    assert record.status == RunStatus.COMPLETED, record.error
    assert len(server.requests) == 2
    assert record.output == "Done \ufffd"
    [responded, _] = [e.data for e in events if e.type == "model.responded"]
    assert responded["content"] == "partial emoji \ufffd"
    # And the call with the lone surrogate did not run: the model read why; the other ran once
    assert booked(ledger) == ["booked B2"]
    [refused] = [e.data for e in events if e.type == "tool.failed"]
    assert refused["call_id"] == "call_0"
    assert "holds a lone surrogate (\\ud800)" in refused["error"]
    assert "the tool did not run" in refused["error"]
    sent = server.requests[1].body["messages"]
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == ["call_0", "call_1"]
    # And the CLI prints it
    text, document, lines = shown_by_the_cli(redis_url, record.run_id)
    assert "output     Done \ufffd" in text and document["output"] == "Done \ufffd"
    assert any("model.responded" in line and "partial emoji \ufffd" in line for line in lines)


def test_a_model_answer_over_the_limit_fails_the_run_cleanly_after_one_request(
    ratchet: Ratchet, server: OpenAIServer, key: str, redis_url: str, tmp_path: Path
) -> None:
    server.enqueue(200, completion("y" * (MAX_OUTPUT_BYTES + 1)))
    record, events = finished(ratchet, ratchet.start(openai_agent(tmp_path, server), "say a lot"))
    assert record.status == RunStatus.FAILED
    assert record.error is not None
    assert f"the model's answer is {MAX_OUTPUT_BYTES + 1} bytes" in record.error
    assert len(server.requests) == 1
    assert types_of(events)[-2:] == ["model.failed", "run.failed"]
    text, _, _ = shown_by_the_cli(redis_url, record.run_id)
    assert "status     failed" in text


# --- on `celery -A worker worker` processes, as an operator runs them ---------------------


def test_on_a_worker_process_each_hostile_result_ends_its_run_with_the_tool_run_once(
    worker_processes: WorkerProcesses, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    # Given a prefork worker process with its stores on Redis, and one run per hostile tool,
    # started by the CLI in a process of its own
    worker = worker_processes.start("--concurrency", "2")
    ctx = redis_context(redis_url)
    try:
        run_ids = {}
        for tool in ("partial_emoji", "forty_mib", "googol_power"):
            arguments = {"order_id": "A1"} if tool == "partial_emoji" else {}
            agent = tool_agent(tmp_path / tool, tool, **arguments)
            started = cli(redis_url, "runs", "start", str(agent), "--input", "go", "--json")
            run_ids[tool] = json.loads(started)["run_id"]
        # When the worker has taken them, each ends by itself: completed, its tool run once
        for tool, run_id in run_ids.items():
            wait_for(f"run {run_id} ({tool}) to finish", partial(finished_on, ctx, run_id))
            record = ctx.runs.get(run_id)
            assert record is not None and record.status == RunStatus.COMPLETED, worker.log()
            assert rebuild(ctx.runs.events(run_id)) is not None
            assert cli(redis_url, "runs", "show", run_id).startswith(f"run        {run_id}")
        assert sorted(booked(ledger)) == ["forty_mib", "googol_power", "partial_emoji"]
        assert "Traceback" not in worker.log()
    finally:
        ctx.close()


def finished_on(ctx: Context, run_id: str) -> bool:
    record = ctx.runs.get(run_id)
    return record is not None and not record.status.is_live
