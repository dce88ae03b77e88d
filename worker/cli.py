"""``ratchet``: the operator's command line, a thin layer over :mod:`worker.api`.

Tables for people, ``--json`` for scripts. Every refusal exits non-zero with
one line on stderr that says why and what to do.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from runtime.errors import InvalidOption, RatchetError, RunStateLost, StoreError
from runtime.models import Event, RunStatus, validate_run_id
from worker.cli_base import _api, _dump, _record_json, finite, flag, json_flag, main, refusals, runs
from worker.exits import Exit, wait_exit
from worker.render import (
    actions_line,
    event_line,
    lineage_lines,
    open_call_lines,
    printable,
    record_lines,
    run_times,
    tool_policy_lines,
    when_utc,
)


def _event_json(event: Event) -> dict[str, Any]:
    # Python's dump, not pydantic's JSON one: _dump prints whatever the data holds.
    return event.model_dump()


def _given_run_id(value: str | None) -> str | None:
    """``--run-id``: checked as given; an empty one is refused, not replaced by a new id."""
    if value is None:
        return None
    try:
        return validate_run_id(value)
    except RatchetError as exc:
        raise click.BadParameter(
            f"{value[:80]!r} is not a run id: use 1-64 letters, digits, `-` and `_`, "
            "or leave --run-id out for a generated one"
        ) from exc


__all__ = ["main"]  # the `ratchet` command (pyproject's entry point), with every subcommand

EXIT_NOT_QUEUED = Exit.NOT_ENQUEUED
"""`runs start`: the run is recorded but not queued; it starts once the broker is back (EX_TEMPFAIL)."""


@runs.command("start")
@click.argument("agent_file", type=click.Path(dir_okay=False))
@click.option("--input", "text", required=True, help="What the agent should do.")
@click.option(
    "--run-id",
    default=None,
    callback=lambda _c, _p, v: _given_run_id(v),
    help="Use this id instead of a generated one.",
)
@click.option(
    "--idempotency-key",
    default=None,
    help="Start at most once per key: the same key, agent and input give the same run.",
)
@flag(
    "--wait",
    "Wait until the run completes, fails, suspends or parks; the exit status says which "
    "(0 completed, 3 failed, 4 waits for a person, 5 needs an operator, 6 timed out).",
)
@click.option(
    "--timeout",
    "timeout_s",
    default=300.0,
    show_default=True,
    type=finite(min=0),
    help="Seconds --wait waits.",
)
@flag(
    "--watch",
    "Then follow it as `runs watch` does, its first answer forming too, until it finishes.",
)
@json_flag("Print the run record as JSON.")
@refusals
def runs_start(
    agent_file: str,
    text: str,
    run_id: str | None,
    idempotency_key: str | None,
    wait: bool,
    timeout_s: float,
    watch: bool,
    as_json: bool,
) -> None:
    """Start a run of AGENT_FILE; prints the run id.

    Starting again with the same --run-id or --idempotency-key, agent and input gives the
    same run (never a second one). Exit status 7: the run is recorded but the broker
    could not take it; it starts by itself once the broker is back.
    """
    from runtime.errors import RunNotQueued

    if wait and watch:
        raise InvalidOption(
            "--wait and --watch do not go together: --watch follows the run to its end"
        )
    api = _api()
    try:
        run_id = api.start(agent_file, text, run_id, idempotency_key, watch=watch)
    except RunNotQueued as exc:
        _dump({"run_id": exc.run_id, "queued": False}) if as_json else click.echo(exc.run_id)
        click.echo(f"ratchet: {exc}", err=True)
        sys.exit(EXIT_NOT_QUEUED)
    if watch:
        from worker.cli_watch import show_run

        click.echo(f"run {run_id}", err=True)
        show_run(run_id, None, False, as_json)
        return
    if not wait:
        _dump({"run_id": run_id}) if as_json else click.echo(run_id)
        return
    record = api.wait(run_id, timeout_s=timeout_s)
    if as_json:
        _dump(_record_json(record))
    else:
        click.echo(run_id)
        click.echo("\n".join(record_lines(record)))
    if record.status.is_live:
        click.echo(
            f"ratchet: run {run_id} is still {record.status.value} after {timeout_s:g}s; "
            f"follow it with `ratchet runs events {run_id} --follow`",
            err=True,
        )
    elif record.status.is_suspended:
        click.echo(
            f"ratchet: run {run_id} waits for a person ({record.status.value}): "
            f"`ratchet runs show {run_id}`, then `ratchet runs continue {run_id} …`",
            err=True,
        )
    elif not record.status.is_terminal:
        click.echo(
            f"ratchet: run {run_id} is {record.status.value} and needs an operator: "
            f"`ratchet runs show {run_id}`",
            err=True,
        )
    sys.exit(wait_exit(record.status))


def _since_ms(since: str, now_ms: int) -> int:
    """``--since``: an age (``2h``, ``7d``) or an ISO date/datetime (naive is UTC)."""
    from worker.cli_recovery import cutoff_ms

    if since[:1].isdigit() and since[-1:] in "smhdw" and since[:-1].isdigit():
        return cutoff_ms(None, since, now_ms, option="--since")
    return cutoff_ms(since, None, now_ms, option="--since")


@runs.command("list")
@click.option("--status", type=click.Choice([s.value for s in RunStatus]), default=None)
@click.option("--agent", default=None, help="Only this agent's runs (its name).")
@click.option("--since", default=None, help="Only runs created since: an age (2h, 7d) or a date.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--cursor", default=None, help="Start after this cursor (printed by the last page).")
@json_flag("A JSON array of run records.")
@refusals
def runs_list(
    status: str | None,
    agent: str | None,
    since: str | None,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first, a page at a time.

    When more runs follow, the command for the next page goes to stderr:
    ``more: ratchet runs list --cursor C`` (C is ``CREATED_AT_MS.RUN_ID`` of the
    last run shown, so a script reading --json can build it too).
    """
    api = _api()
    since_ms = _since_ms(since, api.ctx.runs.clock()) if since is not None else None
    records, next_cursor = api.list_page(
        RunStatus(status) if status else None,
        agent=agent,
        since_ms=since_ms,
        limit=limit,
        cursor=cursor,
    )
    if next_cursor is not None:
        click.echo(f"more: ratchet runs list --cursor {next_cursor}", err=True)
    if as_json:
        _dump([_record_json(r) for r in records])
        return
    click.echo(
        f"{'RUN':32}  {'STATUS':20}  {'AGENT':20}  {'CREATED (UTC)':19}  {'UPDATED (UTC)':19}  "
        f"{'TURNS':>5}  {'TOOLS':>5}  {'TOKENS':>7}"
    )
    for r in records:
        u = r.usage
        click.echo(
            f"{r.run_id:32}  {r.status.value:20}  {r.agent[:20]:20}  "
            f"{when_utc(r.created_at_ms):19}  {when_utc(r.updated_at_ms):19}  "
            f"{u.model_turns:>5}  {u.tool_calls:>5}  {u.total_tokens:>7}"
        )


