"""The console's run page shows the answer as it forms and each tool's progress while it
runs, in Chromium, beside the API and `ratchet runs watch`, on a real prefork worker
streaming from a local OpenAI-compatible server (tests/integration/
test_streaming_on_real_workers.py says how the server's gates prove each observer
showed a piece before the next was sent)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from runtime.models import RunStatus
from tasks.start import create_run
from tests.console.conftest import ConsoleServer, log_in
from tests.integration.test_streaming_on_real_workers import (
    FIRST,
    SECOND,
    ApiWatcher,
    CliWatcher,
    calls_paged,
    enqueue_turn,
    finish,
    gated,
    pytestmark,
    usage,
    wait_for,
)
from tests.openai_server import CannedStream, OpenAIServer, serve
from tests.test_openai_runs import KEY_VAR, write_openai_agent
from tests.workers import WorkerProcesses, redis_context, run_status
from worker.api import Ratchet
from worker.watch import Assembly

__all__ = ["pytestmark"]


@pytest.fixture
def model_server() -> Iterator[OpenAIServer]:
    with serve() as running:
        yield running


def test_the_api_the_cli_and_the_console_show_each_piece_and_each_progress_as_it_comes(
    worker_processes: WorkerProcesses,
    console_server: ConsoleServer,
    browser: WebDriver,
    model_server: OpenAIServer,
    redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a prefork worker, and a model that asks for a tool reporting its progress
    gates_dir = tmp_path / "gates"
    gates_dir.mkdir()
    first_events, first_gates = gated(FIRST, [calls_paged(3), finish("tool_calls"), usage()])
    second_events, second_gates = gated(SECOND, [finish("stop"), usage()])
    first = model_server.enqueue_stream(first_events, gates=first_gates)
    model_server.enqueue_stream(second_events, gates=second_gates)
    env = {KEY_VAR: "sk-not-a-secret", "RATCHET_TEST_GATES": str(gates_dir)}
    worker_processes.start("--pool", "prefork", "-c", "2", **env)
    agent = write_openai_agent(
        tmp_path, model_server, provider={"stream": "true"}, tools=["tests.progress_tools:paged"]
    )
    ctx = redis_context(redis_url)
    run_id = create_run(ctx, agent, "Where is B2?").run_id
    # And three observers: the API, the CLI watcher and the run's page in the console
    api = ApiWatcher(Ratchet(ctx), run_id)
    cli = CliWatcher({**worker_processes.base_env, **env}, run_id)
    log_in(browser, f"{console_server.url}/runs/{run_id}")
    wait_for("the run page", lambda: browser.find_elements(By.ID, "forming-text") != [])

    def page(element: str) -> str:
        # By id each time: the live part of the page is swapped in anew as the run moves.
        script = "var e = document.getElementById(arguments[0]); return e ? e.textContent : '';"
        return str(browser.execute_script(script, element))

    wait_for("the watcher shows the run", lambda: cli.shows("run.created"))
    # When the run goes, each piece held back until every observer shows the one before
    enqueue_turn(redis_url, run_id)

    page_first: list[float] = []  # when the page was first seen showing the first piece

    def on_page(so_far: str) -> bool:
        shown = page("forming-text") == so_far
        if shown and not page_first:
            page_first.append(time.monotonic())
        return shown

    def shows_text(call: int, so_far: str) -> Callable[[], bool]:
        return lambda: on_page(so_far) and api.text(call) == so_far and cli.shows(so_far)

    def shows_progress(progress: str) -> Callable[[], bool]:
        return lambda: (
            any(s.data.get("message") == progress for s in api.seen())
            and cli.shows(progress)
            and progress in page("progress")
        )

    for pieces, gates, call in ((FIRST, first_gates, 1), (SECOND, second_gates, 2)):
        for index, gate in sorted(gates.items()):
            so_far = "".join(pieces[: index - 1])
            wait_for(f"every observer shows {so_far!r}", shows_text(call, so_far))
            gate.set()
        if call == 1:
            for number in (1, 2, 3):
                progress = f"page {number} of 3"
                wait_for(f"every observer shows {progress!r}", shows_progress(progress))
                (gates_dir / f"page-{number}").touch()
    wait_for("the run completes", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED)
    api.thread.join(30)
    cli.finish()

    # Then nothing was held up, and what each observer assembled is what was journaled
    assert model_server.gate_misses == [], "an observer did not show a piece before the next"
    assert not (gates_dir / "missed").exists(), (gates_dir / "missed").read_text()
    assert api.error is None, api.error
    answers = [e.data["content"] for e in ctx.runs.events(run_id) if e.type == "model.responded"]
    assert answers == ["".join(FIRST), "".join(SECOND)]
    assembly = Assembly()
    for seen in api.seen():
        assembly.add(seen)
    assert assembly.answers == answers
    for answer in answers:  # shown as it formed, once (the event lines quote it too)
        assert cli.output.count(f"│ {answer}\n") == 1, cli.output
    assert cli.process.returncode == 0, cli.errors
    wait_for("the page shows the answer", lambda: "".join(SECOND) in page("transcript"))

    print_delays(first, api, cli, page_first[0])
    ctx.close()


def print_delays(first: CannedStream, api: ApiWatcher, cli: CliWatcher, page_at: float) -> None:
    """How long after the server sent the first piece each observer showed it."""

    def delay_ms(seen_at: float) -> str:
        return f"{(seen_at - first.sent_at[1]) * 1000:.1f} ms"

    print(
        "first piece shown after the server sent it:",
        f"api {delay_ms(api.first(lambda s: s.data.get('text') == FIRST[0]))},",
        f"cli {delay_ms(cli.first(FIRST[0]))},",
        f"console {delay_ms(page_at)} (polled by the test: at most)",
    )
