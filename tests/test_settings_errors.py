"""A bad setting is one line naming the variable, on every command: the CLI, the worker, beat.

Each command runs as a subprocess configured only by its environment, as an operator
runs it. The worker and beat commands are real ``celery -A worker worker|beat``; the
line must come before Celery or the CLI could print a traceback of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.errors import ConfigInvalid
from tasks.settings import EXIT_CONFIG_INVALID, load_settings
from tests.redis_server import HOST, _free_port
from tests.workers import ROOT

pytestmark = pytest.mark.slow

COMMANDS = {
    "ratchet runs list": [sys.executable, "-m", "worker", "runs", "list"],
    "ratchet runs start": [
        sys.executable, "-m", "worker", "runs", "start", "examples/refund-desk.toml",
        "--input", "Refund order B2",
    ],
    "celery worker": [
        sys.executable, "-m", "celery", "-A", "worker", "worker", "--pool", "solo",
        "--without-mingle", "--without-gossip",
    ],
    "celery beat": [sys.executable, "-m", "celery", "-A", "worker", "beat"],
}  # fmt: skip

# (environment, the variable the line must name, a fragment of what it says)
BAD_SETTINGS = {
    "lease-not-a-number": ({"RATCHET_LEASE_S": "abc"}, "RATCHET_LEASE_S", "valid number"),
    "lease-negative": ({"RATCHET_LEASE_S": "-1"}, "RATCHET_LEASE_S", "greater than 0"),
    "lease-zero": ({"RATCHET_LEASE_S": "0"}, "RATCHET_LEASE_S", "greater than 0"),
    "turn-limit-over-visibility": (
        {"RATCHET_TURN_TIME_LIMIT_S": "5000"},
        "RATCHET_TURN_TIME_LIMIT_S",
        "RATCHET_VISIBILITY_TIMEOUT_S",
    ),
    "redis-prefix": ({"RATCHET_REDIS_PREFIX": "my prefix!"}, "RATCHET_REDIS_PREFIX", "letters"),
    "metrics-port": ({"RATCHET_METRICS_PORT": "99999"}, "RATCHET_METRICS_PORT", "65535"),
    "data-dir": ({"RATCHET_DATA_DIR": "/proc/forbidden"}, "RATCHET_DATA_DIR", "/proc/forbidden"),
    "broker-garbage": ({"RATCHET_BROKER_URL": "garbage"}, "RATCHET_BROKER_URL", "broker URL"),
    "snapshot-store-ftp": (
        {"RATCHET_SNAPSHOT_STORE": "ftp://user:hunter2@x/"},
        "RATCHET_SNAPSHOT_STORE",
        "ftp://user:***@x/",
    ),
    "run-store-unknown": ({"RATCHET_RUN_STORE": "postgres://x/db"}, "RATCHET_RUN_STORE", "sqlite"),
    "failpoint-unknown": ({"RATCHET_FAILPOINT": "bogus@x"}, "RATCHET_FAILPOINT", "POINT@N"),
}


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    # Everything valid (the embedded default under tmp_path) but the one bad setting.
    env.update(PYTHONPATH=str(ROOT), RATCHET_DATA_DIR=str(tmp_path / "data"))
    env.update(extra)
    return env


@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_a_bad_setting_is_one_line_naming_the_variable(
    case: str, command: str, tmp_path: Path
) -> None:
    bad, variable, says = BAD_SETTINGS[case]
    # Given one bad setting, when an operator runs the command
    done = subprocess.run(
        COMMANDS[command],
        cwd=ROOT,
        env=clean_env(tmp_path, **bad),
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Then it exits with the configuration status and one line on stderr naming it
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == EXIT_CONFIG_INVALID, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("ratchet: "), lines
    assert variable in lines[0] and says in lines[0], lines[0]
    assert "hunter2" not in done.stderr + done.stdout
    # And nothing ran: no run id, no worker banner
    assert done.stdout == ""


def test_settings_in_an_application_raise_one_line_config_invalid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An application importing ratchet gets an exception, not a process exit.
    monkeypatch.setenv("RATCHET_BROKER_URL", f"redis://:pw@{HOST}:{_free_port()}/0")
    monkeypatch.setenv("RATCHET_LEASE_S", "abc")
    with pytest.raises(ConfigInvalid) as raised:
        load_settings()
    assert raised.value.variable == "RATCHET_LEASE_S"
    assert "\n" not in str(raised.value)
