"""MCP servers as durable tools, against real servers built with the ``mcp`` SDK.

The server is ``tests/mcp_servers.py`` (stdio, started by each worker process that
calls it, or streamable HTTP on a port of this test's): its ledger records every call
with the ``_meta`` idempotency key it carried and the server's pid. The runs go
through real Celery workers: the in-process session worker, ``celery -A worker worker``
subprocesses on each pool, and the crash rig of tests/crash/test_failpoints.py, whose
dying worker is SIGKILLed mid-call.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from runtime.errors import BindingChanged
from runtime.models import RunStatus
from runtime.probes import idempotency_key
from runtime_io.mcp import parse_servers
from store.runs import RunRecord
from tasks.recovery import sweep_orphans
from tasks.settings import Settings
from tasks.start import create_run
from tests.crash.test_failpoints import Rig, rig
from tests.helpers import call, turn, write_agent
from tests.workers import (
    WorkerProcess,
    WorkerProcesses,
    redis_context,
    run_on_workers,
    sending_to,
    wait_for,
)
from worker.api import Ratchet
from worker.app import make_app
from worker.cli import main as cli_main

__all__ = ["rig"]  # the crash rig's module-scoped fixture

pytestmark = pytest.mark.timeout(120)

SERVER = Path(__file__).parent / "mcp_servers.py"


def ledger_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def calls_of(path: Path, tool: str) -> list[dict[str, Any]]:
    return [line for line in ledger_lines(path) if line.get("tool") == tool]


def stdio_table(name: str, ledger: Path, hold: Path | None = None, schema: str = "1") -> str:
    argv = [sys.executable, str(SERVER), "stdio", "--ledger", str(ledger), "--schema", schema]
    if hold is not None:
        argv += ["--hold", str(hold)]
    return f"[mcp.{name}]\ncommand = {json.dumps(argv)}\n"


@dataclass
class HttpServer:
    port: int
    ledger: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self, *extra: str) -> HttpServer:
        argv = [sys.executable, str(SERVER), "http", str(self.port), "--ledger", str(self.ledger)]
        self.process = subprocess.Popen(
            [*argv, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(f"the MCP server on port {self.port} listens", self._listening, timeout_s=60)
        return self

    def _listening(self) -> bool:
        assert self.process is not None and self.process.poll() is None, "the MCP server exited"
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def table(self, name: str) -> str:
        return f'[mcp.{name}]\nurl = "{self.url}"\n'


def pending(ratchet: Ratchet, run_id: str) -> int:
    """The seq of what the run waits for, as an answer names it."""
    suspension = ratchet.suspension(run_id)
    assert suspension is not None, f"run {run_id} waits for nothing"
    return suspension.seq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ASK_BETWEEN_REFUNDS = [
    turn("Refunding.", call("issue_refund", order_id="A1", amount_cents=1)),
    turn("Asking.", call("request_user_input", prompt="Refund B2 too?")),
    turn("Refunding.", call("issue_refund", order_id="B2", amount_cents=2)),
    turn("Done."),
]
"""A script that refunds A1 through ``billing``'s ``issue_refund``, asks a person, then
refunds B2 the same way."""


def asks_between_refunds(tmp_path: Path, table: str) -> Path:
    """An agent of :data:`ASK_BETWEEN_REFUNDS`, its ``billing`` server the MCP ``table``."""
    return write_agent(
        tmp_path,
        ASK_BETWEEN_REFUNDS,
        tools=["mcp:billing/issue_refund", "request_user_input"],
        extra=table,
    )


def start_asking(api: Ratchet, agent: Path, text: str) -> str:
    """Start a run of ``agent`` and wait until it asks a person; its run id."""
    run_id = api.start(agent, text)
    wait_for(
        "the run asks",
        lambda: api.get(run_id).status == RunStatus.NEEDS_USER_INPUT,
        timeout_s=60,
    )
    return run_id


def stalled_by_its_server_down(api: Ratchet, run_id: str, server: HttpServer) -> RunRecord:
    """Stop ``server`` and answer the run's question: the run stalls, with one line naming
    the server ``billing``; its record."""
    server.stop()
    api.continue_run(run_id, input="yes", suspension_seq=pending(api, run_id))
    record = api.wait(run_id, timeout_s=60)
    assert record.status == RunStatus.STALLED, record
    assert record.error is not None and "\n" not in record.error
    assert "MCP server `billing`" in record.error, record.error
    return record


def resumed_with_server_back(api: Ratchet, run_id: str, server: HttpServer) -> RunRecord:
    """Start ``server`` again, resume the stalled run, and wait until it stops running."""
    server.start()
    _, resumed = api.resume_and_wait(run_id, timeout_s=60)
    assert resumed is not None, "no worker took the resume"
    return api.wait(run_id, timeout_s=60)


def refused_by_a_fresh_listing(redis_url: str, act: Callable[[Ratchet], object]) -> str:
    """What ``act`` raises, as :class:`BindingChanged`, through an API of a process that
    lists MCP tools again at once."""
    with closing(redis_context(redis_url, mcp_relist_s=0)) as fresh:
        with pytest.raises(BindingChanged) as refused:
            act(Ratchet(fresh))
    return str(refused.value)


def looks_up_and_refunds_at_once(
    tmp_path: Path, ledger: Path, http: HttpServer, content: str, cents: int, answer: str
) -> Path:
    """An agent whose model, saying ``content``, looks B2 up on the HTTP server (``remote``)
    and refunds it ``cents`` on a stdio one (``billing``, its ledger at ``ledger``) at once,
    then answers ``answer``."""
    both = turn(
        content,
        call("lookup_order", order_id="B2"),
        call("issue_refund", order_id="B2", amount_cents=cents),
    )
    return write_agent(
        tmp_path,
        [both, turn(answer)],
        tools=["mcp:remote/lookup_order", "mcp:billing/issue_refund"],
        extra=stdio_table("billing", ledger) + http.table("remote"),
    )


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[HttpServer]:
    server = HttpServer(free_port(), tmp_path / "http.ledger").start()
    try:
        yield server
    finally:
        server.stop()


# --- the agent file ---------------------------------------------------------------------


def test_a_server_table_is_checked_at_load_in_one_line_naming_the_key() -> None:
    cases = {
        "neither": ({"billing": {}}, "exactly one of `command`"),
        "both": ({"billing": {"command": ["x"], "url": "https://h/mcp"}}, "exactly one"),
        "plain http": ({"b": {"url": "http://192.0.2.7/mcp"}}, "plain http to 192.0.2.7"),
        "variable": ({"b": {"command": ["x"], "env": ["AWS_SECRET_ACCESS_KEY"]}}, "does not allow"),
        "header variable": (
            {"b": {"url": "https://h/mcp", "headers": {"Authorization": "Bearer ${HOME}"}}},
            "RATCHET_MCP_VARIABLES",
        ),
        "unknown key": ({"b": {"command": ["x"], "shell": True}}, "unknown key"),
    }
    for name, (raw, expected) in cases.items():
        with pytest.raises(ValueError) as refused:
            parse_servers(raw)
        message = str(refused.value)
        assert expected in message and "\n" not in message, (name, message)
        assert not message.startswith("Value error"), message


def test_a_missing_tool_or_server_is_refused_naming_the_reference(tmp_path: Path) -> None:
    from runtime.errors import AgentFileError
    from runtime_io.agent_files import load_agent

    ledger = tmp_path / "ledger"
    agent = write_agent(
        tmp_path,
        [turn("Done.")],
        tools=["mcp:billing/no_such_tool"],
        extra=stdio_table("billing", ledger),
    )
    with pytest.raises(AgentFileError, match="lists no tool `no_such_tool`.*lookup_order"):
        load_agent(agent)
    other = write_agent(tmp_path / "b", [turn("Done.")], tools=["mcp:nowhere/lookup_order"])
    with pytest.raises(AgentFileError, match=r"no `\[mcp.nowhere\]` table"):
        load_agent(other)


def test_a_tool_both_waived_and_required_to_await_approval_is_refused_at_load(
    tmp_path: Path,
) -> None:
    from runtime.errors import AgentFileError
    from runtime_io.agent_files import load_agent

    # Given a file whose MCP table says a tool runs without approval, and whose [policy]
    # lists it as awaiting one
    waived = "[mcp.billing.tools.issue_refund]\napproval = false\n"
    agent = write_agent(
        tmp_path,
        [turn("Done.")],
        tools=["mcp:billing/issue_refund"],
        require_approval=["issue_refund"],
        extra=stdio_table("billing", tmp_path / "ledger") + waived,
    )
    # Then it is refused in one line naming both, instead of one silently winning
    with pytest.raises(AgentFileError, match=r"approval = false` says it runs without one"):
        load_agent(agent)


def test_a_listed_tool_is_checked_before_it_reaches_the_binding(tmp_path: Path) -> None:
    from mcp_types import Tool

    from runtime.errors import ToolError
    from runtime_io.mcp import Server
    from runtime_io.mcp.tools import MAX_SCHEMA_BYTES, _declared

    server = Server("billing", parse_servers({"billing": {"command": ["x"]}})["billing"], tmp_path)
    schema, text = _declared(server, Tool(name="ok", description="Fine \ud83d", input_schema={}))
    assert text == "Fine \ufffd" and schema == {"type": "object", "properties": {}}
    hostile = {
        "name": Tool(name="no spaces/allowed", input_schema={"type": "object"}),
        "surrogate": Tool(name="t", input_schema={"type": "object", "description": "\ud800"}),
        "huge int": Tool(name="t", input_schema={"type": "object", "maximum": 10**5000}),
        "too big": Tool(name="t", input_schema={"type": "object", "d": "x" * MAX_SCHEMA_BYTES}),
        "not an object": Tool(name="t", input_schema={"type": "string"}),
    }
    for what, tool in hostile.items():
        with pytest.raises(ToolError) as refused:
            _declared(server, tool)
        assert "MCP server `billing`" in str(refused.value), what


# --- runs on the session worker ---------------------------------------------------------


def test_a_run_calls_tools_on_a_stdio_and_an_http_server_and_completes(
    ratchet: Ratchet, http_server: HttpServer, tmp_path: Path
) -> None:
    # Given an agent with a stdio server and an HTTP one, and a model that calls both at once
    ledger = tmp_path / "stdio.ledger"
    agent = looks_up_and_refunds_at_once(
        tmp_path, ledger, http_server, "Looking up and refunding.", 2900, "Refunded."
    )
    # When the run goes through the worker
    run_id = ratchet.start(agent, "refund B2")
    record = ratchet.wait(run_id, timeout_s=60)

    # Then it completed with each tool's result, each server called once
    assert record.status == RunStatus.COMPLETED, record.error
    results = {
        e.data["name"]: e.data["result"]
        for e in ratchet.events(run_id)
        if e.type == "tool.completed"
    }
    assert results["lookup_order"]["status"] == "lost in transit"
    assert results["issue_refund"] == {"result": "refunded 2900 on B2"}
    # And each call carried its idempotency key in `_meta`
    (refund,) = calls_of(ledger, "issue_refund")
    (lookup,) = calls_of(http_server.ledger, "lookup_order")
    assert refund["key"] == idempotency_key(run_id, 1, "call_1_2")
    assert lookup["key"] == idempotency_key(run_id, 1, "call_1_1")


def test_runs_show_says_where_each_mcp_tools_policy_came_from(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    # Given an agent of all a server's tools, one of them overridden by the agent file and
    # one that its `[policy]` asks approval for
    ledger = tmp_path / "stdio.ledger"
    override = "[mcp.billing.tools.always_fails]\nidempotent = true\n"
    agent = write_agent(
        tmp_path,
        [turn("Nothing to do.")],
        tools=["mcp:billing/*"],
        require_approval=["issue_refund"],
        extra=stdio_table("billing", ledger) + override,
    )
    run_id = ratchet.start(agent, "look")
    assert ratchet.wait(run_id, timeout_s=60).status == RunStatus.COMPLETED
    # When an operator shows the run
    shown = CliRunner().invoke(cli_main, ["runs", "show", run_id])
    as_json = CliRunner().invoke(cli_main, ["runs", "show", run_id, "--json"])
    # Then each MCP tool's line says what a crash or a call does to it, and who said so
    assert shown.exit_code == 0, shown.output
    lines = {line.split()[2]: line for line in shown.output.splitlines() if line.startswith("mcp")}
    assert "runs again after a crash (readOnlyHint)" in lines["lookup_order"]
    assert "parks if cut short (default (unannotated" in lines["issue_refund"]
    assert "awaits approval ([policy] require_approval)" in lines["issue_refund"]
    assert "awaits approval (destructiveHint)" in lines["wipe_account"]
    assert "runs again after a crash (agent file)" in lines["always_fails"]
    policies = {p["tool"]: p for p in json.loads(as_json.output)["mcp_tools"]}
    assert policies["wipe_account"] == {
        "tool": "wipe_account",
        "server": "billing",
        "idempotent": False,
        "idempotent_from": "default (unannotated: not idempotent)",
        "approval": True,
        "approval_from": "destructiveHint",
    }
    assert policies["always_fails"]["idempotent_from"] == "agent file"


def test_a_destructive_tool_awaits_approval_and_an_error_result_reaches_the_model(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    ledger = tmp_path / "stdio.ledger"
    agent = write_agent(
        tmp_path,
        [
            turn("Trying.", call("always_fails")),
            turn("Wiping.", call("wipe_account", account="acme")),
            turn("Wiped."),
        ],
        tools=["mcp:billing/*"],
        extra=stdio_table("billing", ledger),
    )
    run_id = ratchet.start(agent, "wipe acme")
    wait_for(
        "the run awaits approval",
        lambda: ratchet.get(run_id).status == RunStatus.AWAITING_APPROVAL,
        timeout_s=60,
    )
    events = ratchet.events(run_id)
    failed = [e.data for e in events if e.type == "tool.failed"]
    assert [f["name"] for f in failed] == ["always_fails"]
    # The server's isError text, not a traceback of ours
    assert "always_fails" in failed[0]["error"]
    assert calls_of(ledger, "wipe_account") == []
    # And approved, it runs once
    ratchet.continue_run(run_id, approve=True, suspension_seq=pending(ratchet, run_id))
    assert ratchet.wait(run_id, timeout_s=60).status == RunStatus.COMPLETED
    assert len(calls_of(ledger, "wipe_account")) == 1


def test_a_stdio_server_killed_between_turns_is_started_again_for_the_next_call(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    # Given a run that called the server, then waits for a person
    ledger = tmp_path / "stdio.ledger"
    agent = asks_between_refunds(tmp_path, stdio_table("billing", ledger))
    run_id = start_asking(ratchet, agent, "refunds")
    (first,) = calls_of(ledger, "issue_refund")
    # When the server dies while the run waits
    os.kill(first["pid"], signal.SIGKILL)
    # Then the answer's turn starts a new server and the call goes through once
    ratchet.continue_run(run_id, input="yes", suspension_seq=pending(ratchet, run_id))
    record = ratchet.wait(run_id, timeout_s=60)
    assert record.status == RunStatus.COMPLETED, record.error
    calls = calls_of(ledger, "issue_refund")
    assert [c["order_id"] for c in calls] == ["A1", "B2"]
    assert calls[1]["pid"] != first["pid"]


def test_a_server_that_stays_down_stalls_the_run_naming_it_and_a_resume_sends_the_call(
    ratchet: Ratchet, http_server: HttpServer, tmp_path: Path
) -> None:
    # Given a run that called an HTTP server's tool, then waits for a person
    agent = asks_between_refunds(tmp_path, http_server.table("billing"))
    run_id = start_asking(ratchet, agent, "refunds")
    # When the server goes down and stays down, and the person answers
    # Then the run stalls with one line naming the server, not an error result to the model
    record = stalled_by_its_server_down(ratchet, run_id, http_server)
    assert record.error is not None and "Traceback" not in record.error
    events = ratchet.events(run_id)
    refunds = [e for e in events if e.data.get("name") == "issue_refund"]
    assert [e.type for e in refunds] == [
        "tool.requested",
        "tool.completed",
        "tool.requested",
        "tool.unsent",
    ]
    assert [c["order_id"] for c in calls_of(http_server.ledger, "issue_refund")] == ["A1"]
    # And once the server is back, a resume sends the call (it did not run: no park)
    record = resumed_with_server_back(ratchet, run_id, http_server)
    assert record.status == RunStatus.COMPLETED, record.error
    assert [c["order_id"] for c in calls_of(http_server.ledger, "issue_refund")] == ["A1", "B2"]


def test_a_worker_that_cannot_list_a_down_servers_tools_stalls_the_run_naming_it(
    worker_processes: WorkerProcesses, http_server: HttpServer, redis_url: str, tmp_path: Path
) -> None:
    # Given a worker that lists MCP tools again at every load, and a run that waits for a
    # person after calling an HTTP server's tool
    worker_processes.start("--pool", "threads", "--concurrency", "2", RATCHET_MCP_RELIST_S="0")
    agent = asks_between_refunds(tmp_path, http_server.table("billing"))
    # (this process keeps its listing)
    with sending_to(redis_url), closing(redis_context(redis_url, mcp_relist_s=3600)) as ctx:
        api = Ratchet(ctx)
        run_id = start_asking(api, agent, "refunds")
        # When the server goes down and the answer's turn loads the agent
        # Then the run stalls at once, with one line naming the server
        record = stalled_by_its_server_down(api, run_id, http_server)
        assert record.error is not None and f"ratchet runs resume {run_id}" in record.error
        assert [c["order_id"] for c in calls_of(http_server.ledger, "issue_refund")] == ["A1"]
        # And with the server back, a resume finishes it, B2 refunded once
        assert resumed_with_server_back(api, run_id, http_server).status == RunStatus.COMPLETED
        calls = calls_of(http_server.ledger, "issue_refund")
        assert [c["order_id"] for c in calls] == ["A1", "B2"]


def test_a_changed_tool_schema_refuses_the_answer_naming_the_tool(
    ratchet: Ratchet, http_server: HttpServer, redis_url: str, tmp_path: Path
) -> None:
    # Given a run of an HTTP server's tools, waiting for a person
    agent = write_agent(
        tmp_path,
        [turn("Asking.", call("request_user_input", prompt="Refund?")), turn("Done.")],
        tools=["mcp:remote/issue_refund", "mcp:remote/lookup_order", "request_user_input"],
        extra=http_server.table("remote"),
    )
    run_id = start_asking(ratchet, agent, "refund")
    # When the server comes back with `issue_refund` taking another parameter
    http_server.stop()
    http_server.start("--schema", "2")
    # Then an answer (from a process that lists the tools again at once) is refused,
    # naming that tool and only it
    seq = pending(ratchet, run_id)
    refused = refused_by_a_fresh_listing(
        redis_url, lambda api: api.continue_run(run_id, input="yes", suspension_seq=seq)
    )
    assert "`issue_refund`" in refused and "lookup_order" not in refused


def test_a_stalled_run_whose_servers_tool_changed_is_refused_a_resume_naming_the_tool(
    ratchet: Ratchet, http_server: HttpServer, redis_url: str, tmp_path: Path
) -> None:
    # Given a run stalled because its HTTP server was down when a call was sent
    agent = write_agent(
        tmp_path,
        [
            turn("Asking.", call("request_user_input", prompt="Refund B2?")),
            turn("Refunding.", call("issue_refund", order_id="B2", amount_cents=2)),
            turn("Done."),
        ],
        tools=["mcp:remote/issue_refund", "mcp:remote/lookup_order", "request_user_input"],
        extra=http_server.table("remote"),
    )
    run_id = start_asking(ratchet, agent, "refund")
    http_server.stop()
    ratchet.continue_run(run_id, input="yes", suspension_seq=pending(ratchet, run_id))
    assert ratchet.wait(run_id, timeout_s=60).status == RunStatus.STALLED
    # When the server comes back with `issue_refund` taking another parameter
    http_server.start("--schema", "2")
    # Then a resume (from a process that lists the tools again at once) is refused, naming
    # that tool and only it, and the call was never sent
    refused = refused_by_a_fresh_listing(redis_url, lambda api: api.resume(run_id))
    assert "`issue_refund`" in refused and "lookup_order" not in refused
    assert calls_of(http_server.ledger, "issue_refund") == []
    assert ratchet.get(run_id).status == RunStatus.STALLED


def test_the_example_mcp_agent_refunds_through_its_server(
    ratchet: Ratchet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_MCP_BILLING_DB", str(tmp_path / "billing.sqlite3"))
    example = Path(__file__).parents[1] / "examples" / "mcp-desk.toml"
    run_id = ratchet.start(example, "My toaster (order B2) never came.")
    record = ratchet.wait(run_id, timeout_s=90)
    assert record.status == RunStatus.COMPLETED, record.error
    results = [e.data["result"] for e in ratchet.events(run_id) if e.type == "tool.completed"]
    assert results[1] == {"result": "refunded 2900 on B2"}


def test_the_example_servers_refund_is_booked_once_per_key_whichever_process_gets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime.probes import ToolContext
    from runtime_io.mcp import Server
    from runtime_io.mcp.tools import specs

    # Given the example's server started twice (as a worker and its successor after a
    # crash would: two tables are two sessions, each its own process), one refund database
    database = tmp_path / "billing.sqlite3"
    monkeypatch.setenv("RATCHET_MCP_BILLING_DB", str(database))
    examples = Path(__file__).parents[1] / "examples"
    context = ToolContext("run-1", "call_1_1", idempotency_key("run-1", 1, "call_1_1"))
    results = []
    for connect_timeout_s in (28, 29):  # not the example's own table: not its session
        table = {
            "command": ["python", "billing_mcp.py"],
            "env": ["RATCHET_MCP_BILLING_DB"],
            "connect_timeout_s": connect_timeout_s,
        }
        server = Server("billing", parse_servers({"billing": table})["billing"], examples)
        ((refund, _),) = specs(server, "issue_refund", 30)
        assert refund.remote is not None
        # When each is sent the same call, with the same idempotency key
        results.append(refund.remote({"order_id": "B2", "amount_cents": 2900}, context))
    # Then both answer the refund, and it was booked once
    assert results == [{"result": "refunded 2900 on B2"}] * 2
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT key FROM refunds").fetchall() == [(context.idempotency_key,)]


# --- a worker SIGKILLed mid-call --------------------------------------------------------

MCP_DYING_DB, MCP_HEALTHY_DB = 3, 4
"""Broker databases of the crash rig's redis-server that its own workers leave alone."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("tool", "arguments", "status"),
    [
        ("lookup_order", {"order_id": "B2"}, RunStatus.COMPLETED),
        ("issue_refund", {"order_id": "B2", "amount_cents": 2900}, RunStatus.NEEDS_RECONCILIATION),
    ],
    ids=["read-only-runs-again", "unannotated-parks"],
)
def test_a_call_cut_off_by_a_sigkill_runs_again_only_when_the_server_says_it_may(
    rig: Rig, tmp_path: Path, tool: str, arguments: dict[str, Any], status: RunStatus
) -> None:
    # Given a stdio server whose call waits while the hold file exists, and two workers
    # whose leases outlast a first listing of the server's tools (seconds on a busy box;
    # the crash rig's 1 s lease does not); a dead worker's runs move on its liveness
    ledger, hold = tmp_path / "stdio.ledger", tmp_path / "hold"
    hold.touch()
    agent = write_agent(
        tmp_path,
        [turn("Calling.", call(tool, **arguments)), turn("Done.")],
        tools=[f"mcp:billing/{tool}"],
        extra=stdio_table("billing", ledger, hold),
    )

    def worker(name: str, db: int) -> WorkerProcess:
        env = {**rig.env(db), "RATCHET_LEASE_S": "60"}
        return WorkerProcess(env, tmp_path / f"{name}.log", ("--pool", "solo")).start()

    dying, healthy = worker("dying", MCP_DYING_DB), worker("healthy", MCP_HEALTHY_DB)
    to_dying = make_app(Settings(broker_url=f"{rig.server.url}/{MCP_DYING_DB}"))
    to_healthy = make_app(Settings(broker_url=f"{rig.server.url}/{MCP_HEALTHY_DB}"))
    try:
        run_id = create_run(rig.ctx, agent, "go").run_id
        to_dying.send_task("ratchet.turn", (run_id, 1), queue="ratchet.turns")
        # When the worker is SIGKILLed while the call is on the server
        deadline = time.monotonic() + 150
        while not any(line.get("started") == tool for line in ledger_lines(ledger)):
            assert time.monotonic() < deadline, dying.log()[-3000:]
            time.sleep(0.05)
        dying.kill()
        hold.unlink()
        # And the sweeper (as beat would) hands the run to the healthy worker
        deadline = time.monotonic() + 150
        while (record := rig.ctx.runs.get(run_id)) is not None and record.status.is_live:
            assert time.monotonic() < deadline, healthy.log()[-3000:]
            sweep_orphans(
                rig.ctx,
                lambda run, seq: to_healthy.send_task(
                    "ratchet.resume", (run, "sweeper", seq), queue="ratchet.turns"
                ),
            )
            time.sleep(0.2)
    finally:
        dying.kill()
        healthy.kill()
        to_dying.close()
        to_healthy.close()
    assert record is not None
    key = idempotency_key(run_id, 1, "call_1_1")
    assert record.status == status, (record.error, healthy.log()[-2000:])
    if status == RunStatus.COMPLETED:
        # Then the read-only call ran again on a new server, with the same idempotency key
        pids = {line["pid"] for line in ledger_lines(ledger) if line.get("key") == key}
        assert len(pids) == 2, ledger_lines(ledger)
    else:
        # Then the run is parked naming the call, and the server ran it at most once (the
        # first attempt may finish after the worker died; the healthy worker never calls)
        assert "call_1_1" in (record.error or "") and tool in (record.error or "")
        assert "of MCP server `billing`" in (record.error or ""), record.error
        assert len(calls_of(ledger, tool)) <= 1
        assert {line["pid"] for line in ledger_lines(ledger)} == {
            line["pid"] for line in ledger_lines(ledger) if line.get("started")
        }


# --- every pool -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_mcp_tools_work_on_each_pool(
    worker_processes: WorkerProcesses,
    http_server: HttpServer,
    redis_url: str,
    tmp_path: Path,
    pool: str,
) -> None:
    ledger = tmp_path / "stdio.ledger"
    agent = looks_up_and_refunds_at_once(tmp_path, ledger, http_server, "Both.", 5, "Done.")
    worker = worker_processes.start("--pool", pool, "--concurrency", "2")
    record = run_on_workers(redis_url, agent, "go", timeout_s=150)
    assert record.status == RunStatus.COMPLETED, (record.error, worker.log()[-4000:])
    assert len(calls_of(ledger, "issue_refund")) == 1
    assert len(calls_of(http_server.ledger, "lookup_order")) == 1
