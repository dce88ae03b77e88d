"""NaN and infinities are refused at every edge a number comes in by (runtime/numbers.py).

A NaN compares false with every bound, so click's ``FloatRange`` and pydantic's
``gt=0`` let it through; ``ratchet limits set KEY --rpm 1 --burst-s nan`` once
switched an embedded limit off and failed every check of a Redis one inside Lua.
Each edge here gets ``nan``, ``inf`` and ``-inf``: the CLI (one line, exit status 2),
the environment (one line naming the variable), the agent file, the Python API,
and the limit store's run-time values.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime.errors import AgentFileError, ConfigInvalid, InvalidRequest
from runtime_io.agent_files import load_agent
from store.limits import LimitStore
from store.limits.memory import MemoryLimitStore
from store.limits.redis import RedisLimitStore
from store.limits.sqlite import SqliteLimitStore
from store.runs.redis import RedisRunStore
from tasks.context import Context
from tasks.limits import limit_store
from tasks.settings import load_settings
from tasks.start import create_run
from tests.helpers import installed_context, memory_context, turn, write_agent
from worker.api import Ratchet
from worker.cli import main

NOT_FINITE = ["nan", "inf", "-inf"]


@pytest.fixture
def ctx() -> Iterator[Context]:
    with installed_context(memory_context()) as context:
        yield context


CLI_COMMANDS = [
    ["limits", "set", "KEY", "--rpm", "1", "--burst-s"],
    ["runs", "start", "agent.toml", "hello", "--wait", "--timeout"],
    ["runs", "resume", "some-run", "--wait"],
]


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize("command", CLI_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_the_cli_refuses_a_number_that_is_not_finite_in_one_line_with_status_2(
    ctx: Context, command: list[str], value: str
) -> None:
    result = CliRunner().invoke(main, [*command, value])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("ratchet: Invalid value for '--"), lines
    assert f"{value} is not a finite number" in lines[0]
    assert limit_store(ctx).overrides() == {}


def test_limits_set_still_takes_a_finite_burst(ctx: Context) -> None:
    result = CliRunner().invoke(main, ["limits", "set", "KEY", "--rpm", "1", "--burst-s", "0.5"])
    assert result.exit_code == 0, result.output
    assert limit_store(ctx).overrides() == {"KEY": {"burst_s": 0.5, "requests_per_minute": 1}}


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize(
    "variable",
    ["RATCHET_LEASE_S", "RATCHET_LIVENESS_S", "RATCHET_HEARTBEAT_INTERVAL_S",
     "RATCHET_SWEEP_INTERVAL_S", "RATCHET_FILESYSTEM_POLLING_INTERVAL_S",
     "RATCHET_MAX_CLOCK_SKEW_S"],
)  # fmt: skip
def test_a_setting_that_is_not_finite_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str, value: str
) -> None:
    monkeypatch.setenv("RATCHET_DATA_DIR", str(tmp_path))
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigInvalid) as refused:
        load_settings()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{variable}={value} is refused: input should be a finite number")


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize(
    "where",
    ["model_timeout_s = {v}", "tool_timeout_s = {v}", "probe_timeout_s = {v}",
     "[limits]\nburst_s = {v}", "[limits]\nmax_wait_s = {v}"],
)  # fmt: skip
def test_an_agent_file_refuses_a_number_that_is_not_finite(
    tmp_path: Path, where: str, value: str
) -> None:
    path = write_agent(tmp_path, [turn("Done.")], extra=where.format(v=value))
    with pytest.raises(AgentFileError, match="finite number"):
        load_agent(path)


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize("key", ["timeout_s", "max_retry_s", "temperature"])
@pytest.mark.parametrize("model", ["openai:gpt", "anthropic:claude"])
def test_an_agent_files_provider_table_refuses_a_number_that_is_not_finite(
    tmp_path: Path, model: str, key: str, value: str
) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f'name = "x"\nmodel = "{model}"\n[provider]\n{key} = {value}\n')
    with pytest.raises(AgentFileError, match="finite number"):
        load_agent(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_python_api_refuses_a_wait_that_is_not_finite(
    ctx: Context, tmp_path: Path, value: float
) -> None:
    run_id = create_run(ctx, write_agent(tmp_path, [turn("Done.")]), "hello").run_id
    api = Ratchet(ctx)
    with pytest.raises(InvalidRequest, match="is not a finite number"):
        api.wait(run_id, timeout_s=value)
    with pytest.raises(InvalidRequest, match="is not a finite number"):
        api.wait(run_id, timeout_s=1, poll_s=value)
    with pytest.raises(InvalidRequest, match="is not a finite number"):
        next(api.follow(run_id, timeout_s=value))
    with pytest.raises(InvalidRequest, match="is not a finite number"):
        api.resume_and_wait(run_id, timeout_s=value)


@pytest.fixture(params=["memory", "sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LimitStore]:
    if request.param == "memory":
        yield MemoryLimitStore()
    elif request.param == "sqlite":
        yield SqliteLimitStore(tmp_path / "limits.sqlite3")
    else:
        runs = RedisRunStore.from_url(request.getfixturevalue("redis_url"))
        yield RedisLimitStore(runs._client, "finite")
        runs.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_limit_store_refuses_run_time_values_that_are_not_finite(
    store: LimitStore, value: float
) -> None:
    with pytest.raises(InvalidRequest, match="burst_s .* is not a finite number"):
        store.set_override("KEY", {"requests_per_minute": 1, "burst_s": value})
    assert store.overrides().get("KEY") is None
