"""The console's pages and actions over HTTP (no browser), on the session's real worker.

The app is called in-process through httpx's ASGI transport; the runs it acts on
live in Redis and are advanced by the in-process session worker (tests/workers.py).
Refusals are compared with what the ``ratchet`` CLI prints for the same request.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from runtime.models import RunStatus
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from worker.api import Ratchet
from worker.cli import main
from worker.console.app import make_app

TOKEN = "pages-test-token-0123456789"
Scenario = Callable[[httpx.AsyncClient], Awaitable[None]]

pytestmark = pytest.mark.timeout(90)


def run_console(ratchet: Ratchet, scenario: Scenario) -> None:
    async def main_() -> None:
        transport = httpx.ASGITransport(app=make_app(ratchet, TOKEN))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            logged_in = await client.post("/login", data={"token": TOKEN, "next": "/"})
            assert logged_in.status_code == 303
            await scenario(client)

    asyncio.run(main_())


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


def hidden(html: str, form_id: str, name: str) -> str:
    form = html[html.index(f'id="{form_id}"') :]
    found = re.search(rf'name="{name}" value="([^"]*)"', form)
    assert found is not None
    return found.group(1)


def refusal_of(html: str) -> str:
    found = re.search(r'id="refusal" role="alert">([^<]*)<', html)
    assert found is not None, html[-2000:]
    return found.group(1).replace("&#39;", "'").replace("&quot;", '"').replace("&amp;", "&")


async def act(client: httpx.AsyncClient, run_id: str, action: str, **fields: str) -> httpx.Response:
    page = await client.get(f"/runs/{run_id}")
    form = {"csrf": csrf_of(page.text), **fields}
    shown = re.search(r'name="suspension_seq" value="(\d*)"', page.text)
    if action in ("answer", "approve", "deny") and shown and "suspension_seq" not in fields:
        # As the page's own form does: an answer names the suspension the page shows.
        form["suspension_seq"] = shown[1]
    confirm = await client.post(f"/runs/{run_id}/{action}", data=form)
    assert confirm.status_code == 200 and 'id="confirm"' in confirm.text, confirm.text[-1500:]
    return await client.post(f"/runs/{run_id}/{action}", data={**form, "confirmed": "yes"})


def cli_refusal(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code in (1, 2), result.output  # a refusal, or a bad option (--result)
    return result.stderr.strip()


def approval_agent(directory: Path) -> Path:
    return write_agent(
        directory,
        [
            turn("refund", call("issue_refund", order_id="B2", amount_cents=300)),
            turn("Done."),
        ],
        require_approval=["issue_refund"],
    )


def test_each_refusal_reads_as_the_cli_prints_it(ratchet: Ratchet, tmp_path: Path) -> None:
    # Given a run waiting for approval
    run_id = ratchet.start(approval_agent(tmp_path), "refund B2")
    assert ratchet.wait(run_id, 30).status == RunStatus.AWAITING_APPROVAL
    asked: list[tuple[str, dict[str, str], list[str]]] = [
        # action, its form, the same request on the command line
        ("answer", {"input": "yes"}, ["runs", "continue", run_id, "--input", "yes"]),
        ("resume", {}, ["runs", "resume", run_id]),
        (
            "reconcile",
            {"call_id": "call_1_1", "decision": "retry"},
            ["runs", "reconcile", run_id, "call_1_1", "--retry"],
        ),
        (
            "approve",
            {"suspension_seq": "2"},
            ["runs", "continue", run_id, "--approve", "--suspension-seq", "2"],
        ),
        (
            "reconcile",
            {"call_id": "c", "decision": "result", "result": "{not json"},
            ["runs", "reconcile", run_id, "c", "--result", "{not json"],
        ),
    ]

    async def scenario(client: httpx.AsyncClient) -> None:
        for action, form, argv in asked:
            # When the console is asked for what the CLI would refuse
            response = await act(client, run_id, action, **form)
            # Then it refuses with the CLI's own line, and the run is unchanged
            assert response.status_code == 409, (action, response.text[-800:])
            assert refusal_of(response.text) == cli_refusal(*argv), action
        assert ratchet.get(run_id).status == RunStatus.AWAITING_APPROVAL

    run_console(ratchet, scenario)


def test_answer_deny_and_cancel_go_through_the_api(ratchet: Ratchet, tmp_path: Path) -> None:
    # Given a run that asks a person, one that waits for approval, and one more of those
    asking = write_agent(
        tmp_path / "ask",
        [turn("ask", call("request_user_input", prompt="Which card?")), turn("Thanks.")],
    )
    asked = ratchet.start(asking, "refund")
    denied = ratchet.start(approval_agent(tmp_path / "deny"), "refund B2")
    cancelled = ratchet.start(approval_agent(tmp_path / "cancel"), "refund B2")
    for run_id in (asked, denied, cancelled):
        assert ratchet.wait(run_id, 30).status.is_suspended

    async def scenario(client: httpx.AsyncClient) -> None:
        page = await client.get(f"/runs/{asked}")
        seq = hidden(page.text, "action-answer", "suspension_seq")
        continuation_id = hidden(page.text, "action-answer", "continuation_id")
        # When each is answered, denied, cancelled from the console
        done = await act(
            client,
            asked,
            "answer",
            input="The Visa card",
            suspension_seq=seq,
            continuation_id=continuation_id,
        )
        assert done.status_code == 303
        flash = (await client.get(f"/runs/{asked}")).text
        assert f"run {asked}: continued ({continuation_id}); its next turn is queued" in flash
        # (the same form sent twice is applied once, as the CLI's continuation id is)
        again = await act(
            client,
            asked,
            "answer",
            input="The Visa card",
            suspension_seq=seq,
            continuation_id=continuation_id,
        )
        assert again.status_code in (303, 409)
        assert (await act(client, denied, "deny", reason="over the limit")).status_code == 303
        assert (await act(client, cancelled, "cancel", reason="customer left")).status_code == 303

    run_console(ratchet, scenario)
    # Then each run did what the CLI's command would have made it do
    assert ratchet.wait(asked, 30).status == RunStatus.COMPLETED
    answers = [e.data for e in ratchet.events(asked) if e.type == "run.continued"]
    assert [a["input"] for a in answers] == ["The Visa card"]
    assert ratchet.wait(denied, 30).status == RunStatus.COMPLETED
    tool_results = [e.data for e in ratchet.events(denied) if e.type == "run.continued"]
    assert tool_results[0]["reason"] == "over the limit" and not tool_results[0].get("approved")
    record = ratchet.get(cancelled)
    assert record.status == RunStatus.CANCELLED and record.error == "customer left"


def test_the_runs_page_filters_by_status_and_agent_and_pages(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    # Given 30 runs of one agent and 3 of another, none started
    many = write_agent(tmp_path / "a", [turn("hi")], name="many")
    few = write_agent(tmp_path / "b", [turn("hi")], name="few")
    many_ids = [create_run(ratchet.ctx, many, f"run {i}").run_id for i in range(30)]
    few_ids = [create_run(ratchet.ctx, few, f"run {i}").run_id for i in range(3)]

    def listed(html: str) -> list[str]:
        return re.findall(r'<tr data-run="([^"]+)">', html)

    async def scenario(client: httpx.AsyncClient) -> None:
        # When the list is read, page by page and filtered
        first = (await client.get("/?status=queued")).text
        second = (await client.get("/?status=queued&page=2")).text
        only_few = (await client.get("/?agent=few")).text
        live = await client.get("/?status=queued&live=1")
        # Then pages hold 25 runs in the API's order (newest first), and the rest come next
        newest_first = [r.run_id for r in ratchet.list(RunStatus.QUEUED, 100)]
        assert set(newest_first) == set(many_ids + few_ids)
        assert listed(first) + listed(second) == newest_first
        assert len(listed(first)) == 25 and 'id="next-page"' in first
        assert 'id="next-page"' not in second
        assert listed(only_few) == [r for r in newest_first if r in few_ids]
        assert 'data-count="queued">queued 33<' in first
        # And the live part is the list alone, versioned for the page's script
        assert live.text.startswith("<section data-version=")
        assert listed(live.text) == listed(first)
        bad = await client.get("/?status=nonsense")
        assert bad.status_code == 400

    run_console(ratchet, scenario)


def test_run_data_is_shown_as_text_and_pages_forbid_other_scripts(
    ratchet: Ratchet, tmp_path: Path
) -> None:
    # Given a run whose input is markup
    agent = write_agent(tmp_path, [turn("hi")])
    run_id = create_run(ratchet.ctx, agent, '<script>alert("x")</script><img src=x>').run_id

    async def scenario(client: httpx.AsyncClient) -> None:
        # When its page is read
        page = await client.get(f"/runs/{run_id}")
        # Then the markup is escaped, and the policy allows only the page's own script
        assert "<script>alert" not in page.text and "<img src=x>" not in page.text
        assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page.text
        policy = page.headers["content-security-policy"]
        nonce = re.search(r"script-src 'nonce-([^']+)'", policy)
        assert nonce is not None and "unsafe-inline" not in policy
        assert page.text.count("<script") == page.text.count(f'<script nonce="{nonce.group(1)}"')
        assert page.headers["x-frame-options"] == "DENY"
        # And a login never sends the browser to another site
        for elsewhere in ("//evil.example/", "/\t/evil.example/", "/\\evil.example", "https://e.x"):
            escape = await client.post("/login", data={"token": TOKEN, "next": elsewhere})
            assert escape.headers["location"] == "/", elsewhere
        back = await client.post("/login", data={"token": TOKEN, "next": f"/runs/{run_id}"})
        assert back.headers["location"] == f"/runs/{run_id}"
        # And the page's poll costs one record read while nothing moves
        version = f"queued:{ratchet.get(run_id).last_seq}"
        unchanged = await client.get(f"/runs/{run_id}?live=1&version={version}")
        assert unchanged.status_code == 204
        moved = await client.get(f"/runs/{run_id}?live=1&version=queued:0")
        assert moved.status_code == 200 and f'data-version="{version}"' in moved.text
        missing = await client.get("/runs/no-such-run")
        assert missing.status_code == 404 and "no-such-run" in missing.text

    run_console(ratchet, scenario)
