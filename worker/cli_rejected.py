"""``ratchet rejected list|show|purge``: the messages workers refused (the rejected-message store)."""

from __future__ import annotations

import datetime as dt
import sys
from contextlib import closing

import click

from store import open_rejected
from store.rejected import Rejected, RejectedStore
from worker.cli_base import _dump, flag, json_flag, main, refusals


def _store() -> RejectedStore:
    from tasks.settings import get_settings

    settings = get_settings()
    return open_rejected(settings.resolved_broker_url, settings.resolved_data_dir)


def _when(entry: Rejected) -> str:
    return dt.datetime.fromtimestamp(entry.at_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


@main.group()
def rejected() -> None:
    """Messages workers refused and set aside (malformed, undecodable, wrong arguments)."""


@rejected.command("list")
@click.option("--limit", default=50, show_default=True, help="Newest first, at most this many.")
@json_flag("One JSON array of entries.")
@refusals
def rejected_list(limit: int, as_json: bool) -> None:
    """The refused messages, newest first: id, time, queue, size and reason."""
    with closing(_store()) as store:
        entries = store.list(limit)
    if as_json:
        _dump([e.to_json() for e in entries])
        return
    if not entries:
        click.echo(f"no rejected messages in {store.where}")
        return
    click.echo(f"{'ID':26}  {'AT (UTC)':19}  {'QUEUE':22}  {'BYTES':>7}  REASON")
    for e in entries:
        click.echo(f"{e.id:26}  {_when(e):19}  {e.queue[:22]:22}  {e.size:>7}  {e.reason}")


@rejected.command("show")
@click.argument("entry_id")
@json_flag("The entry as JSON (raw bytes in base64).")
@flag("--raw", "Write only the message's raw bytes to stdout.")
@refusals
def rejected_show(entry_id: str, as_json: bool, raw: bool) -> None:
    """One refused message: why, when, from where, and its bytes."""
    with closing(_store()) as store:
        entry = store.get(entry_id)
    if raw:
        sys.stdout.buffer.write(entry.raw_bytes())
        sys.stdout.buffer.flush()
        return
    if as_json:
        _dump(entry.to_json())
        return
    data = entry.raw_bytes()
    cut = f" (first {len(data)} kept)" if entry.truncated else ""
    click.echo(f"id         {entry.id}")
    click.echo(f"at         {_when(entry)} UTC")
    click.echo(f"queue      {entry.queue}")
    click.echo(f"reason     {entry.reason}")
    click.echo(f"bytes      {entry.size}{cut}")
    click.echo(f"raw        {data[:2000].decode('utf-8', 'backslashreplace')!s}")


@rejected.command("purge")
@flag("--yes", "Do not ask.")
@refusals
def rejected_purge(yes: bool) -> None:
    """Delete every refused message from the rejected-message store."""
    with closing(_store()) as store:
        if not yes:
            click.confirm(f"delete every rejected message in {store.where}?", abort=True)
        count = store.purge()
    click.echo(f"purged {count} rejected message(s) from {store.where}")
