"""Record the golden event logs in ``tests/golden/events/`` from real runs of this build.

Run once when a new event type (or a new shape of an old one) is written, then
commit the new files beside the old ones; never rewrite a file that is there.
``tests/test_golden_event_logs.py`` folds every file on every test run, so a
change that cannot read a log an earlier build wrote fails the build (the
replayer tests of Temporal's SDK are the model).

    python -m tests.golden.make_event_logs

Each scenario drives a run in-process on memory stores through the same code
the tasks use (turns, continuations, cancel, reconcile, resume, the sweeper's
dead-lettering, expiry), with the scripted provider; the one event only a
network provider writes (``model.retrying``) comes from the suite's
OpenAI-compatible server on 127.0.0.1. Beside each ``NAME.jsonl`` goes
``NAME.state.json``: the snapshot document of the folded state, as this build
encodes it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runtime.children import child_run_id
from runtime.continuation import make_continuation
from runtime.fsm import apply, rebuild
from runtime.models import Event, RunState
from runtime.probes import idempotency_key
from runtime.recovery import OPERATOR, SWEEPER
from store.snapshots import format as snapshot_format
from tasks.budget import raise_budgets
from tasks.children import deliver
from tasks.context import Context
from tasks.control import apply_continuation, cancel, expire_suspended
from tasks.fork import fork
from tasks.persistence import append_events, new_owner
from tasks.recovery import reconcile, resume
from tasks.start import create_run
from tasks.timers import wake
from tasks.turn import advance
from tests.helpers import call, drive, memory_context, turn, write_agent

EVENTS = Path(__file__).parent / "events"
INPUT = "Refund order B2, it never arrived."


def _no_enqueue(run_id: str, seq: int) -> None:
    """The scenarios take the next turn themselves."""


def _events(ctx: Context, run_id: str) -> list[Event]:
    return list(ctx.runs.events(run_id, after_seq=0))


def tools_and_answer(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home,
        [
            turn("Looking it up.", call("lookup_order", order_id="B2"), call("no_such_tool")),
            turn("Refunded.", call("issue_refund", order_id="B2", amount_cents=2900)),
            turn("Order B2 is refunded."),
        ],
        name="tools-and-answer",
    )
    run = create_run(ctx, agent, INPUT, "golden-tools-and-answer")
    drive(ctx, run.run_id)
    return run.run_id


def ask_and_continue(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home,
        [turn("Which order?", call("request_user_input", prompt="Which order?")), turn("Done.")],
        name="ask-and-continue",
    )
    run = create_run(ctx, agent, "Refund my order.", "golden-ask-and-continue")
    done = drive(ctx, run.run_id)
    answer = make_continuation(run.run_id, "golden-c1", input="B2", suspension_seq=done.seq)
    apply_continuation(ctx, answer, _no_enqueue)
    drive(ctx, run.run_id)
    return run.run_id


def approval_denied_then_approved(ctx: Context, home: Path) -> str:
    refund = call("issue_refund", order_id="B2", amount_cents=2900)
    agent = write_agent(
        home,
        [turn("Refunding.", refund), turn("Refunding again.", refund), turn("Refunded.")],
        name="approvals",
        require_approval=["issue_refund"],
    )
    run = create_run(ctx, agent, INPUT, "golden-approvals")
    done = drive(ctx, run.run_id)
    deny = make_continuation(run.run_id, "golden-d1", deny="too much", suspension_seq=done.seq)
    apply_continuation(ctx, deny, _no_enqueue)
    done = drive(ctx, run.run_id)
    approve = make_continuation(run.run_id, "golden-a1", approve=True, suspension_seq=done.seq)
    apply_continuation(ctx, approve, _no_enqueue)
    drive(ctx, run.run_id)
    return run.run_id


def blocked_then_cancelled(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home, [turn("I need a manager.", call("blocked", reason="over the limit"))], name="blocked"
    )
    run = create_run(ctx, agent, INPUT, "golden-blocked-cancelled")
    drive(ctx, run.run_id)
    cancel(ctx, run.run_id, "the customer withdrew the request")
    return run.run_id


def suspension_expired(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home,
        [turn("Which order?", call("request_user_input", prompt="Which order?"))],
        name="expires",
        extra="max_suspended_s = 1",
    )
    run = create_run(ctx, agent, "Refund my order.", "golden-expired")
    drive(ctx, run.run_id)
    later = ctx.runs.clock() + 60_000
    ctx.runs.clock = lambda: later  # a minute on: past its max_suspended_s, due to expire
    assert expire_suspended(ctx) == [run.run_id]
    return run.run_id


def parked_reconciled(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home,
        [turn("Refunding.", call("issue_refund", order_id="B2", amount_cents=2900)), turn("Done.")],
        name="parked",
    )
    run = create_run(ctx, agent, INPUT, "golden-parked-reconciled")
    # Given a worker that journaled the refund as requested and died before its outcome
    arguments = {"order_id": "B2", "amount_cents": 2900}
    responded = {
        "content": "Refunding.",
        "tool_calls": [{"id": "call_1_1", "name": "issue_refund", "arguments": arguments}],
        "usage": {"input_tokens": 10, "output_tokens": 5},
    }
    requested = {"call_id": "call_1_1", "name": "issue_refund", "arguments": arguments}
    owner = new_owner()
    assert ctx.runs.acquire_lease(run.run_id, owner, 10.0)
    append_events(
        ctx,
        _state(ctx, run.run_id),
        [
            ("model.requested", {"turn": 0}),
            ("model.responded", responded),
            ("tool.requested", requested),
        ],
        owner,
    )
    ctx.runs.release_lease(run.run_id, owner)
    # When the next turn finds the call with no outcome, it parks the run
    drive(ctx, run.run_id)
    # and an operator records what really happened
    reconcile(ctx, run.run_id, "call_1_1", "result", {"refund_id": "R-1"}, enqueue=_no_enqueue)
    drive(ctx, run.run_id)
    return run.run_id


def dead_lettered(ctx: Context, home: Path) -> str:
    # A model that never answers in time: each sweeper resume makes no progress.
    agent = write_agent(
        home,
        [{**turn("slow"), "sleep_s": 0.3}],
        name="dead-lettered",
        extra="model_timeout_s = 0.05",
    )
    run = create_run(ctx, agent, INPUT, "golden-dead-lettered")
    for _ in range(ctx.settings.max_recovery_attempts + 1):
        state = _state(ctx, run.run_id)
        if not state.status.is_live:
            break
        resume(ctx, run.run_id, SWEEPER, state.seq)
    return run.run_id


def budget_failed_and_model_timeout(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home,
        [
            {**turn("slow"), "sleep_s": 0.3},
            turn("Looking.", call("lookup_order", order_id="B2")),
            turn("Looking again.", call("lookup_order", order_id="A1")),
        ],
        name="budget",
        budgets={"max_turns": 2},
        extra="model_timeout_s = 0.1",
    )
    run = create_run(ctx, agent, INPUT, "golden-budget-failed")
    drive(ctx, run.run_id)
    return run.run_id


def provider_stalled_resumed(ctx: Context, home: Path) -> str:
    import os

    from tests.openai_server import serve

    os.environ["GOLDEN_OPENAI_API_KEY"] = "sk-golden-not-a-secret"
    with serve() as server:
        # Errors past the provider's retries: the run stalls (a 429 would wait on the queue)
        server.enqueue(503, {"error": {"message": "overloaded"}}, {"Retry-After": "0"})
        server.enqueue_fixture("server_error")
        path = home / "retried.toml"
        path.write_text(
            "\n".join(
                [
                    'name = "retried"',
                    'model = "openai:gpt-test"',
                    'system = "You are a refund desk."',
                    "tools = []",
                    "[provider]",
                    f'base_url = "{server.url}"',
                    'api_key_env = "GOLDEN_OPENAI_API_KEY"',
                    "timeout_s = 5",
                    "max_attempts = 2",
                    "max_retry_s = 10",
                ]
            )
            + "\n"
        )
        run = create_run(ctx, path, INPUT, "golden-provider-stalled")
        drive(ctx, run.run_id)
        # and once the provider is back an operator resumes it
        server.enqueue_fixture("text_answer")
        resume(ctx, run.run_id, OPERATOR)
        drive(ctx, run.run_id)
    return run.run_id


def forked(ctx: Context, home: Path) -> str:
    original = tools_and_answer(ctx, home)
    at = next(e.seq for e in _events(ctx, original) if e.type == "tool.completed")
    fork(ctx, original, at, "golden-forked", enqueue=_no_enqueue)
    drive(ctx, "golden-forked")
    return "golden-forked"


def budget_raised(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home,
        [turn("Looking.", call("lookup_order", order_id="A1"))] * 2 + [turn("Found A1.")],
        name="raised",
        budgets={"max_turns": 2},
    )
    run = create_run(ctx, agent, INPUT, "golden-budget-raised")
    drive(ctx, run.run_id)
    raise_budgets(ctx, run.run_id, {"max_turns": "+1"}, "operator:golden", "one more", _no_enqueue)
    drive(ctx, run.run_id)
    return run.run_id


def waited(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home,
        [turn("Waiting.", call("wait", seconds=0.05, reason="courier")), turn("Scanned.")],
        name="waits",
        tools=["wait"],
    )
    run = create_run(ctx, agent, INPUT, "golden-waited")
    drive(ctx, run.run_id)
    time.sleep(0.06)
    wake(ctx, run.run_id, _state(ctx, run.run_id).seq, _no_enqueue)
    drive(ctx, run.run_id)
    return run.run_id


def parent_and_child(ctx: Context, home: Path) -> str:
    """The child's log is the golden one here: it holds run.parent_told; the parent's woken."""
    write_agent(home, [turn("A1 is a kettle.")], name="kettle")
    agent = write_agent(
        home,
        [turn("Asking.", call("run_child", agent="kettle", input="Look up A1")), turn("Done.")],
        name="parent",
        tools=["run_child"],
        extra='[children]\nkettle = "kettle.toml"',
    )
    run = create_run(ctx, agent, INPUT, "golden-parent")
    drive(ctx, run.run_id)  # starts the child (its first turn goes to an unconsumed broker)
    child = child_run_id(run.run_id, "call_1_1")
    drive(ctx, child)
    deliver(ctx, child, _no_enqueue)
    drive(ctx, run.run_id)
    return child


def parent_woken(ctx: Context, home: Path) -> str:
    parent_and_child(ctx, home)
    return "golden-parent"


def _bounded_tree(ctx: Context, home: Path) -> str:
    """A self-starting agent in a tree one deep: each child's calls are refused there."""
    agent = write_agent(
        home,
        [turn("Again.", call("run_child", agent="me", input="go"),
              call("run_child", agent="me", input="go")),
         turn("Done.")],
        name="looper",
        tools=["run_child"],
        extra='max_child_depth = 1\nmax_tree_runs = 3\n[children]\nme = "looper.toml"',
    )  # fmt: skip
    run = create_run(ctx, agent, INPUT, "golden-tree")
    drive(ctx, run.run_id)
    for call_id in ("call_1_1", "call_1_2"):
        child = child_run_id(run.run_id, call_id)
        drive(ctx, child)
        deliver(ctx, child, _no_enqueue)
        drive(ctx, run.run_id)
    return run.run_id


