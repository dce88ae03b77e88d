"""Every error ratchet raises names the run (where there is one) and the next step.

One case per class of ``runtime.errors``, built with representative arguments: its
message must name the run id and say what to do next, survive Celery's pickling of a
task failure unchanged, and never show a password.
"""

from __future__ import annotations

import inspect
import pickle

import pytest

from runtime import errors
from runtime.errors import (
    AgentFileError,
    BindingChanged,
    BudgetExhausted,
    BudgetUnenforceable,
    EventsDoNotFold,
    HolderDied,
    InvalidContinuation,
    InvalidInput,
    InvalidOption,
    InvalidRequest,
    InvalidRunId,
    LeaseHeld,
    LeaseLost,
    MalformedContinuation,
    MessageRefused,
    RatchetError,
    RejectedEntryNotFound,
    RunMoving,
    RunNotFound,
    RunNotQueued,
    RunStateLost,
    SnapshotFailed,
    SnapshotMalformed,
    SnapshotTooLarge,
    SnapshotUnsupportedVersion,
    SnapshotWrongKind,
    StaleWrite,
    StartConflict,
    StoreBusy,
    StoreUnavailable,
    StoreUrlInvalid,
    SuspensionAlreadyAnswered,
    SuspensionExpired,
    SuspensionMismatch,
    ToolError,
)
from store import open_run_store, open_snapshot_store
from tests.redis_server import HOST, _free_port

RUN = "refund-7f3a"

