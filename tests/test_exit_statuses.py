"""Every command's exit status on a bad option, argument or setting, against the README.

A bad option, argument or setting exits 2 on every command, as the README's "Exit
statuses" table (:data:`worker.exits.MEANINGS`, held to the README by tests/test_docs.py)
says. The commands
come from click's own command tree, so a new command is covered as soon as it is
registered; each of its parameters must be typed (click refuses a bad value), or name
its bad values here, or be listed as free text — a new parameter that is none of these
fails :func:`test_every_parameter_is_checked_here`. Commands run in-process (click's
``CliRunner``) against a memory store holding one suspended run; a bad setting, which
is refused as the command's app is built, runs each command as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from store.runs.memory import MemoryRunStore
from store.snapshots.memory import MemorySnapshotStore
from tasks.context import Context, set_context
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, drive, turn, write_agent
from worker.cli import main
from worker.exits import Exit

ROOT = Path(__file__).resolve().parents[1]
RUN = "run-1"


def leaf_commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[
    tuple[tuple[str, ...], click.Command]
]:  # fmt: skip
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from leaf_commands(command, (*path, name))
        else:
            yield (*path, name), command


COMMANDS = dict(leaf_commands(main))


def groups(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[
    tuple[tuple[str, ...], click.Group]
]:  # fmt: skip
    yield path, group
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from groups(command, (*path, name))


GROUPS = dict(groups(main))

# A well-formed value for each argument and required option, by parameter name.
VALID = {
    "agent_file": str(ROOT / "examples" / "refund-desk.toml"),
    "run_id": RUN,
    "call_id": "call-1",
    "key": "tenant-a",
    "places": "2",
    "entry_id": "e1",
    "text": "refund B2",
    "reason": "a reason",
}
# Bad values of the text parameters that parse theirs, by parameter name: kind → value.
# ``{agents}`` is the directory of the broken agent files (see ``agents``).
BAD = {
    "agent_file": {
        "missing-file": "{agents}/missing.toml",
        "not-toml": "{agents}/not-toml.toml",
        "unknown-key": "{agents}/unknown-key.toml",
        "missing-tool": "{agents}/missing-tool.toml",
    },
    "run_id": {"not-a-run-id": "not a run id!"},
    "new_run_id": {"not-a-run-id": "not a run id!"},
    "since": {"not-a-date": "yesterday"},
    "cursor": {"not-a-cursor": "garbage"},
    "after": {"not-a-cursor": "12.x; rm"},
    "before": {"not-a-date": "someday"},
    "older_than": {"not-an-age": "10x"},
    "result_json": {"not-json": "not json"},
    "max_turns": {"not-a-raise": "lots"},
    "max_total_tokens": {"not-a-raise": "-5"},
    "max_tool_calls": {"not-a-raise": "0"},
    "timeout_seconds": {"not-a-raise": "1.5"},
    "key": {"not-a-key": "bad key!"},
    "app_name": {"no-such-module": "no_such_module_of_anyones", "no-such-app": "json:nothing"},
}
# Text taken as it is: an input, a reason, a name, an id looked up as given.
FREE_TEXT = {
    "text", "idempotency_key", "agent", "deny", "reason", "by", "fail_reason", "call_id",
    "continuation_id", "entry_id", "host",
}  # fmt: skip
# Options that cannot be given together, or one of which is needed: (command, args).
COMBINATIONS = [
    (("runs", "reconcile"), [RUN, "call-1"]),
    (("runs", "reconcile"), [RUN, "call-1", "--retry", "--fail", "gone"]),
    (("runs", "reconcile"), [RUN, "call-1", "--result", "{}", "--retry"]),
    (("runs", "purge"), []),
    (("runs", "purge"), ["--before", "2025-01-31", "--older-than", "7d"]),
    (("runs", "budget"), [RUN, "--reason", "more"]),
    (("runs", "budget"), [RUN, "--max-turns", "+5", "--reason", " "]),
    (("runs", "continue"), [RUN]),
    (("runs", "continue"), [RUN, "--input", "B2", "--approve"]),
    (("runs", "continue"), [RUN, "--input", " "]),
    (("runs", "start"), [VALID["agent_file"], "--input", ""]),
    (("limits", "set"), ["tenant-a"]),
]


@pytest.fixture
def agents(tmp_path: Path) -> Path:
    (tmp_path / "not-toml.toml").write_text("name = \n")
    write_agent(tmp_path, [turn("Done.")], name="unknown-key", extra='colour = "red"')
    write_agent(tmp_path, [turn("Done.")], name="missing-tool", tools=["no_such.module:fn"])
    return tmp_path


@pytest.fixture
def store(tmp_path: Path, agents: Path, ledger: Path) -> Iterator[Context]:
    """A memory context holding run-1, suspended on a question: lookups find it."""
    ctx = Context(Settings(), MemorySnapshotStore(), MemoryRunStore())
    asks = write_agent(
        tmp_path / "asks", [turn("Which?", call("request_user_input", prompt="Which?"))]
    )
    create_run(ctx, asks, "refund", RUN)
    assert drive(ctx, RUN).outcome == "suspended"
    set_context(ctx)
    try:
        yield ctx
    finally:
        set_context(None)


def invoke(path: tuple[str, ...], args: list[str]) -> Result:
    return CliRunner().invoke(main, [*path, *args])


def valid_args(command: click.Command, leave_out: str | None = None) -> list[str]:
    """The command's required parameters, well formed (all but ``leave_out``)."""
    args: list[str] = []
    for param in command.params:
        if not param.required or param.name == leave_out:
            continue
        assert param.name in VALID, f"no valid value for {param.name}: add one to VALID"
        if isinstance(param, click.Argument):
            args.append(VALID[param.name])
        else:
            args += [param.opts[0], VALID[param.name]]
    return args