def tree_bounded(ctx: Context, home: Path) -> str:
    """The root's log: run.created with its tree, run.woken with each child's tree_runs."""
    return _bounded_tree(ctx, home)


def tree_child(ctx: Context, home: Path) -> str:
    """A child's log: its tree one deep, its own run_child calls refused at the bound."""
    return child_run_id(_bounded_tree(ctx, home), "call_1_1")


def resume_refused(ctx: Context, home: Path) -> str:
    agent = write_agent(
        home,
        [turn("Which order?", call("request_user_input", prompt="Which order?"))],
        name="refused",
    )
    run = create_run(ctx, agent, "Refund my order.", "golden-resume-refused")
    drive(ctx, run.run_id)
    resume(ctx, run.run_id, OPERATOR)  # a suspended run waits for an answer, not a resume
    return run.run_id


PROBED_TOOLS = [
    "tests.probed_tools:effect",
    "tests.probed_tools:effect_unknown",
    "tests.probed_tools:timed_effect",
]


def parallel_tools(ctx: Context, home: Path) -> str:
    os.environ["RATCHET_TEST_TIMES"] = str(home / "times")
    calls = [
        call("timed_effect", label=x, sleep_s=s) for x, s in (("a", 0.3), ("b", 0.2), ("c", 0.1))
    ]
    agent = write_agent(
        home, [turn("Three at once.", *calls), turn("Done.")], name="parallel", tools=PROBED_TOOLS
    )
    run = create_run(ctx, agent, INPUT, "golden-parallel-tools")
    drive(ctx, run.run_id)  # outcomes journaled as they finish: c, b, a
    return run.run_id


