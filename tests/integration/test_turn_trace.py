"""One real turn, traced: the files of ours whose code ran are the ones docs/architecture.md
lists for a reader who follows a turn.

A ``celery -A tests.traced_worker worker -P solo`` process (a real worker, on the test's
own Redis for broker and stores) profiles one ``ratchet.turn`` task: a model step that
asks for a tool, and the tool step. The worker has run the same agent once before, so
the turn is one of a warm process (its stores open, its agent loaded), as nearly every
turn of a fleet is. The doc's lists and the traced set must be the
same, so the doc cannot drift from the code, and the count of files a turn needs is the
doc's to state (issue 32).
"""

from __future__ import annotations

import re
from pathlib import Path

from runtime.models import RunStatus
from tests.helpers import call, turn, write_agent
from tests.workers import ROOT, WorkerProcesses, redis_context, run_status, sending_to, wait_for
from worker.api import Ratchet

ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("runtime", "runtime_io", "tasks", "store", "worker")


def documented(section: str) -> set[str]:
    """The files named in the table under ``section`` (a ``### `` heading) of the doc."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    body = text.split(f"### {section}\n", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([\w/.]+\.py)` \|", body, flags=re.MULTILINE))


def ours(trace: Path) -> set[str]:
    """The traced files that are the project's code (not the tests', the examples', a library's)."""
    files = set()
    for line in trace.read_text().splitlines():
        path = Path(line)
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES:
            files.add(path.relative_to(ROOT).as_posix())
    return files


def test_one_traced_turn_runs_the_files_the_architecture_doc_lists(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    # Given a warm worker that profiles the first turn of run `traced`, a turn that calls
    # the model and then the tool the model asks for
    trace = tmp_path / "trace.txt"
    worker_processes.start(
        "-P", "solo", app="tests.traced_worker",
        RATCHET_TEST_TRACE=str(trace), RATCHET_TEST_TRACE_RUN="traced",
    )  # fmt: skip
    agent = write_agent(
        tmp_path, [turn("Looking.", call("lookup_order", order_id="B2")), turn("B2 is lost.")]
    )
    ctx = redis_context(redis_url)
    api = Ratchet(ctx)
    with sending_to(redis_url):
        for run_id in ("warm-up", "traced"):
            api.start(agent, "Where is B2?", run_id=run_id)
            # When the worker has run it to the end
            done = lambda: run_status(ctx, run_id) == RunStatus.COMPLETED  # noqa: E731, B023
            wait_for(f"run {run_id} completes", done, 120)
    first_turn = [e.type for e in ctx.runs.events("traced")][1:5]
    ctx.close()
    assert first_turn == ["model.requested", "model.responded", "tool.requested", "tool.completed"]
    # Then the files of ours its first turn ran are those the doc lists, on the path and beside it
    traced = ours(trace)
    on_path, beside = documented("On the path"), documented("Beside the path")
    assert on_path.isdisjoint(beside)
    assert sorted(traced - on_path - beside) == [], "ran, but docs/architecture.md omits them"
    assert sorted((on_path | beside) - traced) == [], "listed, but a turn did not run them"