@runs.command("show")
@click.argument("run_id")
@json_flag()
@refusals
def runs_show(run_id: str, as_json: bool) -> None:
    """Status, agent, usage against budgets, output, last error and any open tool call."""
    api = _api()
    record = api.get(run_id)
    entry = api.open_call(run_id)
    lineage = api.lineage(run_id)
    policies = api.tool_policies(run_id)
    snapshot_seq, lost = None, None
    if not record.status.is_terminal:
        try:
            snapshot_seq = api.load(run_id).snapshot_seq
        except RunStateLost as exc:
            lost = f"none: {exc}"
        except StoreError as exc:
            # The record is still worth showing when the snapshot store is away.
            lost = f"unknown: {exc}"
    if as_json:
        now_ms = api.ctx.runs.clock()
        running_ms, suspended_ms = run_times(record, now_ms)
        _dump(
            {
                **_record_json(record),
                # As the text view counts them: the current suspension included.
                "running_ms": running_ms,
                "suspended_ms": suspended_ms,
                "suspension_seq": record.suspension.seq if record.suspension else None,
                "open_call": entry.model_dump(mode="json") if entry else None,
                "snapshot_seq": snapshot_seq,
                "lineage": lineage,
                "mcp_tools": policies,
                "actions": [action.value for action in record.status.operator_actions],
            }
        )
        return
    lines = record_lines(record, api.ctx.runs.clock()) + [actions_line(record)]
    lines += lineage_lines(lineage)
    lines += tool_policy_lines(policies)
    if lost is not None:
        lines.append(f"snapshot   {lost}")
    elif not record.status.is_terminal:
        lines.append(
            f"snapshot   seq {snapshot_seq}"
            if snapshot_seq is not None
            else "snapshot   none usable; the state is rebuilt from the run's events"
        )
    if entry is not None:
        lines += open_call_lines(entry)
    click.echo(printable("\n".join(lines)))


@runs.command("events")
@click.argument("run_id")
@flag("--follow", "Keep printing events as they are appended, until it finishes.")
@flag(
    "--until-suspended",
    "With --follow: stop once the run suspends or parks instead of when it finishes.",
)
@json_flag("One JSON object per line.")
@refusals
def runs_events(run_id: str, follow: bool, until_suspended: bool, as_json: bool) -> None:
    """The run's events, one line each, seq first."""
    api = _api()
    events = api.follow(run_id, until_suspended=until_suspended) if follow else api.events(run_id)
    for event in events:
        _dump(_event_json(event)) if as_json else click.echo(event_line(event))


@main.group()
def snapshots() -> None:
    """Read snapshots as stored."""


@snapshots.command("show")
@click.argument("run_id")
@refusals
def snapshots_show(run_id: str) -> None:
    """Print the run's snapshot document exactly as stored."""
    document = _api().snapshot_document(run_id)
    if document is None:
        record = _api().get(run_id)
        raise RatchetError(
            f"run {run_id} has no snapshot: it is {record.status.value}"
            + (
                " (a finished run's snapshot is deleted; its events remain: "
                f"`ratchet runs events {run_id}`)"
                if record.status.is_terminal
                else ""
            )
        )
    click.echo(document.decode(), nl=False)


@main.command("demo")
@click.option(
    "--agent", "agent_file", default=None, help="Agent file to run (default: the example)."
)
@click.option("--input", "text", default="My toaster never arrived (order B2). Can I get a refund?")
@refusals
def demo(agent_file: str | None, text: str) -> None:
    """Start a worker, run the example agent, and show each transition as it happens."""
    from worker.demo import run_demo

    sys.exit(run_demo(agent_file, text))


# Command modules register themselves on the groups (worker.cli_base).
from worker import (  # noqa: E402,F401
    cli_control,
    cli_limits,
    cli_lineage,
    cli_recovery,
    cli_rejected,
    cli_watch,
)
from worker.console import command as console_command  # noqa: E402,F401