def probed_parallel(ctx: Context, home: Path) -> str:
    os.environ["RATCHET_TEST_EFFECTS"] = str(home / "effects")
    labels = (("effect", "a"), ("effect", "b"), ("effect_unknown", "c"))
    agent = write_agent(
        home,
        [turn("Three at once.", *(call(t, label=x) for t, x in labels)), turn("Done.")],
        name="probed",
        tools=PROBED_TOOLS,
    )
    run = create_run(ctx, agent, INPUT, "golden-probed-parallel")
    # Given a worker that journaled three parallel calls, ran only the first, and died
    calls = [
        {"id": f"call_1_{i}", "name": t, "arguments": {"label": x}}
        for i, (t, x) in enumerate(labels, 1)
    ]
    responded = {"content": "Three at once.", "tool_calls": calls,
                 "usage": {"input_tokens": 10, "output_tokens": 5}}  # fmt: skip
    requested = [
        ("tool.requested", {"call_id": c["id"], "name": c["name"], "arguments": c["arguments"]})
        for c in calls
    ]
    owner = new_owner()
    assert ctx.runs.acquire_lease(run.run_id, owner, 10.0)
    append_events(
        ctx,
        _state(ctx, run.run_id),
        [("model.requested", {"turn": 0}), ("model.responded", responded), *requested],
        owner,
    )
    ctx.runs.release_lease(run.run_id, owner)
    key = idempotency_key(run.run_id, 1, "call_1_1")
    (home / "effects").write_text(f"{key} a\n")
    # When the next turn probes them: a ran, b did not, c cannot tell, so the run parks on c
    drive(ctx, run.run_id)
    # and once an operator records c, b is probed again and run
    reconcile(ctx, run.run_id, "call_1_3", "result", {"done": "c"}, enqueue=_no_enqueue)
    drive(ctx, run.run_id)
    return run.run_id


