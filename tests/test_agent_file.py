"""Agent files: what loads, and how a bad one is refused (naming the file and the key)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.errors import AgentFileError
from runtime_io.agent_files import load_agent
from tests.helpers import turn, write_agent

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "refund-desk.toml"


def test_the_example_agent_loads_with_schemas_from_type_hints() -> None:
    agent = load_agent(EXAMPLE)
    assert agent.name == "refund-desk"
    lookup = agent.tools["lookup_order"]
    assert lookup.idempotent and not agent.tools["issue_refund"].idempotent
    assert lookup.parameters["properties"] == {"order_id": {"type": "string"}}
    assert lookup.parameters["required"] == ["order_id"]
    assert agent.tools["request_user_input"].control
    assert agent.binding.startswith("sha256:") and len(agent.binding) == 71


def test_the_binding_changes_with_anything_that_decides_behaviour(tmp_path: Path) -> None:
    base = load_agent(write_agent(tmp_path / "a", [turn("x")])).binding
    assert load_agent(write_agent(tmp_path / "b", [turn("x")])).binding == base
    assert load_agent(write_agent(tmp_path / "c", [turn("y")])).binding != base  # the script
    assert (
        load_agent(write_agent(tmp_path / "d", [turn("x")], budgets={"max_turns": 3})).binding
        != base
    )
    assert load_agent(write_agent(tmp_path / "e", [turn("x")], tools=["blocked"])).binding != base
    assert (
        load_agent(
            write_agent(tmp_path / "f", [turn("x")], require_approval=["issue_refund"])
        ).binding
        != base
    )


@pytest.mark.parametrize(
    ("edit", "key", "problem"),
    [
        (lambda t: 'colour = "blue"\n' + t, "colour", "unknown key"),
        (
            lambda t: t.replace('model = "scripted"', 'model = "telepathy"'),
            "model",
            "unknown provider",
        ),
        (
            lambda t: t.replace('"blocked"', '"examples.refunds:nope"'),
            "tools[4]",
            "has no function `nope`",
        ),
        (
            lambda t: t.replace('"blocked"', '"no_such_module_xyz:f"'),
            "tools[4]",
            "cannot be imported",
        ),
        (lambda t: t.replace('"blocked"', '"notatool"'), "tools[4]", "expected `module:function`"),
        (
            lambda t: t.replace("[budgets]", "[budgets]\nmax_turns = 0"),
            "budgets.max_turns",
            "greater than",
        ),
        (
            lambda t: t.replace("require_approval = []", 'require_approval = ["ghost"]'),
            "policy.require_approval",
            "not one of the agent's tools",
        ),
        (lambda t: t.replace('name = "test-agent"\n', ""), "name", "Field required"),
        (lambda t: t + "[[[", "", "not valid TOML"),
    ],
)
def test_a_bad_agent_file_is_refused_naming_the_file_and_the_key(
    tmp_path: Path,
    edit: Callable[[str], str],
    key: str,
    problem: str,
) -> None:
    path = write_agent(tmp_path, [turn("x")])
    path.write_text(edit(path.read_text()))
    with pytest.raises(AgentFileError) as refused:
        load_agent(path)
    message = str(refused.value)
    assert str(path) in message and problem in message
    assert refused.value.key == key and (f"`{key}`" in message if key else True)


def test_a_missing_script_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = write_agent(tmp_path, [turn("x")])
    (tmp_path / "test-agent.script.json").unlink()
    with pytest.raises(AgentFileError, match=r"`script`: .* cannot be read"):
        load_agent(path)


def test_agent_file_errors_say_the_fix_once_name_no_key_for_the_file_and_no_pydantic_prefix(
    tmp_path: Path,
) -> None:
    def refused(path: Path) -> str:
        with pytest.raises(AgentFileError) as caught:
            load_agent(path)
        return str(caught.value)

    # A tool that cannot be imported: the tool's fix, once
    tool = refused(write_agent(tmp_path / "t", [turn("Done.")], tools=["no_such_module:fn"]))
    assert tool.count("(fix ") == 1 and "fix the tool or the agent file's `tools`" in tool
    assert "`tools[0]`: tool `no_such_module:fn`: module `no_such_module`" in tool
    # A missing file, and one that is not TOML: the file is at fault, no key is named
    missing = refused(tmp_path / "missing.toml")
    fix = "(fix the agent file, then run the command again)"
    assert missing == f"{tmp_path / 'missing.toml'}: no such file {fix}"
    (tmp_path / "bad.toml").write_text("name = \n")
    assert "`" not in refused(tmp_path / "bad.toml").split(": not valid TOML")[0]
    # A variable the operator does not allow as a key: the validator's words, no prefix
    key = tmp_path / "key.toml"
    key.write_text('name = "k"\nmodel = "openai:gpt-4o"\n[provider]\napi_key_env = "HOME"\n')
    refusal = refused(key)
    assert "Value error" not in refusal and "names the variable HOME, which is not one" in refusal