# (the error, the run id its message must name or None when there is no run, the next step)
CASES: dict[str, tuple[RatchetError, str | None, str]] = {
    "AgentFileError": (
        AgentFileError("examples/desk.toml", "model", "unknown provider `x`"),
        None,
        "fix the agent file, then run the command again",
    ),
    "ToolError": (
        ToolError("tools.refunds:issue", "parameter `amount` needs a type hint"),
        None,
        "fix the tool or the agent file's `tools`",
    ),
    "BudgetExhausted": (
        BudgetExhausted(RUN, "max_turns", 3, 3),
        RUN,
        f"`ratchet runs budget {RUN} --max-turns +N --reason WHY`",
    ),
    "BudgetUnenforceable": (
        BudgetUnenforceable(RUN, "max_total_tokens", 2),
        RUN,
        "use a provider that reports usage or remove the budget, then start a new run",
    ),
    "InvalidInput": (
        InvalidInput("input is empty or blank"),
        None,
        "correct it and start the run again",
    ),
    "InvalidRequest": (
        InvalidRequest("`max_turns` is 3: 2 would not raise it", RUN),
        RUN,
        "correct it and try again",
    ),
    "InvalidOption": (
        InvalidOption("--older-than '10x' is not an age: a number and one of s, m, h, d, w"),
        None,
        "correct it and try again",
    ),
    "InvalidRunId": (InvalidRunId("../etc"), None, "use the id `ratchet runs start` printed"),
    "RunNotFound": (RunNotFound(RUN), RUN, "`ratchet runs list`"),
    "SuspensionAlreadyAnswered": (
        SuspensionAlreadyAnswered(RUN, "running", 5, "c-1"),
        RUN,
        f"`ratchet runs show {RUN}`",
    ),
    "SuspensionMismatch": (
        SuspensionMismatch(RUN, "needs_user_input", 4, 9),
        RUN,
        f"`ratchet runs show {RUN}`",
    ),
    "SuspensionExpired": (SuspensionExpired(RUN, 120, 60), RUN, "start a new run"),
    "InvalidContinuation": (
        InvalidContinuation(RUN, "the answer is blank"),
        RUN,
        f"correct the answer and send it again (`ratchet runs show {RUN}`",
    ),
    "MalformedContinuation": (
        MalformedContinuation("`run_id` is missing"),
        None,
        "send the answer again as a JSON object like",
    ),
    "BindingChanged": (
        BindingChanged(RUN, "refund-desk", "the model changed"),
        RUN,
        "start the run again",
    ),
    "RunStateLost": (
        RunStateLost(RUN, "its event log is empty"),
        RUN,
        f"`ratchet runs events {RUN}`",
    ),
    "EventsDoNotFold": (
        EventsDoNotFold(RUN, 6, "run.woken, but the run is not waiting"),
        RUN,
        f"`ratchet runs events {RUN}`",
    ),
    "SnapshotMalformed": (
        SnapshotMalformed(f"snapshot of run {RUN}", "not JSON"),
        RUN,
        "rebuilds the run from its events",
    ),
    "SnapshotWrongKind": (
        SnapshotWrongKind(f"/data/snapshots/{RUN}.json", "invoice", "ratchet.snapshot"),
        RUN,
        "point the snapshot store at ratchet's snapshot directory",
    ),
    "SnapshotUnsupportedVersion": (
        SnapshotUnsupportedVersion(f"/data/snapshots/{RUN}.json", 9, "1 and 2"),
        RUN,
        "upgrade ratchet on this worker",
    ),
    "SnapshotTooLarge": (SnapshotTooLarge(RUN, 9_000_000, 8_000_000), RUN, "lower max_turns"),
    "StoreUrlInvalid": (
        StoreUrlInvalid("sqlite://host/runs.db", "use three slashes for a path"),
        None,
        "correct the setting (RATCHET_SNAPSHOT_STORE, RATCHET_RUN_STORE",
    ),
    "StoreUnavailable": (
        StoreUnavailable("run store redis://127.0.0.1:6379/0", "Connection refused", RUN),
        RUN,
        f"check that it is running and reachable, then `ratchet runs resume {RUN}`",
    ),
    "StoreBusy": (
        StoreBusy("snapshot store redis://127.0.0.1:6379/0", 2, 0.3, RUN),
        RUN,
        "add `?max_connections=N` to the store URL",
    ),
    "StaleWrite": (StaleWrite(RUN, 4, 5), RUN, "nothing to do: the newer write stands"),
    "LeaseLost": (
        LeaseLost(RUN, "host-1:4242:ab"),
        RUN,
        "nothing to do: the lease holder, or the sweeper after it, carries the run on",
    ),
    "NotReplicated": (
        errors.NotReplicated(RUN, "run store redis://ana:hunter2@127.0.0.1:6379/0", 0, 1, 1000),
        RUN,
        f"bring the replicas back (`INFO replication` on the primary lists them), then "
        f"`ratchet runs resume {RUN}`",
    ),
    "SnapshotFailed": (
        SnapshotFailed(RUN, 7, "disk full"),
        RUN,
        f"fix the store, then `ratchet runs resume {RUN}`",
    ),
    "RejectedEntryNotFound": (
        RejectedEntryNotFound("1700000000000-0"),
        None,
        "`ratchet rejected list` shows the ids",
    ),
    "StartConflict": (StartConflict(RUN, "input"), RUN, f"`ratchet runs show {RUN}`"),
    "LeaseHeld": (
        LeaseHeld(RUN, "host-1:4242:ab/1", 0.5, True, 12.0),
        RUN,
        f"`ratchet runs events {RUN} --follow`",
    ),
    "RunMoving": (RunMoving(RUN, 5), RUN, "try again in a moment"),
    "HolderDied": (
        HolderDied(RUN, "host-1:4242:ab/1", "running"),
        RUN,
        f"`ratchet runs show {RUN}`",
    ),
    "MessageRefused": (
        MessageRefused("ratchet.turn", "argument `seq` is missing"),
        None,
        "correct the message",
    ),
    "RunNotQueued": (
        RunNotQueued(RUN, "the broker is down"),
        RUN,
        f"`ratchet runs cancel {RUN}`",
    ),
    "AnswerNotQueued": (
        errors.AnswerNotQueued(RUN, 7, "the broker is down"),
        RUN,
        f"`ratchet runs resume {RUN}`",
    ),
    "ClockSkewed": (
        errors.ClockSkewed(-90_000, 60.0, "Redis TIME"),
        None,
        "sync this host's clock",
    ),
}

EXEMPT = {
    # Their message is written whole by whoever raises them; the tests of that code check it.
    "RatchetError": "the root",
    "BudgetError": "abstract: only its two subclasses are raised",
    "SnapshotError": "abstract: only its subclasses are raised",
    "StoreError": "a backend's own message (a refused command), always masked",
    "ProviderError": "the provider's message; the turn adds the run and the next step",
    "ProviderRateLimited": "never shown: the turn waits on the queue",
    "ConfigInvalid": "one line a setting's check writes, naming the variable and the fix",
    "ExtraMissing": "no run in scope: a command's missing extra, named with its install line",
    # Owned by the lease work (h/lease), which rewrites what they say.
    "RunRefused": "its reason is the caller's",
    "RunBusy": "rewritten with the lease",
    # A worker-wide fault, found while loading an agent that many runs share.
    "ToolModuleChanged": "no run in scope where it is raised",
    # Why a value cannot be stored: the boundary that checks it (a tool's result, a model's
    # arguments) or the store that refuses it writes the sentence around it.
    "NotStorable": "a clause for another message: tests/test_json_values.py checks it",
    # A tool call that never left the worker: the turn stalls with a reason naming the tool
    # and the server (tests/test_mcp_tools.py checks that line).
    "CallNotSent": "abstract: its MCP subclass names the server; the stall names the run",
}


