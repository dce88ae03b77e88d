"""Recovery commands: ``ratchet runs resume|reconcile|purge``, ``ratchet sweep``.

Registered on the groups of :mod:`worker.cli` when it imports this module.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

import click

from runtime.errors import RatchetError
from worker.cli import _api, main, refusals, runs
from worker.render import record_lines


@runs.command("resume")
@click.argument("run_id")
@refusals
def runs_resume(run_id: str) -> None:
    """Resume a stopped run from its last checkpoint (refused, with the reason, if it cannot)."""
    status = _api().resume(run_id)
    click.echo(f"run {run_id} ({status}): resume enqueued")


@runs.command("reconcile")
@click.argument("run_id")
@click.argument("call_id")
@click.option("--result", "result_json", default=None, help="The call's outcome, as JSON.")
@click.option("--retry", is_flag=True, help="The call did not happen: run it again.")
@click.option("--fail", "fail_reason", default=None, help="The call failed: tell the model why.")
@refusals
def runs_reconcile(
    run_id: str, call_id: str, result_json: str | None, retry: bool, fail_reason: str | None
) -> None:
    """Decide the outcome of CALL_ID, the call a parked run has open; the run then goes on."""
    chosen = [result_json is not None, retry, fail_reason is not None]
    if sum(chosen) != 1:
        raise RatchetError("give exactly one of --result JSON, --retry or --fail REASON")
    result: Any = None
    if result_json is not None:
        try:
            result = json.loads(result_json)
        except json.JSONDecodeError as exc:
            raise RatchetError(f"--result is not valid JSON: {exc}") from exc
        decision = "result"
    else:
        decision = "retry" if retry else "fail"
    record = _api().reconcile(run_id, call_id, decision, result=result, reason=fail_reason)
    click.echo(f"run {run_id}: call {call_id} reconciled ({decision}); the run goes on")
    click.echo("\n".join(record_lines(record)))


@main.command("sweep")
@click.option("--once", is_flag=True, help="Sweep once and exit (default: every interval).")
@refusals
def sweep(once: bool) -> None:
    """Find orphaned runs (lease expired, next step overdue) and enqueue a resume for each."""
    api = _api()
    interval_s = api.ctx.settings.sweep_interval_s
    while True:
        found = api.sweep()
        if found or once:
            click.echo(f"sweep: {len(found)} orphaned run(s), resume enqueued: {' '.join(found)}")
        if once:
            return
        time.sleep(interval_s)


_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def cutoff_ms(before: str | None, older_than: str | None, now_ms: int) -> int:
    """The purge cutoff from ``--before`` (ISO date or datetime; naive is UTC) or ``--older-than``."""
    if (before is None) == (older_than is None):
        raise RatchetError("give exactly one of --before DATE or --older-than AGE (e.g. 7d)")
    if older_than is not None:
        match = re.fullmatch(r"(\d+)([smhdw])", older_than.strip())
        if match is None:
            raise RatchetError(
                f"--older-than {older_than!r} is not an age: a number and one of s, m, h, d, w (7d)"
            )
        return now_ms - int(match[1]) * _UNITS_S[match[2]] * 1000
    assert before is not None
    try:
        moment = datetime.fromisoformat(before)
    except ValueError as exc:
        raise RatchetError(
            f"--before {before!r} is not an ISO date or datetime (2025-01-31 or 2025-01-31T12:00)"
        ) from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


@runs.command("purge")
@click.option("--before", default=None, help="Purge runs finished before this ISO date/datetime.")
@click.option("--older-than", default=None, help="Purge runs finished longer ago than this (7d).")
@refusals
def runs_purge(before: str | None, older_than: str | None) -> None:
    """Delete finished runs (completed, failed, cancelled, dead-lettered): records and events."""
    from tasks.recovery import PURGE_BATCH, purge_finished

    ctx = _api().ctx
    before_ms = cutoff_ms(before, older_than, ctx.runs.clock())
    total = 0
    while True:
        purged = purge_finished(ctx, before_ms, PURGE_BATCH)
        total += purged
        if purged < PURGE_BATCH:
            break
    click.echo(f"purged {total} finished run(s)")
