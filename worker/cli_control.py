"""``ratchet runs continue`` and ``ratchet runs cancel``: answering and stopping runs."""

from __future__ import annotations

import sys

import click

from runtime.errors import AnswerNotQueued
from runtime.models import Suspension
from tasks.control import new_continuation_id
from worker.cli_base import _api, _dump, _record_json, flag, json_flag, refusals, runs
from worker.exits import Exit
from worker.render import record_lines


@runs.command("continue")
@click.argument("run_id")
@click.option("--input", "text", default=None, help="The answer to the run's question or blocker.")
@flag("--approve", "Let the tool awaiting approval run.")
@click.option("--deny", default=None, metavar="REASON", help="Refuse the tool; the model is told.")
@click.option(
    "--continuation-id",
    default=None,
    help="Name this answer (default: generated); the same id twice is applied once.",
)
@click.option(
    "--suspension-seq",
    type=int,
    default=None,
    help="Only answer the suspension recorded at this seq (see `runs show`).",
)
@json_flag("Print the outcome as JSON.")
@refusals
def runs_continue(
    run_id: str,
    text: str | None,
    approve: bool,
    deny: str | None,
    continuation_id: str | None,
    suspension_seq: int | None,
    as_json: bool,
) -> None:
    """Answer suspended run RUN_ID and queue its next turn.

    It answers the suspension `runs show` shows (or the one --suspension-seq names)
    and says which: if the run has moved on to another question meanwhile, the
    answer is refused rather than applied to a question it was not written for.
    An answer whose next turn the broker cannot take is not recorded (exit status 1);
    exit status 7: it was recorded, but the turn was not queued (the sweeper queues it).
    """
    api = _api()
    continuation_id = continuation_id or new_continuation_id()
    shown = api.suspension(run_id) if suspension_seq is None else None
    if shown is not None:
        suspension_seq = shown.seq
    try:
        outcome = api.continue_run(
            run_id,
            input=text,
            approve=approve or None,
            deny=deny,
            continuation_id=continuation_id,
            suspension_seq=suspension_seq,
        )
    except AnswerNotQueued as exc:
        click.echo(f"ratchet: {exc}", err=True)
        sys.exit(Exit.NOT_ENQUEUED)
    if as_json:
        _dump(
            {
                "run_id": run_id,
                "continuation_id": continuation_id,
                "suspension_seq": suspension_seq,
                "outcome": outcome,
            }
        )
    elif outcome == "duplicate":
        click.echo(
            f"run {run_id}: continuation {continuation_id} was already applied; nothing to do"
        )
    else:
        what = f" {shown.reason.value}: {_asked(shown)}" if shown is not None else ""
        click.echo(
            f"run {run_id}: continued ({continuation_id}), answering the suspension at seq "
            f"{suspension_seq}{what}; its next turn is queued"
        )


def _asked(suspension: Suspension) -> str:
    if suspension.reason.value == "awaiting_approval":
        return f"tool {suspension.tool}"
    return repr(" ".join(suspension.prompt.split())[:60])


@runs.command("cancel")
@click.argument("run_id")
@click.option("--reason", default=None, help="Why; recorded in the run.cancelled event.")
@json_flag("Print the run record as JSON.")
@refusals
def runs_cancel(run_id: str, reason: str | None, as_json: bool) -> None:
    """Cancel RUN_ID: it stops at its next step, for good."""
    record = _api().cancel(run_id, reason)
    if as_json:
        _dump(_record_json(record))
    else:
        click.echo("\n".join(record_lines(record)))
