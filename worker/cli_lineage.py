"""Runs made from other runs, and runs given more: ``ratchet runs fork``, ``ratchet runs budget``.

Registered on the groups of :mod:`worker.cli` when it imports this module.
"""

from __future__ import annotations

import getpass

import click

from worker.cli_base import _api, _dump, flag, json_flag, refusals, runs


@runs.command("fork")
@click.argument("run_id")
@click.option(
    "--at",
    "at_seq",
    type=click.IntRange(min=1),
    default=None,
    help="The seq to fork at (`ratchet runs events RUN` lists them); default: the last.",
)
@click.option("--run-id", "new_run_id", default=None, help="The fork's id; default: a new one.")
@flag("--rebind", "Run the fork under the agent file as it is now, although it changed.")
@json_flag("Print the fork's id and notes as JSON.")
@refusals
def runs_fork(
    run_id: str, at_seq: int | None, new_run_id: str | None, rebind: bool, as_json: bool
) -> None:
    """Start a new run from RUN_ID's state at a seq; RUN_ID itself is left as it is."""
    fork_id, notes = _api().fork(run_id, at_seq, new_run_id, rebind=rebind)
    if as_json:
        _dump({"run_id": fork_id, "forked_from": run_id, "at_seq": at_seq, "notes": list(notes)})
        return
    where = f"seq {at_seq}" if at_seq is not None else "its last seq"
    click.echo(f"run {fork_id}: forked from {run_id} at {where}")
    for note in notes:
        click.echo(f"  note: {note}")


@runs.command("budget")
@click.argument("run_id")
@click.option("--max-turns", default=None, metavar="+N|N", help="More model calls.")
@click.option("--max-total-tokens", default=None, metavar="+N|N", help="More tokens.")
@click.option("--max-tool-calls", default=None, metavar="+N|N", help="More tool calls.")
@click.option("--timeout-seconds", default=None, metavar="+N|N", help="More running time.")
@click.option("--reason", required=True, help="Why: kept in the run's events with who.")
@click.option("--by", default=None, help="Who raises it (default: operator:$USER).")
@json_flag("Print the run record as JSON.")
@refusals
def runs_budget(
    run_id: str,
    max_turns: str | None,
    max_total_tokens: str | None,
    max_tool_calls: str | None,
    timeout_seconds: str | None,
    reason: str,
    by: str | None,
    as_json: bool,
) -> None:
    """Give RUN_ID more budget; a run that stopped on a budget goes on from where it stopped."""
    given = {
        "max_turns": max_turns,
        "max_total_tokens": max_total_tokens,
        "max_tool_calls": max_tool_calls,
        "timeout_seconds": timeout_seconds,
    }
    changes = {budget: value for budget, value in given.items() if value is not None}
    who = by or f"operator:{getpass.getuser()}"
    record = _api().raise_budgets(run_id, changes, reason, by=who)
    if as_json:
        _dump(record.model_dump(mode="json"))
        return
    limits = ", ".join(f"{k} {v}" for k, v in sorted(record.budgets.items()) if k in changes)
    click.echo(f"run {run_id} ({record.status.value}): budgets raised to {limits}, by {who}")
