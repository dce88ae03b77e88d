"""README command 2 on a fresh machine: ``tests/services`` brings what the suite needs.

CI (``.ci/run``) runs the README's command 2 exactly, so what passes in CI is what a
newcomer types; and where ``tests/services`` cannot install what is missing (not root,
no ``apt-get``) it says in one line what to install, instead of the suite failing later
on a missing ``redis-server`` or ``chromedriver``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("redis-server", "rabbitmq-server", "chromium", "chromium-driver")


def readme_command_2() -> str:
    block = (ROOT / "README.md").read_text().split("```sh\n", 1)[1].split("```", 1)[0]
    line = block.splitlines()[1]
    assert line.rstrip().endswith("2. the test suite (tests/services: what it needs, below)")
    return line.split("  #", 1)[0].strip()


def test_ci_runs_exactly_the_readmes_command_2() -> None:
    commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "set ", "cd ", "export "))
    ]
    assert commands == [readme_command_2()]
    assert readme_command_2().startswith("tests/services && ")


def test_where_it_cannot_install_it_names_what_is_missing_in_one_line(tmp_path: Path) -> None:
    # Given a machine with none of what the tests need, and no apt-get
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "seq", "sleep"):
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    # When tests/services runs there
    ran = subprocess.run(
        [str(bin_dir / "bash"), str(ROOT / "tests" / "services")],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    # Then it stops, saying in one line what to install, and installs nothing
    assert ran.returncode == 1, ran.stderr
    assert ran.stderr.count("\n") == 1 and ran.stdout == "", ran.stderr
    assert f"sudo apt-get install {' '.join(NEEDED)}" in ran.stderr
    assert re.match(r"tests/services: the tests need ", ran.stderr)


def test_on_this_machine_it_finds_everything_and_says_nothing() -> None:
    # Command 2 ran it before the suite, so everything is here now (or the suite stopped).
    ran = subprocess.run(
        [str(ROOT / "tests" / "services")], env=dict(os.environ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
