"""``ratchet runs watch``: a run's answer as it forms, its tools' progress, its events.

Text from the model and tools is shown as they sent it, less what a terminal would act
on: control characters other than newline and tab are shown escaped (``\\x1b``), never
written raw, so a model cannot move the cursor or retitle the window.
"""

from __future__ import annotations

import re
from typing import Any

import click

from worker.cli_base import _api, _dump, flag, json_flag, refusals, runs
from worker.render import event_line, printable
from worker.watch import Assembly, Seen

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_text(text: str) -> str:
    """``text`` as a terminal may show it: control characters escaped, surrogates replaced."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", printable(text))


class _Screen:
    """Lines for events and progress; the answer's text inline, as it comes."""

    def __init__(self) -> None:
        self.assembly = Assembly()
        self.mid_line = False

    def show(self, seen: Seen) -> None:
        text = self.assembly.add(seen)
        if seen.kind == "model.delta":
            if text:
                if not self.mid_line:
                    click.echo("       │ ", nl=False)
                click.echo(terminal_text(text).replace("\n", "\n       │ "), nl=False)
                self.mid_line = True
            return
        if seen.kind == "event" and seen.event is not None and text:
            # What the recorded answer adds to the pieces shown (none, when all came).
            click.echo(terminal_text(text).replace("\n", "\n       │ "), nl=False)
            self.mid_line = True
        self._end_line()
        if seen.kind == "event" and seen.event is not None:
            click.echo(event_line(seen.event))
        elif seen.kind == "model.aborted":
            why = terminal_text(str(seen.data.get("reason", "")))
            click.echo(f"       ✗ attempt {seen.data.get('attempt')} abandoned: {why}")
        elif seen.kind == "tool.progress":
            name = terminal_text(str(seen.data.get("name", "")))
            message = terminal_text(str(seen.data.get("message", "")))
            click.echo(f"       ⋯ {name} ({seen.data.get('call_id')}): {message}")

    def _end_line(self) -> None:
        if self.mid_line:
            click.echo("")
            self.mid_line = False


def _json(seen: Seen) -> dict[str, Any]:
    if seen.event is not None:
        return {"cursor": seen.cursor, "kind": "event", "event": seen.event.model_dump()}
    return {"cursor": seen.cursor, **seen.data, "kind": seen.kind}


@runs.command("watch")
@click.argument("run_id")
@click.option("--after", default=None, help="Go on after this cursor (from --json output).")
@flag("--until-suspended", "Stop once the run suspends or parks instead of when it finishes.")
@json_flag("One JSON object per line, each with the `cursor` to go on from.")
@refusals
def runs_watch(run_id: str, after: str | None, until_suspended: bool, as_json: bool) -> None:
    """Follow a run: its answer as it forms, its tools' progress, then each event.

    A model call streams only if its run is watched as the call begins: to see a run's
    first answer form too, start it with `ratchet runs start … --watch`."""
    show_run(run_id, after, until_suspended, as_json)


def show_run(run_id: str, after: str | None, until_suspended: bool, as_json: bool) -> None:
    """Print the run as `runs watch` does, until it finishes (or suspends); Ctrl-C prints
    the command that goes on from where it stopped."""
    screen = _Screen()
    last = after
    try:
        for seen in _api().stream(run_id, after=after, until_suspended=until_suspended):
            last = seen.cursor
            if as_json:
                _dump(_json(seen))
            else:
                screen.show(seen)
        screen._end_line()
    except KeyboardInterrupt:
        screen._end_line()
        if last is not None:
            click.echo(f"go on from here: ratchet runs watch {run_id} --after {last}", err=True)
        raise SystemExit(130) from None