def with_value(command: click.Command, param: click.Parameter, value: str) -> list[str]:
    rest = valid_args(command, leave_out=param.name)
    if isinstance(param, click.Argument):
        # Arguments go in their declared order.
        arguments = [p for p in command.params if isinstance(p, click.Argument) and p.required]
        given = iter(a for a in rest[: len(arguments) - (param in arguments)])
        ordered = [value if p is param else next(given) for p in arguments]
        return [*ordered, *rest[len(arguments) - (param in arguments) :]]
    return [*rest, param.opts[0], value]


def typed_bad_values(param: click.Parameter) -> dict[str, str]:
    """Values click itself must refuse for a typed parameter; {} for text and flags."""
    kind = param.type
    if getattr(param, "is_flag", False) or isinstance(kind, click.types.StringParamType):
        return {}
    bad = {"not-a-value": "many"}
    if isinstance(kind, click.IntRange | click.FloatRange) and kind.min is not None:
        bad["below-range"] = str(kind.min - 1)
    if isinstance(kind, click.IntRange | click.FloatRange) and kind.max is not None:
        bad["above-range"] = str(kind.max + 1)
    return bad


def bad_cases() -> Iterator[tuple[str, tuple[str, ...], str, str]]:
    for path, command in COMMANDS.items():
        for param in command.params:
            assert param.name is not None
            values = {**typed_bad_values(param), **BAD.get(param.name, {})}
            for kind, value in values.items():
                yield f"{' '.join(path)}-{param.name}-{kind}", path, param.name, value


CASES = list(bad_cases())


def assert_usage(result: Result, what: str) -> None:
    assert result.exit_code == Exit.USAGE, f"{what}: exit {result.exit_code}\n{result.output}"
    assert isinstance(result.exception, SystemExit), f"{what}: {result.exception!r}"
    lines = [line for line in result.output.splitlines() if line.startswith(("ratchet:", "Error:"))]
    assert len(lines) == 1, f"{what}: not one line that says why:\n{result.output}"


def test_every_parameter_is_checked_here() -> None:
    for path, command in [*COMMANDS.items(), *GROUPS.items()]:
        for param in command.params:
            typed = bool(typed_bad_values(param)) or getattr(param, "is_flag", False)
            assert typed or param.name in BAD or param.name in FREE_TEXT, (
                f"`ratchet {' '.join(path)}` {param.name}: name its bad values in BAD, "
                "or list it in FREE_TEXT"
            )


