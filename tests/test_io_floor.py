"""bench/io_fleet.py's floors, run small: the plain-Celery floor and the durable floor
finish the same runs as ratchet beside them, the durable one journaling every event the
mission asks for, so the paired ceiling figures (issue 36) compare like with like."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.workers import ROOT


def test_the_io_fleet_floors_finish_the_runs_ratchet_does_and_print_paired_figures() -> None:
    # Given the bench's ceiling phase with one round beside both floors, a few runs of 2 turns
    command = [sys.executable, "bench/io_fleet.py", "--pool", "prefork", "--concurrency", "2",
               "--runs", "4", "--turns", "2", "--latency", "", "--floor-rounds", "1",
               "--durable-floor", "--timeout", "120"]  # fmt: skip
    # When it runs to the end
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # Then both sides finished every run, and the paired figures are printed
    assert done.returncode == 0, done.stderr[-2000:]
    assert "unfinished" not in done.stdout, done.stdout
    assert "without every event" not in done.stdout, done.stdout
    ratio = re.search(r"ratchet / floor turns/s, per round: ([\d.]+); median", done.stdout)
    assert ratio is not None and float(ratio.group(1)) > 0, done.stdout
    durable = re.search(r"ratchet / durable turns/s, per round: ([\d.]+); median", done.stdout)
    assert durable is not None and float(durable.group(1)) > 0, done.stdout
    for name in ("worker", "redis", "model"):
        line = re.search(
            rf"{name} +CPU ms/turn: ratchet ([\d.]+), floor ([\d.]+), durable ([\d.]+)",
            done.stdout,
        )
        assert line is not None and float(line.group(2)) > 0 < float(line.group(3)), done.stdout