def _state(ctx: Context, run_id: str) -> RunState:
    state = rebuild(_events(ctx, run_id))
    assert state is not None
    return state


def throttled(ctx: Context, home: Path) -> str:
    """A second call over the agent's rate limit reserves its time and waits on the queue."""
    from store.limits.memory import MemoryLimitStore
    from tasks.limits import use_limit_store

    now = [1_000_000.0]
    use_limit_store(ctx, MemoryLimitStore(clock=lambda: now[0]))
    agent = write_agent(
        home,
        [
            turn("Looking it up.", call("lookup_order", order_id="B2")),
            turn("Order B2 is on its way."),
        ],
        name="throttled",
        extra='[limits]\nkey = "golden-key"\nrequests_per_minute = 60\nburst_s = 0.001',
    )
    run = create_run(ctx, agent, INPUT, "golden-throttled")
    done = advance(ctx, run.run_id, None)  # the first call goes, its tool runs
    done = advance(ctx, run.run_id, done.seq)  # the second is a second too soon
    assert done.outcome == "next" and done.countdown_s > 0, done
    now[0] += done.countdown_s * 1000  # the broker's countdown, run out
    done = drive(ctx, run.run_id)
    assert done.outcome == "completed", done
    return run.run_id


def refused_429(ctx: Context, home: Path) -> str:
    """A 429 gives its request back and the turn waits out Retry-After on the queue."""
    import os

    from tests.openai_server import serve

    os.environ["GOLDEN_OPENAI_API_KEY"] = "sk-golden-not-a-secret"
    with serve() as server:
        server.enqueue(429, {"error": {"message": "Rate limit reached"}}, {"Retry-After": "0"})
        server.enqueue_fixture("text_answer")
        path = home / "refused.toml"
        path.write_text(
            "\n".join(
                [
                    'name = "refused"',
                    'model = "openai:gpt-test"',
                    "tools = []",
                    "[provider]",
                    f'base_url = "{server.url}"',
                    'api_key_env = "GOLDEN_OPENAI_API_KEY"',
                ]
            )
            + "\n"
        )
        run = create_run(ctx, path, INPUT, "golden-refused-429")
        done = drive(ctx, run.run_id)
        assert done.outcome == "completed", done
    return run.run_id


