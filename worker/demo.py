"""``ratchet demo``: a worker, the example agent, every transition on screen.

Runs on whatever the settings say — with nothing set, the embedded default
under ``./.ratchet``: a ``filesystem://`` broker, file snapshots, SQLite runs.
The worker is a real ``celery -A worker worker`` subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import click

from store.private import private_dir, private_file
from tasks.settings import get_settings
from worker.render import event_line


def _example_agent() -> str:
    return str(resources.files("examples").joinpath("refund-desk.toml"))


def _start_worker(log_path: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker",
        "worker",
        "--loglevel",
        "info",
        "--pool",
        "solo",
        "--without-mingle",
        "--without-gossip",
        "--hostname",
        f"demo-{os.getpid()}@%h",
    ]
    private_dir(log_path.parent)
    # One demo's log at a time (and the one before, as .1): it must not grow forever.
    if log_path.exists():
        log_path.replace(log_path.with_name(log_path.name + ".1"))
    with open(private_file(log_path), "wb") as log:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def run_demo(agent_file: str | None, text: str) -> int:
    from worker.api import Ratchet

    settings = get_settings()
    agent_file = agent_file or _example_agent()
    click.echo(f"ratchet demo: data in {settings.resolved_data_dir}")
    click.echo(f"  broker    {settings.resolved_broker_url}")
    click.echo(f"  snapshots {settings.resolved_snapshot_store}")
    click.echo(f"  runs      {settings.resolved_run_store}")
    api = Ratchet()
    api.ctx.agent(agent_file)  # a bad agent file is refused before a worker is started for it
    log_path = settings.resolved_data_dir / "demo-worker.log"
    worker = _start_worker(log_path)
    try:
        started = time.monotonic()
        run_id = api.start(agent_file, text)
        click.echo(f"started run {run_id} of {agent_file}; a worker is starting…\n")
        for event in api.follow(run_id, timeout_s=120, until_suspended=True):
            click.echo(event_line(event))
        wall_s = time.monotonic() - started
        record = api.get(run_id)
        # The summary first: stopping the worker takes a few seconds of Celery's shutdown.
        u = record.usage
        click.echo("")
        click.echo(f"run {run_id}: {record.status.value} in {wall_s:.2f}s (including worker start)")
        click.echo(
            f"  turns {u.model_turns}, tool calls {u.tool_calls}, tokens {u.total_tokens} "
            f"(in {u.input_tokens}, out {u.output_tokens}), events {record.last_seq}"
        )
        if record.output:
            click.echo(f"  output: {record.output}")
        click.echo(f"  events:    `ratchet runs events {run_id}` ({settings.resolved_run_store})")
        click.echo(
            f"  snapshots: {settings.resolved_snapshot_store} (deleted once a run completes)"
        )
        click.echo(f"  worker log: {log_path}")
        click.echo("stopping the demo worker…")
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
    return 0 if record.status.value == "completed" else 1