def test_every_error_class_has_a_case_or_a_reason_not_to() -> None:
    classes = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, RatchetError)
    }
    assert classes - set(CASES) - set(EXEMPT) == set()
    assert set(CASES) & set(EXEMPT) == set()
    for name, (error, _, _) in CASES.items():
        assert type(error).__name__ == name


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_message_names_the_run_and_the_next_step(name: str) -> None:
    error, run_id, next_step = CASES[name]
    message = str(error)
    if run_id is not None:
        assert run_id in message
    assert next_step in message
    # What Celery does to a task's failure: the same error comes out the other side.
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == message


def test_a_store_error_for_a_run_names_it_after_a_retry_and_through_pickling() -> None:
    unnamed = StoreBusy("snapshot store redis://127.0.0.1:1/0", 4, 0.5)
    named = unnamed.for_run(RUN)
    assert type(named) is StoreBusy and str(named).startswith(f"run {RUN}: ")
    assert named.max_connections == 4 and named.run_id == RUN
    assert RUN not in str(unnamed)
    assert pickle.loads(pickle.dumps(named)).run_id == RUN


def test_a_password_in_a_store_url_is_never_shown() -> None:
    # Whatever a backend puts in the message, the URL's password is masked
    error = StoreUnavailable(
        "run store redis://ratchet:hunter2@127.0.0.1:6379/0",
        "AUTH failed for rediss://:hunter2@10.0.0.1/1?password=hunter2&db=1",
        RUN,
    )
    message = str(error)
    assert "hunter2" not in message
    assert "redis://ratchet:***@127.0.0.1:6379/0" in message and "password=***" in message
    assert "hunter2" not in str(pickle.loads(pickle.dumps(error)))
    # nor in what pickling carries, nor in the attributes a log formatter may read
    assert b"hunter2" not in pickle.dumps(error)
    assert "hunter2" not in error.store + error.problem


def test_a_sentinels_password_in_a_store_url_is_never_shown() -> None:
    error = StoreUrlInvalid(
        "redis+sentinel://h1,h2/svc/x?sentinel_password=hunter2", "database `x` is not a number"
    )

    assert "hunter2" not in str(error)
    assert "sentinel_password=***" in str(error)


def test_domain_refusals_are_ratchet_errors_and_still_value_errors() -> None:
    for name in ("InvalidRequest", "EventsDoNotFold", "StoreUrlInvalid"):
        error = CASES[name][0]
        assert isinstance(error, RatchetError) and isinstance(error, ValueError)
    assert issubclass(errors.NotStorable, ValueError)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://host/runs.db",
        "postgres://ana:hunter2@127.0.0.1/db",
        "redis://ana:hunter2@127.0.0.1:1/0?max_connections=zero",
    ],
)
def test_a_store_url_no_backend_opens_is_a_ratchet_error_without_its_password(url: str) -> None:
    # What the CLI prints as a one-line refusal: a ValueError it would not catch
    with pytest.raises(StoreUrlInvalid) as refused:
        open_run_store(url)
    assert "hunter2" not in str(refused.value) and "correct the setting" in str(refused.value)
    assert b"hunter2" not in pickle.dumps(refused.value)


@pytest.mark.parametrize("kind", ["run store", "snapshot store"])
def test_a_redis_store_that_cannot_be_reached_names_the_run_and_hides_the_password(
    kind: str,
) -> None:
    # Given a Redis store URL with a password, on a port where no server listens
    url = f"redis://ratchet:hunter2@{HOST}:{_free_port()}/0"
    # When a call for one run fails after its retries
    with pytest.raises(StoreUnavailable) as refused:
        if kind == "run store":
            runs = open_run_store(url)
            try:
                runs.get(RUN)
            finally:
                runs.close()
        else:
            snapshots = open_snapshot_store(url)
            try:
                snapshots.load(RUN)
            finally:
                snapshots.close()
    # Then the message names the run and the way on, and not the password
    message = str(refused.value)
    assert message.startswith(f"run {RUN}: ") and f"`ratchet runs resume {RUN}`" in message
    assert "hunter2" not in message and "ratchet:***@" in message


def test_a_setting_read_outside_the_settings_model_is_a_config_invalid_naming_it() -> None:
    from runtime.errors import ConfigInvalid
    from tasks import failpoints, tracing

    for value in ("bogus", "tool.requested@x"):
        with pytest.raises(ConfigInvalid) as refused:
            failpoints._parse(value)
        assert refused.value.variable == "RATCHET_FAILPOINT" and "or unset it" in str(refused.value)
    for name in ("no-colon", "no_such_module_here:factory"):
        with pytest.raises(ConfigInvalid) as refused:
            tracing._exporter(name)
        assert refused.value.variable == "RATCHET_OTEL_EXPORTER"
        assert "give otlp, console or module:callable" in str(refused.value)
