"""Hostile and broken agent files: only AgentFileError escapes, naming the file and the key.

Also what a tool may be (a plain function of one's own, not the standard library's),
where a script may live, and that no error quotes a file's contents. Hypothesis
fuzzes the loader and the plain-JSON continuation parser with a fixed seed
(``derandomize``) and a bounded number of examples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.continuation import parse_message
from runtime.errors import AgentFileError, MalformedContinuation
from runtime_io.agent_files import load_agent
from tests.helpers import turn, write_agent

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
SECRET_TEXT = "TOP-SECRET db_password=hunter2"


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "RATCHET_STDLIB_TOOLS",
        "RATCHET_ALLOW_OUTSIDE_SCRIPTS",
        "RATCHET_OPENAI_KEY_VARIABLES",
        "RATCHET_OPENAI_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)


def refused(path: Path) -> AgentFileError:
    with pytest.raises(AgentFileError) as caught:
        load_agent(path)
    message = str(caught.value)
    assert str(path) in message, message
    assert "\n" not in message, message
    return caught.value


def agent_with(directory: Path, extra: str = "", tools: list[str] | None = None) -> Path:
    return write_agent(directory, [turn("x")], tools=tools or ["blocked"], extra=extra)


# --- 10: every failure is an AgentFileError naming the file and the key ----------------


@pytest.mark.parametrize(
    ("tools", "key", "problem"),
    [
        ([".:x"], "tools[0]", "expected `module:function`"),
        (["examples.refunds:tool"], "tools[0]", "ratchet's own"),
        (["httpx:get"], "tools[0]", "type hints cannot be evaluated"),
        (["tests.hostile_tools:callback"], "tools[0]", "cannot be described as JSON schema"),
        (["tests.hostile_tools:unknown_hint"], "tools[0]", "NameError"),
    ],
)
def test_a_tool_that_cannot_be_declared_is_refused_naming_its_index(
    tmp_path: Path, tools: list[str], key: str, problem: str
) -> None:
    error = refused(agent_with(tmp_path, tools=tools))
    assert error.key == key and problem in error.problem


def test_a_tool_whose_schema_fails_is_refused_even_when_allowlisted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `examples.refunds:tool` is the decorator: its TypeVar-typed parameter has no schema.
    monkeypatch.setenv("RATCHET_STDLIB_TOOLS", "examples.refunds:tool")
    error = refused(agent_with(tmp_path, tools=["examples.refunds:tool"]))
    assert error.key == "tools[0]" and "JSON schema" in error.problem


def test_a_file_that_is_not_utf8_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_bytes(b'name = "caf\xe9"\nmodel = "scripted"\n')
    error = refused(path)
    assert error.key == "" and "not UTF-8" in error.problem


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("a = " + "[" * 5000 + "]" * 5000, ""),
        ("budgets = {max_turns = " + "9" * 5000 + "}", ""),
        ('name = "x"\nmodel = "scripted"\nscript = "s.json"\nmodel_timeout_s = inf\n', None),
        ('name = "x"\nmodel = "scripted"\nscript = "s.json"\ntool_timeout_s = nan\n', None),
        ('name = "x"\nmodel = "scripted"\nscript = "s.json"\nmodel_timeout_s = 1e300\n', None),
    ],
    ids=["deep-nesting", "huge-integer", "infinite-timeout", "nan-timeout", "huge-timeout"],
)
def test_a_malformed_value_is_refused_at_load_not_later(
    tmp_path: Path, text: str, key: str | None
) -> None:
    (tmp_path / "s.json").write_text('{"turns": []}')
    path = tmp_path / "agent.toml"
    path.write_text(text)
    error = refused(path)
    if key is not None:
        assert error.key == key
    else:
        assert error.key in {"model_timeout_s", "tool_timeout_s"}


def test_an_unparseable_base_url_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('name = "x"\nmodel = "openai:gpt"\n[provider]\nbase_url = "http://[::1"\n')
    error = refused(path)
    assert error.key == "provider" and "base_url" in error.problem


@pytest.mark.timeout(60)
def test_the_cli_refuses_an_unparseable_base_url_in_one_line(tmp_path: Path) -> None:
    # Given an agent file whose base_url httpx cannot parse
    path = tmp_path / "agent.toml"
    path.write_text('name = "x"\nmodel = "openai:gpt"\n[provider]\nbase_url = "http://[::1"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(RATCHET_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=str(ROOT))
    # When an operator starts a run with it
    done = subprocess.run(
        [sys.executable, "-m", "worker", "runs", "start", str(path), "--input", "hi"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    # Then the CLI says so in one line, with no traceback
    assert done.returncode == 2, done.stderr  # a bad agent file: README's exit table
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(path) in lines[0] and "base_url" in lines[0]


def test_a_directory_or_a_fifo_as_agent_file_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "dir.toml"
    directory.mkdir()
    assert "" == refused(directory).key
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    assert "not a regular file" in refused(fifo).problem


# --- 12: what a tool may be -----------------------------------------------------------


@pytest.mark.parametrize(
    ("reference", "problem"),
    [
        ("os:abort", "standard library"),
        ("os:fork", "standard library"),
        ("os:setsid", "standard library"),
        ("os:getcwd", "standard library"),
        ("builtins:print", "standard library"),
        ("subprocess:run", "standard library"),
        ("tests.hostile_tools:Refund", "a class, not a function"),
        ("tests.hostile_tools:cwd", "a builtin or C function"),
        ("tests.hostile_tools:join", "standard library"),
        ("tests.hostile_tools:half", "not a function"),
        ("worker.cli:main", "ratchet's own"),
    ],
)
def test_only_a_plain_function_of_ones_own_is_a_tool(
    tmp_path: Path, reference: str, problem: str
) -> None:
    error = refused(agent_with(tmp_path, tools=[reference]))
    assert error.key == "tools[0]" and problem in error.problem
    assert "a tool must be a plain Python function" in error.problem


def test_the_operator_may_allowlist_a_refused_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_STDLIB_TOOLS", "runtime.agent:canonical_json")
    agent = load_agent(agent_with(tmp_path, tools=["runtime.agent:canonical_json"]))
    assert "canonical_json" in agent.tools
    # Allowlisting says "this package is fine", not "this is a function": a builtin stays out.
    monkeypatch.setenv("RATCHET_STDLIB_TOOLS", "os:getcwd")
    assert "a builtin or C function" in refused(agent_with(tmp_path, tools=["os:getcwd"])).problem


def test_a_function_of_ones_own_still_loads(tmp_path: Path) -> None:
    agent = load_agent(agent_with(tmp_path, tools=["tests.hostile_tools:typed"]))
    assert agent.tools["typed"].parameters["required"] == ["order_id"]


# --- 13: scripts stay beside the agent, errors never quote files ----------------------


@pytest.fixture
def secret_file() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as outside:
        path = Path(outside) / "secret"
        path.write_text(SECRET_TEXT + "\n")
        yield path


def test_a_script_outside_the_agents_directory_is_refused(
    tmp_path: Path, secret_file: Path
) -> None:
    path = agent_with(tmp_path, extra=f"script = {json.dumps(str(secret_file))}")
    path.write_text(path.read_text().replace('script = "test-agent.script.json"\n', ""))
    error = refused(path)
    assert error.key == "script" and "outside the agent file's directory" in error.problem
    assert "hunter2" not in str(error) and "TOP-SECRET" not in str(error)


def test_a_symlink_out_of_the_directory_counts_as_outside(
    tmp_path: Path, secret_file: Path
) -> None:
    agent_with(tmp_path)
    (tmp_path / "test-agent.script.json").unlink()
    (tmp_path / "test-agent.script.json").symlink_to(secret_file)
    error = refused(tmp_path / "test-agent.toml")
    assert error.key == "script" and "outside" in error.problem


def test_an_allowed_outside_script_that_is_not_a_script_is_refused_without_quoting_it(
    tmp_path: Path, secret_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the operator allows scripts anywhere, and an agent naming a secret file
    monkeypatch.setenv("RATCHET_ALLOW_OUTSIDE_SCRIPTS", "1")
    path = agent_with(tmp_path)
    path.write_text(
        path.read_text().replace('"test-agent.script.json"', json.dumps(str(secret_file)))
    )
    # Then the error names the file and the position, never its bytes
    error = refused(path)
    assert error.key == "script" and str(secret_file) in error.problem
    assert "line 1 column 1" in error.problem
    for shown in (str(error), repr(error), str(error.__cause__), str(error.__context__)):
        assert "hunter2" not in shown and "TOP-SECRET" not in shown


def test_a_wrong_script_inside_the_directory_names_the_position_not_the_value(
    tmp_path: Path,
) -> None:
    path = agent_with(tmp_path)
    (tmp_path / "test-agent.script.json").write_text(
        json.dumps({"turns": [{"content": 5}], "hunter2": 1})
    )
    error = refused(path)
    assert "hunter2" not in str(error)


# --- 10: fuzz ------------------------------------------------------------------------

TOOL_REFERENCES = [
    "request_user_input",
    "blocked",
    "examples.refunds:lookup_order",
    "examples.refunds:issue_refund",
    "examples.refunds:tool",
    "examples.refunds:ORDERS",
    "os:abort",
    "os:fork",
    "builtins:print",
    "httpx:get",
    ".:x",
    "..:",
    ":",
    "tests.hostile_tools:Refund",
    "tests.hostile_tools:callback",
    "zz_no_such_module:f",
]
"""Only these are ever named: a fuzzer must not import arbitrary modules (that runs them)."""

KEYS = [
    "name",
    "model",
    "script",
    "system",
    "tools",
    "provider",
    "budgets",
    "policy",
    "model_timeout_s",
    "tool_timeout_s",
    "max_suspended_s",
    "colour",
]

scalars = st.one_of(
    st.text(max_size=12),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.sampled_from(TOOL_REFERENCES),
    st.sampled_from(["scripted", "openai:gpt", "openai:", "s.json", "../s.json", "/etc/hostname"]),
    st.sampled_from(["http://[::1", "http://127.0.0.1:1/v1", "ftp://x", "https://h/v1", ""]),
    st.sampled_from(["AWS_SECRET_ACCESS_KEY", "RATCHET_OPENAI_API_KEY", "not a name"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(KEYS + ["max_turns", "base_url", "api_key_env"]), inner),
    ),
    max_leaves=12,
)


def toml_value(value: Any) -> str:
    """A small TOML emitter (inline tables and arrays), enough for the fuzzer."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # Not ASCII-escaped: JSON's surrogate pairs are not valid TOML escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"