@pytest.mark.parametrize(("case", "path", "name", "value"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_value_exits_2(
    store: Context, agents: Path, case: str, path: tuple[str, ...], name: str, value: str
) -> None:
    command = COMMANDS[path]
    param = next(p for p in command.params if p.name == name)
    before = store.runs.events(RUN)
    result = invoke(path, with_value(command, param, value.format(agents=agents)))
    assert_usage(result, case)
    assert store.runs.events(RUN) == before  # refused before anything changed


def group_cases() -> Iterator[tuple[str, tuple[str, ...], str, str]]:
    for path, group in GROUPS.items():
        for param in group.params:
            assert param.name is not None
            values = {**typed_bad_values(param), **BAD.get(param.name, {})}
            for kind, value in values.items():
                yield f"{' '.join(path) or 'ratchet'}-{param.name}-{kind}", path, param.name, value


GROUP_CASES = list(group_cases())


@pytest.mark.parametrize(
    ("case", "path", "name", "value"), GROUP_CASES, ids=[c[0] for c in GROUP_CASES]
)
def test_a_bad_value_of_a_group_option_exits_2(
    store: Context, case: str, path: tuple[str, ...], name: str, value: str
) -> None:
    # The group's option, then the first of its commands, well formed
    group = GROUPS[path]
    param = next(p for p in group.params if p.name == name)
    leaf = next(p for p in COMMANDS if p[: len(path)] == path)
    args = [*path, param.opts[0], value, *leaf[len(path) :], *valid_args(COMMANDS[leaf])]
    assert_usage(CliRunner().invoke(main, args), case)


@pytest.mark.parametrize("path", list(COMMANDS), ids=[" ".join(p) for p in COMMANDS])
def test_an_unknown_option_and_a_missing_argument_exit_2(
    store: Context, path: tuple[str, ...]
) -> None:
    command = COMMANDS[path]
    assert_usage(invoke(path, [*valid_args(command), "--no-such-option"]), "unknown option")
    for param in command.params:
        if param.required:
            assert_usage(invoke(path, valid_args(command, leave_out=param.name)), param.name)


@pytest.mark.parametrize(
    ("path", "args"), COMBINATIONS, ids=[" ".join([*p, *a]) for p, a in COMBINATIONS]
)
def test_options_that_do_not_combine_exit_2(
    store: Context, path: tuple[str, ...], args: list[str]
) -> None:
    before = store.runs.events(RUN)
    assert_usage(invoke(path, args), " ".join([*path, *args]))
    assert store.runs.events(RUN) == before


@pytest.mark.parametrize(
    ("variable", "value"),
    [("RATCHET_CONSOLE_TOKEN", None), ("RATCHET_CONSOLE_TOKEN", "short"),
     ("RATCHET_CONSOLE_PORT", "http")],
    ids=["token-missing", "token-short", "port-not-a-number"],
)  # fmt: skip
def test_the_console_refuses_a_bad_setting_with_2(
    store: Context, monkeypatch: pytest.MonkeyPatch, variable: str, value: str | None
) -> None:
    monkeypatch.setenv("RATCHET_CONSOLE_TOKEN", "a-long-enough-console-secret")
    if value is None:
        monkeypatch.delenv(variable)
    else:
        monkeypatch.setenv(variable, value)
    result = invoke(("console",), [])
    assert_usage(result, variable)
    assert variable in result.output


def test_the_console_without_its_extra_exits_2(
    store: Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_CONSOLE_TOKEN", "a-long-enough-console-secret")
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
    result = invoke(("console",), [])
    assert_usage(result, "no console extra")
    assert "pip install 'ratchet[console]'" in result.output


# Runs every command once in a child forked from one process that has imported what
# ratchet's app needs but not the app (which reads the settings as it is built), so each
# command pays for its own start, not for Python's and Celery's imports.
FORKED_COMMANDS = """
import json, os, runpy, sys
import celery, celery.app.task, celery.worker, click, kombu, kombu.transport.redis, pydantic, redis
import runtime, runtime.tools, store, store.runs.sqlite, tasks.messages
statuses = {}
for line in sys.stdin:
    argv = json.loads(line)
    err = os.path.join(sys.argv[1], str(len(statuses)))
    pid = os.fork()
    if pid == 0:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.argv = ["ratchet", *argv]
        try:
            runpy.run_module("worker", run_name="__main__")
        except SystemExit as exc:
            os._exit(exc.code if isinstance(exc.code, int) else 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    with open(err) as f:
        statuses[" ".join(argv)] = [os.waitstatus_to_exitcode(status), f.read()]
print(json.dumps(statuses))
"""


@pytest.mark.timeout(120)
def test_a_bad_setting_exits_2_on_every_command(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(RATCHET_LEASE_S="soon", RATCHET_DATA_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    commands = [[*path, *valid_args(command)] for path, command in COMMANDS.items()]
    ran = subprocess.run(
        [sys.executable, "-c", FORKED_COMMANDS, str(tmp_path)],
        input="".join(json.dumps(argv) + "\n" for argv in commands),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    statuses = json.loads(ran.stdout)
    assert len(statuses) == len(COMMANDS)
    for command, (status, stderr) in statuses.items():
        assert status == Exit.USAGE, f"ratchet {command}: exit {status}: {stderr}"
        assert stderr.count("\n") == 1 and "RATCHET_LEASE_S" in stderr, f"{command}: {stderr}"
