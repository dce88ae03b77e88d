"""Recovery commands: ``ratchet runs resume|reconcile|purge``, ``ratchet sweep``.

Registered on the groups of :mod:`worker.cli` when it imports this module.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

import click

from runtime.errors import InvalidOption, RatchetError
from worker.cli_base import _api, _dump, _record_json, finite, flag, json_flag, main, refusals, runs
from worker.exits import Exit
from worker.render import record_lines, when_utc


@runs.command("resume")
@click.argument("run_id")
@click.option(
    "--wait",
    "wait_s",
    default=10.0,
    show_default=True,
    type=finite(),
    help="Seconds to wait for a worker to take the resume (0: do not wait).",
)
@json_flag("Print the outcome as JSON.")
@refusals
def runs_resume(run_id: str, wait_s: float, as_json: bool) -> None:
    """Resume a stopped run from its last checkpoint (refused, with the reason, if it cannot).

    The run is classified here first; then a worker classifies it again with what
    it sees, and its answer is waited for: resumed (exit 0), refused (exit 1), or
    no worker took it in time (exit 6).
    """
    api = _api()
    if wait_s <= 0:
        status = api.resume(run_id)
        outcome: dict[str, Any] = {"run_id": run_id, "status": status, "outcome": "enqueued"}
        _dump(outcome) if as_json else click.echo(f"run {run_id} ({status}): resume enqueued")
        return
    status, resumed = api.resume_and_wait(run_id, timeout_s=wait_s)
    if resumed is not None:
        outcome = {"run_id": run_id, "status": status, "outcome": "resumed", "seq": resumed.seq}
        if as_json:
            _dump(outcome)
        else:
            click.echo(f"run {run_id} ({status}): resumed by a worker at seq {resumed.seq}")
        return
    if as_json:
        _dump({"run_id": run_id, "status": status, "outcome": "enqueued"})
    click.echo(
        f"ratchet: run {run_id} ({status}): resume enqueued, but no worker took it within "
        f"{wait_s:g}s; is a worker consuming ratchet.turns? "
        f"(`ratchet runs events {run_id} --follow` shows when one does)",
        err=True,
    )
    sys.exit(Exit.TIMEOUT)


@runs.command("reconcile")
@click.argument("run_id")
@click.argument("call_id")
@click.option("--result", "result_json", default=None, help="The call's outcome, as JSON.")
@flag("--retry", "The call did not happen: run it again.")
@click.option("--fail", "fail_reason", default=None, help="The call failed: tell the model why.")
@json_flag("Print the run record as JSON.")
@refusals
def runs_reconcile(
    run_id: str,
    call_id: str,
    result_json: str | None,
    retry: bool,
    fail_reason: str | None,
    as_json: bool,
) -> None:
    """Decide the outcome of CALL_ID, the call a parked run has open; the run then goes on."""
    chosen = [result_json is not None, retry, fail_reason is not None]
    if sum(chosen) != 1:
        raise InvalidOption("give exactly one of --result JSON, --retry or --fail REASON")
    result: Any = None
    if result_json is not None:
        try:
            result = json.loads(result_json)
        except json.JSONDecodeError as exc:
            raise InvalidOption(f"--result is not valid JSON: {exc}") from exc
        decision = "result"
    else:
        decision = "retry" if retry else "fail"
    record = _api().reconcile(run_id, call_id, decision, result=result, reason=fail_reason)
    if as_json:
        _dump({**_record_json(record), "call_id": call_id, "decision": decision})
        return
    click.echo(f"run {run_id}: call {call_id} reconciled ({decision}); the run goes on")
    click.echo("\n".join(record_lines(record)))


@main.command("sweep")
@flag("--once", "Sweep once and exit (default: every interval).")
@json_flag("One JSON object per sweep.")
@refusals
def sweep(once: bool, as_json: bool) -> None:
    """Find orphaned runs (lease expired, next step overdue) and enqueue a resume for each."""
    api = _api()
    interval_s = api.ctx.settings.sweep_interval_s
    while True:
        found = api.sweep()
        if as_json:
            _dump({"orphaned": found})
        elif found:
            click.echo(f"sweep: {len(found)} orphaned run(s), resume enqueued: {' '.join(found)}")
        elif once:
            click.echo("sweep: no orphaned runs")
        if once:
            return
        time.sleep(interval_s)


_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def cutoff_ms(
    before: str | None, older_than: str | None, now_ms: int, option: str | None = None
) -> int:
    """The purge cutoff from ``--before`` (ISO date or datetime; naive is UTC) or ``--older-than``.

    ``option`` names the option in messages when it is neither (``--since``).
    """
    if (before is None) == (older_than is None):
        raise InvalidOption("give exactly one of --before DATE or --older-than AGE (e.g. 7d)")
    if older_than is not None:
        name = option or "--older-than"
        match = re.fullmatch(r"(\d+)([smhdw])", older_than.strip())
        if match is None:
            raise InvalidOption(
                f"{name} {older_than!r} is not an age: a number and one of s, m, h, d, w (7d)"
            )
        cutoff = now_ms - int(match[1]) * _UNITS_S[match[2]] * 1000
        if cutoff < 0:
            raise InvalidOption(
                f"{name} {older_than} reaches back before 1970; nothing is that old, "
                "give a smaller age (e.g. 3650d)"
            )
        return cutoff
    assert before is not None
    name = option or "--before"
    try:
        moment = datetime.fromisoformat(before)
    except ValueError as exc:
        raise InvalidOption(
            f"{name} {before!r} is not an ISO date or datetime (2025-01-31 or 2025-01-31T12:00)"
        ) from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    cutoff = int(moment.timestamp() * 1000)
    if cutoff < 0:
        raise InvalidOption(f"{name} {before} is before 1970; give a later date")
    return cutoff


@runs.command("purge")
@click.option("--before", default=None, help="Purge runs finished before this ISO date/datetime.")
@click.option("--older-than", default=None, help="Purge runs finished longer ago than this (7d).")
@flag("--dry-run", "List what would be purged; delete nothing.")
@flag("--yes", "Do not ask for confirmation (needed where there is no terminal to ask on).")
@json_flag("Print the outcome as JSON.")
@refusals
def runs_purge(
    before: str | None, older_than: str | None, dry_run: bool, yes: bool, as_json: bool
) -> None:
    """Delete finished runs (completed, failed, cancelled, dead-lettered): records and events.

    Irreversible. It says how many and asks first (--yes skips the question; without
    a terminal to ask on, it refuses unless --yes is given); --dry-run lists them and
    deletes nothing.
    """
    from tasks.recovery import PURGE_BATCH, purge_finished

    api = _api()
    ctx = api.ctx
    before_ms = cutoff_ms(before, older_than, ctx.runs.clock())
    cutoff = datetime.fromtimestamp(before_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if dry_run or not yes:
        candidates = api.purge_candidates(before_ms)
        if dry_run:
            if as_json:
                _dump(
                    {
                        "dry_run": True,
                        "before_ms": before_ms,
                        "would_purge": [r.run_id for r in candidates],
                    }
                )
                return
            for r in candidates:
                click.echo(
                    f"{r.run_id:32}  {r.status.value:14}  updated {when_utc(r.updated_at_ms)}"
                )
            click.echo(
                f"would purge {len(candidates)} finished run(s) last updated before {cutoff}"
            )
            return
        if not candidates:
            _dump({"purged": 0, "before_ms": before_ms}) if as_json else click.echo(
                "purged 0 finished run(s)"
            )
            return
        question = (
            f"delete {len(candidates)} finished run(s) last updated before {cutoff}, "
            "records and events, for good?"
        )
        if not sys.stdin.isatty():
            # A script that forgot --yes must not delete what it was never asked about.
            raise RatchetError(
                f"not purged: this would {question[:-1]}, and there is no terminal to ask on; "
                "add --yes to purge, or --dry-run to list them"
            )
        click.confirm(question, abort=True, err=True)
    total = 0
    while True:
        purged = purge_finished(ctx, before_ms, PURGE_BATCH)
        total += purged
        if purged < PURGE_BATCH:
            break
    if as_json:
        _dump({"purged": total, "before_ms": before_ms})
    else:
        click.echo(f"purged {total} finished run(s)")