# Each key gets values of its own kind half the time, anything the other half; the
# rest of the document stays valid, so a fuzzed value reaches the code that reads it.
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(2**70), max_value=2**70)
)
BY_KEY: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["scripted", "openai:gpt", "openai:", "openai: ", "telepathy"]),
    "script": st.sampled_from(["s.json", "../s.json", "/etc/hostname", ".", "s.json\x00", ""]),
    "tools": st.lists(st.sampled_from(TOOL_REFERENCES), max_size=4),
    "provider": st.dictionaries(
        st.sampled_from(["base_url", "api_key_env", "timeout_s", "max_attempts", "api_key"]),
        st.one_of(scalars, numbers),
        max_size=3,
    ),
    "budgets": st.dictionaries(
        st.sampled_from(["max_turns", "max_total_tokens", "max_tool_calls", "timeout_seconds"]),
        numbers,
        max_size=3,
    ),
    "policy": st.fixed_dictionaries(
        {"require_approval": st.lists(st.sampled_from(["lookup_order", "ghost", ""]), max_size=2)}
    ),
    "model_timeout_s": numbers,
    "tool_timeout_s": numbers,
    "max_suspended_s": numbers,
}
BASE = {"name": "fuzz", "model": "scripted", "script": "s.json", "tools": ["blocked"]}


