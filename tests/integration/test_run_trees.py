"""Bounded run trees on a real Celery worker and Redis stores (runtime/children.py).

A self-starting agent (its own child, started twice per turn) stops at its tree's
bounds; a cancel of its root ends every run of the tree, however deep, in bounded
time; an id squatted on a child's is refused at start and never wedges the parent.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from runtime.children import DEFAULT_MAX_CHILD_DEPTH, child_run_id
from runtime.errors import InvalidRequest, RunRefused
from runtime.fsm import created_event, rebuild
from runtime.models import Event, RunStatus
from store.runs import RunRecord
from tasks.context import Context
from tasks.persistence import append_ending
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.workers import ROOT, session_ratchet, wait_for, worker_env
from worker.api import Ratchet
from worker.console.app import make_app

pytestmark = pytest.mark.timeout(120)


def self_starting_agent(directory: Path, extra: str = "", then: str = "done") -> Path:
    """An agent whose first answer starts itself as a child twice; then it answers."""
    return write_agent(
        directory,
        [
            turn("Again.", call("run_child", agent="me", input="go"),
                 call("run_child", agent="me", input="go")),
            turn(then),
        ],
        name="looper",
        tools=["run_child"],
        extra=f'{extra}\n[children]\nme = "looper.toml"',
    )  # fmt: skip


def tree(ratchet: Ratchet, root: str) -> list[str]:
    """Every run of ``root``'s tree, walked through the links each run records."""
    found, queue = [], [root]
    while queue:
        run_id = queue.pop()
        found.append(run_id)
        queue.extend(ratchet.lineage(run_id)["children"])
    return found


def refusals(ratchet: Ratchet, run_id: str) -> list[str]:
    return [
        e.data["error"]
        for e in ratchet.events(run_id)
        if e.type == "tool.failed" and "`run_child` refused" in e.data["error"]
    ]


def test_a_self_starting_agent_stops_at_the_default_depth(ratchet: Ratchet, tmp_path: Path) -> None:
    # Given an agent that starts itself twice per turn, and sets no tree limits
    agent = self_starting_agent(tmp_path)
    # When it runs
    root = ratchet.start(agent, "go")
    record = ratchet.wait(root, timeout_s=90)
    # Then the whole binary tree down to the default depth completes, and nothing deeper
    assert record.status == RunStatus.COMPLETED, record.error
    depth = DEFAULT_MAX_CHILD_DEPTH
    runs = tree(ratchet, root)
    assert len(runs) == 2 ** (depth + 1) - 1 == len(ratchet.ctx.runs.list(limit=1000))
    assert {ratchet.get(r).status for r in runs} == {RunStatus.COMPLETED}
    # and each run at the deepest level read both its calls refused, naming the bound
    leaves = [r for r in runs if refusals(ratchet, r)]
    assert len(leaves) == 2**depth
    for leaf in leaves:
        errors = refusals(ratchet, leaf)
        assert len(errors) == 2
        assert all(f"depth {depth}" in e and f"max_child_depth = {depth}" in e for e in errors)


def test_a_self_starting_agent_stops_at_its_size_bound(ratchet: Ratchet, tmp_path: Path) -> None:
    # Given an agent that starts itself twice per turn, in a tree of at most 6 runs
    agent = self_starting_agent(tmp_path, "max_child_depth = 50\nmax_tree_runs = 6")
    # When it runs
    root = ratchet.start(agent, "go")
    record = ratchet.wait(root, timeout_s=90)
    # Then it completes with exactly 6 runs in its tree, every one completed
    assert record.status == RunStatus.COMPLETED, record.error
    runs = tree(ratchet, root)
    assert len(runs) == 6 == len(ratchet.ctx.runs.list(limit=1000))
    assert {ratchet.get(r).status for r in runs} == {RunStatus.COMPLETED}
    # and the calls past the bound were tool errors the model read, naming it
    refused = [e for r in runs for e in refusals(ratchet, r)]
    assert refused and all("max_tree_runs = 6" in e for e in refused)


@contextmanager
def fleet(redis_url: str, **settings: int) -> Iterator[Ratchet]:
    """The session worker's context with these fleet-wide tree limits (RATCHET_MAX_…)."""
    with session_ratchet(redis_url, **settings) as api:
        yield api


@pytest.fixture
def roomy(redis_url: str) -> Iterator[Ratchet]:
    """A fleet whose default tree limits are far above this test's trees (the agent says none)."""
    with fleet(redis_url, max_child_depth=1000, max_tree_runs=5000) as ratchet:
        yield ratchet


DEEP = 520
"""Deeper than the recursion that cancelled a tree could go (RecursionError at ~487)."""