def mcp_unsent(ctx: Context, home: Path) -> str:
    from tests.test_mcp_tools import HttpServer, free_port

    # An MCP server listed at load, then down when the call is sent: the run stalls with
    # nothing sent, and once the server is back a resume sends the call
    server = HttpServer(free_port(), home / "ledger").start()
    try:
        agent = write_agent(
            home,
            [
                turn("Asking.", call("request_user_input", prompt="Refund B2?")),
                turn("Refunding.", call("issue_refund", order_id="B2", amount_cents=2900)),
                turn("Refunded."),
            ],
            name="mcp-unsent",
            tools=["mcp:billing/issue_refund", "request_user_input"],
            extra=server.table("billing"),
        )
        run = create_run(ctx, agent, INPUT, "golden-mcp-unsent")
        done = drive(ctx, run.run_id)
        server.stop()
        answer = make_continuation(run.run_id, "golden-m1", input="yes", suspension_seq=done.seq)
        apply_continuation(ctx, answer, _no_enqueue)
        drive(ctx, run.run_id)
        server.start()
        resume(ctx, run.run_id, OPERATOR)
        drive(ctx, run.run_id)
    finally:
        server.stop()
    return run.run_id


SCENARIOS: dict[str, Callable[[Context, Path], str]] = {
    "tools-and-answer": tools_and_answer,
    "ask-and-continue": ask_and_continue,
    "approvals": approval_denied_then_approved,
    "blocked-cancelled": blocked_then_cancelled,
    "expired": suspension_expired,
    "parked-reconciled": parked_reconciled,
    "dead-lettered": dead_lettered,
    "budget-failed": budget_failed_and_model_timeout,
    "provider-stalled-resumed": provider_stalled_resumed,
    "forked": forked,
    "budget-raised": budget_raised,
    "waited": waited,
    "child-told": parent_and_child,
    "parent-woken": parent_woken,
    "resume-refused": resume_refused,
    "throttled": throttled,
    "refused-429": refused_429,
    "parallel-tools": parallel_tools,
    "probed-parallel": probed_parallel,
    "tree-bounded": tree_bounded,
    "tree-child": tree_child,
    "mcp-unsent": mcp_unsent,
}


def main() -> None:
    from tasks.messages import send_through
    from tasks.settings import Settings
    from worker.app import make_app

    send_through(make_app(Settings(broker_url="memory://")))  # the scenarios' enqueues go nowhere
    EVENTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d")
    for name, scenario in SCENARIOS.items():
        with tempfile.TemporaryDirectory() as home:
            ctx = memory_context()
            run_id = scenario(ctx, Path(home))
            events = _events(ctx, run_id)
        state = None
        for event in events:
            state = apply(state, event)
        assert state is not None
        base = EVENTS / f"{stamp}-{name}"
        if base.with_suffix(".jsonl").exists():
            print(f"{base.name}: exists, left as it is")
            continue
        lines = [json.dumps(e.model_dump(mode="json"), sort_keys=True) for e in events]
        base.with_suffix(".jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (EVENTS / f"{base.name}.state.json").write_bytes(snapshot_format.encode(state))
        kinds = sorted({e.type for e in events})
        print(f"{base.name}: {len(events)} events, ends {state.status.value}: {', '.join(kinds)}")


if __name__ == "__main__":
    main()
