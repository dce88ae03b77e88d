"""Runs made from other runs: ``ratchet runs fork``.

Registered on the groups of :mod:`worker.cli` when it imports this module.
"""

from __future__ import annotations

import click

from worker.cli import _api, _dump, refusals, runs


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
@click.option(
    "--rebind",
    is_flag=True,
    help="Run the fork under the agent file as it is now, although it changed.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the fork's id and notes as JSON.")
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