@pytest.mark.usefixtures("session_worker")
def test_cancelling_a_growing_tree_ends_every_run_in_it(
    roomy: Ratchet, redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    ratchet = roomy
    # Given a self-starting agent whose tree is still growing, already over DEEP runs deep
    agent = self_starting_agent(tmp_path)
    root = ratchet.start(agent, "go")
    wait_for(
        f"the tree holds {DEEP} runs",
        lambda: len(ratchet.ctx.runs.list(limit=10_000)) >= DEEP,
        timeout_s=90,
    )
    # When its root is cancelled from the CLI
    env = worker_env(redis_url, ledger, tmp_path / "data")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "worker", "runs", "cancel", root, "--reason", "stop the tree"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    # Then every run of the tree ends (those its turns were starting meanwhile too)

    def all_ended() -> bool:
        return all(r.status.is_terminal for r in ratchet.ctx.runs.list(limit=10_000))

    wait_for("every run of the tree has ended", all_ended, timeout_s=60)
    runs = ratchet.ctx.runs.list(limit=10_000)
    assert len(runs) >= DEEP
    assert {r.status for r in runs} <= {RunStatus.CANCELLED, RunStatus.COMPLETED}
    # and each is a run of this one tree, by the parent its run.created names
    parents = {
        r.run_id: (ratchet.events(r.run_id)[0].data.get("parent") or {}).get("run_id") for r in runs
    }
    assert [r for r, parent in parents.items() if parent is None] == [root]
    assert all(parent in parents for parent in parents.values() if parent is not None)
    # and the cancel itself (a CLI process) took time linear in the tree: 40 ms a run at most
    assert took_s < 10 + len(runs) / 25, f"{took_s:.1f}s for {len(runs)} runs"


def parent_agent(directory: Path) -> Path:
    write_agent(directory, [turn("B2 is a toaster.")], name="toaster")
    return write_agent(
        directory,
        [turn("Asking.", call("run_child", agent="toaster", input="Look up B2")),
         turn("The child could not be started.")],
        name="parent",
        tools=["run_child"],
        extra='[children]\ntoaster = "toaster.toml"',
    )  # fmt: skip


def test_a_child_id_is_refused_at_start(ratchet: Ratchet, tmp_path: Path) -> None:
    agent = parent_agent(tmp_path)
    state = create_run(ratchet.ctx, agent, "What is B2?")
    squatted = child_run_id(state.run_id, "call_1_1")
    # When someone starts a run under the id the parent's first call will give its child
    with pytest.raises(InvalidRequest) as refused:
        ratchet.start(agent, "squat", run_id=squatted)
    # Then it is refused, in one line that says why
    assert f"run id {squatted} is reserved" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert ratchet.ctx.runs.get(squatted) is None


def squat(ctx: Context, agent: Path, run_id: str) -> None:
    """A run under a child's id that no parent made (as an older build let a start make)."""
    now = ctx.runs.clock()
    data = created_event(run_id, ctx.agent(agent), "squat", now)
    first = Event(seq=1, type="run.created", at_ms=now, data=data)
    state = rebuild([first])
    assert state is not None
    ctx.runs.create(RunRecord.from_state(state, now, None), first)


def test_a_squatted_child_id_is_an_error_the_parent_reads(ratchet: Ratchet, tmp_path: Path) -> None:
    agent = parent_agent(tmp_path)
    # Given a parent whose first call's child id is already held by another run
    state = create_run(ratchet.ctx, agent, "What is B2?")
    squatted = child_run_id(state.run_id, "call_1_1")
    squat(ratchet.ctx, tmp_path / "toaster.toml", squatted)
    # When the parent runs
    from tasks.messages import enqueue_turn

    enqueue_turn(run_id=state.run_id, expected_seq=state.seq)
    record = ratchet.wait(state.run_id, timeout_s=60)
    # Then it is not wedged: the call is an error the model read, and the run completes
    assert record.status == RunStatus.COMPLETED, record.error
    failed = [e for e in ratchet.events(state.run_id) if e.type == "tool.failed"]
    assert len(failed) == 1 and f"{squatted} is taken by a run" in failed[0].data["error"]
    assert record.recovery_attempts == 0
    # and the squatter was left as it was
    assert ratchet.events(squatted)[-1].seq == 1


def test_forking_into_a_taken_id_says_the_id_is_taken(ratchet: Ratchet, tmp_path: Path) -> None:
    agent = parent_agent(tmp_path)
    a = create_run(ratchet.ctx, agent, "What is B2?").run_id
    b = create_run(ratchet.ctx, agent, "What is A1?").run_id
    # When A is forked into B's id
    with pytest.raises(InvalidRequest) as refused:
        ratchet.fork(a, new_run_id=b)
    # Then the reason is that the id is taken, not a lost race
    message = str(refused.value)
    assert f"run id {b} is taken by another run" in message and "--run-id" in message
    assert "another worker" not in message
    assert json.loads(json.dumps(ratchet.events(b)[0].data))["input"] == "What is A1?"


def test_the_cli_refuses_a_child_id_in_one_line(
    redis_url: str, ledger: Path, tmp_path: Path
) -> None:
    agent = parent_agent(tmp_path)
    squatted = child_run_id("some-parent", "call_1_1")
    env = worker_env(redis_url, ledger, tmp_path / "data")
    done = subprocess.run(
        [sys.executable, "-m", "worker", "runs", "start", str(agent), "--input", "go",
         "--run-id", squatted],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"ratchet: run id {squatted} is reserved"), done.stderr


def asking_chain(directory: Path) -> Path:
    """An agent that starts itself once; refused at the depth bound, it asks a person."""
    return write_agent(
        directory,
        [turn("Deeper.", call("run_child", agent="me", input="go")),
         turn("Ask.", call("request_user_input", prompt="Which?")), turn("done")],
        name="asker",
        tools=["run_child", "request_user_input"],
        extra='[children]\nme = "asker.toml"',
    )  # fmt: skip


@pytest.mark.usefixtures("session_worker", "ledger")
def test_the_consoles_cancel_ends_a_deep_tree(redis_url: str, tmp_path: Path) -> None:
    with fleet(redis_url, max_child_depth=DEEP, max_tree_runs=DEEP + 1) as ratchet:
        console_cancels_a_deep_tree(ratchet, tmp_path)


def console_cancels_a_deep_tree(ratchet: Ratchet, tmp_path: Path) -> None:
    token = "trees-test-token-0123456789"
    # Given a tree DEEP runs deep (the fleet's bound) whose runs wait: the deepest for a person
    root = ratchet.start(asking_chain(tmp_path), "go")
    wait_for(
        f"the tree holds {DEEP + 1} runs",
        lambda: len(ratchet.ctx.runs.list(limit=10_000)) >= DEEP + 1,
        timeout_s=90,
    )

    # When an operator cancels the root from the console
    async def cancel() -> httpx.Response:
        transport = httpx.ASGITransport(app=make_app(ratchet, token))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            logged_in = await client.post("/login", data={"token": token, "next": "/"})
            assert logged_in.status_code == 303
            page = await client.get(f"/runs/{root}")
            csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
            assert csrf is not None
            form = {"confirmed": "yes", "csrf": csrf.group(1), "reason": "stop"}
            return await client.post(f"/runs/{root}/cancel", data=form)

    started = time.monotonic()
    response = asyncio.run(cancel())
    took_s = time.monotonic() - started
    # Then it answers at once, and every run of the tree is cancelled
    assert response.status_code == 303, response.text[-500:]
    statuses = {r.status for r in ratchet.ctx.runs.list(limit=10_000)}
    assert statuses == {RunStatus.CANCELLED}
    assert took_s < 10 + DEEP / 25, f"{took_s:.1f}s for {DEEP + 1} runs"


def three_generations(directory: Path) -> Path:
    """A root that starts a middle agent, which starts one that asks a person."""
    write_agent(
        directory,
        [turn("Ask.", call("request_user_input", prompt="Which?")), turn("done")],
        name="leaf",
        tools=["request_user_input"],
    )
    for name, child in (("middle", "leaf"), ("top", "middle")):
        write_agent(
            directory,
            [turn("Deeper.", call("run_child", agent=child, input="go")), turn("done")],
            name=name,
            tools=["run_child"],
            extra=f'[children]\n{child} = "{child}.toml"',
        )
    return directory / "top.toml"


def test_a_cancel_cut_short_is_finished_by_the_next(ratchet: Ratchet, tmp_path: Path) -> None:
    # Given three generations of waiting runs whose root alone was cancelled (the
    # process cancelling the tree died after its first write)
    root = ratchet.start(three_generations(tmp_path), "go")
    wait_for(
        "the grandchild asks",
        lambda: len(ratchet.ctx.runs.list(RunStatus.NEEDS_USER_INPUT, limit=10)) == 1,
    )
    record = ratchet.ctx.runs.get(root)
    assert record is not None and record.status == RunStatus.WAITING
    append_ending(ratchet.ctx, record, "run.cancelled", {"reason": "cut short"}, None)
    assert len([r for r in ratchet.ctx.runs.list() if not r.status.is_terminal]) == 2
    # When the root is cancelled again
    again = ratchet.cancel(root, "again")
    # Then the rest of its tree is cancelled, and a third cancel has nothing left to do
    assert again.status == RunStatus.CANCELLED
    assert {r.status for r in ratchet.ctx.runs.list()} == {RunStatus.CANCELLED}
    with pytest.raises(RunRefused, match="nothing to cancel"):
        ratchet.cancel(root, "once more")
