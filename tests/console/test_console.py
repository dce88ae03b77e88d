"""The operator console in a real browser, over a real worker, a real broker and Redis.

Each test starts ``python -m worker console`` and a ``celery -A worker worker``
subprocess on the test's own Redis database, and drives Debian's Chromium with
Selenium: log in, look at the run, press the button, confirm, and watch the page
change without reloading it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from runtime.models import RunStatus
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.console.conftest import TOKEN, ConsoleServer, log_in, screenshot
from tests.helpers import call, turn, write_agent
from tests.workers import WorkerProcesses, redis_context, wait_for_run
from worker.app import make_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def ctx(redis_url: str) -> Iterator[Context]:
    with closing(redis_context(redis_url)) as context:
        yield context


def start(ctx: Context, redis_url: str, agent: Path, text: str) -> str:
    run_id = create_run(ctx, agent, text).run_id
    make_app(Settings(broker_url=redis_url)).send_task(
        "ratchet.turn", (run_id, 1), queue="ratchet.turns"
    )
    return run_id


def status_on_page(browser: WebDriver, wanted: str, timeout_s: float = 60) -> None:
    WebDriverWait(browser, timeout_s).until(
        lambda b: b.find_element(By.ID, "run-status").text == wanted
    )


def mark_page(browser: WebDriver) -> None:
    """Tag this document: if the page reloads, the tag is gone."""
    browser.execute_script("window.__notReloaded = true")


def not_reloaded(browser: WebDriver) -> bool:
    return bool(browser.execute_script("return window.__notReloaded === true"))


def test_a_run_waiting_for_approval_is_approved_from_the_page_and_completes(
    console_server: ConsoleServer,
    worker_processes: WorkerProcesses,
    browser: WebDriver,
    ctx: Context,
    redis_url: str,
    ledger: Path,
    tmp_path: Path,
) -> None:
    # Given a worker and a run that asks to issue a refund, which policy says needs approval
    worker_processes.start("--pool", "threads", "--concurrency", "2")
    agent = write_agent(
        tmp_path,
        [
            turn("Refund B2, then.", call("issue_refund", order_id="B2", amount_cents=1250)),
            turn("Refunded 12.50 for order B2."),
        ],
        name="refund-desk",
        require_approval=["issue_refund"],
    )
    run_id = start(ctx, redis_url, agent, "My toaster never arrived (order B2) <b>refund</b>")
    wait_for_run(ctx, run_id, lambda r: r.status == RunStatus.AWAITING_APPROVAL)
    # When an operator logs in and opens the run
    log_in(browser, f"{console_server.url}/runs/{run_id}")
    status_on_page(browser, "awaiting_approval")
    arguments = browser.find_element(By.ID, "suspension-arguments").text
    assert '"amount_cents": 1250' in arguments and '"order_id": "B2"' in arguments
    # (run data is shown as text, never as markup)
    assert "<b>refund</b>" in browser.find_element(By.TAG_NAME, "main").text
    screenshot(browser, "console-run-awaiting-approval")
    assert not ledger.exists()
    # And approves, and confirms
    browser.find_element(By.ID, "do-approve").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "confirm"))
    assert "Approve the tool call?" in browser.find_element(By.TAG_NAME, "h1").text
    browser.find_element(By.ID, "confirm").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CLASS_NAME, "flash"))
    assert f"run {run_id}: continued" in browser.find_element(By.CLASS_NAME, "flash").text
    mark_page(browser)
    # Then the page shows the run completing, without being reloaded
    status_on_page(browser, "completed")
    assert not_reloaded(browser)
    assert browser.find_element(By.ID, "run-output").text == "Refunded 12.50 for order B2."
    screenshot(browser, "console-run-completed")
    # And the refund was issued once, by the worker
    record = wait_for_run(ctx, run_id, lambda r: r.status == RunStatus.COMPLETED)
    assert record.usage.tool_calls == 1
    assert ledger.read_text().splitlines() == ["refund B2 1250"]
    # And the runs page lists it with live counts
    browser.get(f"{console_server.url}/?status=completed")
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-run="{run_id}"]')
    assert "completed" in row.text and "refund-desk" in row.text
    count = browser.find_element(By.CSS_SELECTOR, '[data-count="completed"]').text
    assert count == "completed 1"
    # And a run that starts meanwhile appears in the list and its count, without a reload
    browser.get(f"{console_server.url}/")
    mark_page(browser)
    another = create_run(ctx, agent, "and order C3").run_id
    WebDriverWait(browser, 30).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, f'tr[data-run="{another}"]')
    )
    assert browser.find_element(By.CSS_SELECTOR, '[data-count="queued"]').text == "queued 1"
    assert not_reloaded(browser)


def test_a_parked_run_is_reconciled_from_the_page(
    console_server: ConsoleServer,
    worker_processes: WorkerProcesses,
    browser: WebDriver,
    ctx: Context,
    redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a run whose non-idempotent charge did not return in time: parked, outcome unknown
    worker_processes.start("--pool", "threads", "--concurrency", "2")
    agent = write_agent(
        tmp_path,
        [turn("Charging.", call("slow_charge", sleep_s=5)), turn("Charged; all done.")],
        name="charger",
        tools=["tests.slow_tools:slow_charge"],
        extra="tool_timeout_s = 0.5",
    )
    run_id = start(ctx, redis_url, agent, "charge the card")
    parked = wait_for_run(ctx, run_id, lambda r: r.status == RunStatus.NEEDS_RECONCILIATION)
    call_id = next(e.data["call_id"] for e in ctx.runs.events(run_id) if e.type == "run.parked")
    # When an operator opens it, sees the open call, and records what really happened
    log_in(browser, f"{console_server.url}/runs/{run_id}")
    status_on_page(browser, "needs_reconciliation")
    open_call = browser.find_element(By.ID, "open-call").text
    assert call_id in open_call and "slow_charge" in open_call and '"sleep_s": 5' in open_call
    screenshot(browser, "console-run-parked")
    form = browser.find_element(By.ID, "action-reconcile")
    result = form.find_element(By.NAME, "result")
    result.clear()
    result.send_keys('{"charged": true, "checked_by": "operator"}')
    browser.find_element(By.ID, "do-reconcile").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "confirm"))
    assert call_id in browser.find_element(By.TAG_NAME, "main").text
    browser.find_element(By.ID, "confirm").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CLASS_NAME, "flash"))
    flash = browser.find_element(By.CLASS_NAME, "flash").text
    assert flash == f"run {run_id}: call {call_id} reconciled (result); the run goes on"
    mark_page(browser)
    # Then the run goes on and completes, on the page without a reload
    status_on_page(browser, "completed")
    assert not_reloaded(browser)
    record = wait_for_run(ctx, run_id, lambda r: r.status == RunStatus.COMPLETED)
    assert record.output == "Charged; all done."
    reconciled = [e.data for e in ctx.runs.events(run_id) if e.type == "tool.reconciled"]
    assert reconciled == [
        {
            "call_id": call_id,
            "decision": "result",
            "by": "operator",
            "result": {"charged": True, "checked_by": "operator"},
        }
    ]
    assert parked.usage.tool_calls == 0 and record.usage.tool_calls == 1


def test_a_wrong_token_is_refused(
    console_server: ConsoleServer, browser: WebDriver, ctx: Context, tmp_path: Path
) -> None:
    # Given a run the console could show
    agent = write_agent(tmp_path, [turn("hello")])
    run_id = create_run(ctx, agent, "a customer's private request").run_id
    # When someone logs in with a wrong token
    log_in(browser, f"{console_server.url}/runs/{run_id}", token=TOKEN[:-1] + "x")
    # Then the console refuses, sets no session, and still shows only the login page
    error = WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "login-error"))
    assert "wrong token" in error.text
    assert browser.get_cookie("ratchet_console") is None
    browser.get(f"{console_server.url}/runs/{run_id}")
    assert browser.find_elements(By.ID, "token") and not browser.find_elements(By.ID, "run-id")
    assert "private request" not in browser.page_source
    # And neither a wrong bearer token nor a forged action gets through
    wrong = {"Authorization": f"Bearer {TOKEN}x"}
    assert httpx.get(f"{console_server.url}/", headers=wrong).status_code == 303
    forged = httpx.post(
        f"{console_server.url}/runs/{run_id}/cancel", data={"confirmed": "yes", "csrf": "x"}
    )
    assert forged.status_code == 303 and forged.headers["location"].startswith("/login")
    # And a logged-in session's action without its CSRF token is refused too
    with httpx.Client(base_url=console_server.url) as client:
        assert client.post("/login", data={"token": TOKEN}).status_code in (200, 303)
        assert client.get(f"/runs/{run_id}").status_code == 200
        no_csrf = client.post(f"/runs/{run_id}/cancel", data={"confirmed": "yes"})
        assert no_csrf.status_code == 403
    record = ctx.runs.get(run_id)
    assert record is not None and record.status == RunStatus.QUEUED