@st.composite
def documents(draw: st.DrawFn) -> str:
    document: dict[str, Any] = dict(BASE)
    document["tools"] = draw(st.lists(st.sampled_from(TOOL_REFERENCES), max_size=2))
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=2, unique=True)):
        own = BY_KEY.get(key)
        document[key] = draw(own | values if own is not None else values)
    return "\n".join(f"{k} = {toml_value(v)}" for k, v in document.items()) + "\n"


VALID = (
    b'name = "fuzz"\nmodel = "scripted"\nscript = "s.json"\n'
    b'tools = ["examples.refunds:lookup_order", "blocked"]\n'
    b"[budgets]\nmax_turns = 3\n[policy]\nrequire_approval = []\n"
)
mutations = st.lists(
    st.tuples(st.integers(0, len(VALID)), st.binary(min_size=0, max_size=3)), max_size=4
)


def mutate(edits: list[tuple[int, bytes]]) -> bytes:
    data = bytearray(VALID)
    for at, replacement in edits:
        data[at : at + len(replacement)] = replacement
    return bytes(data)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fuzz")
    (directory / "s.json").write_text('{"turns": [{"content": "hi"}]}')
    return directory


FUZZ = settings(
    max_examples=200,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def only_agent_file_errors(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        agent = load_agent(path)
    except AgentFileError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        return
    assert 0 < agent.spec.model_timeout_s < float("inf")


@FUZZ
@given(document=documents())
def test_fuzzed_agent_files_raise_only_agent_file_errors(fuzz_dir: Path, document: str) -> None:
    only_agent_file_errors(fuzz_dir / "agent.toml", document.encode("utf-8", "surrogatepass"))


@FUZZ
@given(edits=mutations)
def test_byte_mutations_of_an_agent_file_raise_only_agent_file_errors(
    fuzz_dir: Path, edits: list[tuple[int, bytes]]
) -> None:
    only_agent_file_errors(fuzz_dir / "mutated.toml", mutate(edits))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["run_id", "continuation_id", "input", "approve", "deny", "suspension_seq", "x"]
            )
            | st.text(max_size=5),
            inner,
            max_size=6,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(body=json_values)
def test_fuzzed_continuation_messages_raise_only_malformed_continuation(body: Any) -> None:
    try:
        fields = parse_message(body)
    except MalformedContinuation as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(fields, dict) and isinstance(fields["run_id"], str)


@settings(max_examples=100, derandomize=True, deadline=None, database=None)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_fuzzed_raw_continuation_bytes_raise_only_malformed_continuation(raw: bytes) -> None:
    # The consumer hands parse_message whatever JSON decoding gave; decode as it would.
    try:
        body = json.loads(raw)
    except ValueError:
        return
    try:
        parse_message(body)
    except MalformedContinuation:
        pass
