"""The ``ratchet`` command's groups and what every command shares.

:mod:`worker.cli` and the command modules (``worker.cli_*``, the console's) all
register on these groups; :mod:`worker.cli` imports the command modules, so
``ratchet`` (``worker.cli:main``) has every command.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click

from runtime.errors import RatchetError
from runtime.numbers import NOT_FINITE, is_finite
from store.runs import RunRecord
from worker.exits import exit_for
from worker.render import shown_json

F = TypeVar("F", bound=Callable[..., Any])


def flag(name: str, help: str) -> Callable[[F], F]:
    """A boolean ``--name`` option: the command's parameter is True when it is given."""
    return click.option(name, is_flag=True, help=help)


def json_flag(help: str | None = None) -> Callable[[F], F]:
    """``--json``: the command prints JSON instead of lines (its parameter ``as_json``)."""
    return click.option("--json", "as_json", is_flag=True, help=help)


class NotFinite(click.BadParameter):
    """A number option given NaN or an infinity: one line on stderr, exit status 2."""

    def show(self, file: Any = None) -> None:
        click.echo(f"ratchet: {self.format_message()}", err=True)


class FiniteFloat(click.FloatRange):
    """click's ``FloatRange`` that refuses NaN and infinities (``FloatRange`` lets NaN
    through: it compares false with both bounds). See runtime/numbers.py."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not is_finite(number):
            raise NotFinite(f"{value} {NOT_FINITE}; give a number such as 1.5", ctx, param)
        return super().convert(number, param, ctx)


def finite(
    min: float | None = None, max: float | None = None, min_open: bool = False
) -> FiniteFloat:
    """The type of a float option: a finite number, optionally within bounds."""
    return FiniteFloat(min=min, max=max, min_open=min_open)


def refusals(fn: F) -> F:
    """Turn ratchet's errors into one line on stderr and the exit status the table gives
    (:func:`worker.exits.exit_for`: 2 for a bad option, argument or setting, else 1)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            # The reader went away (`| head`): not an error worth a line on stderr.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except FileNotFoundError as exc:
            click.echo(
                f"ratchet: no such file: {exc.filename}; check the path "
                "(agent files are .toml, e.g. examples/refund-desk.toml)",
                err=True,
            )
            sys.exit(1)
        except (RatchetError, OSError) as exc:
            message = " ".join(str(exc).split())
            click.echo(f"ratchet: {message}", err=True)
            sys.exit(exit_for(exc))

    return wrapper  # type: ignore[return-value]


def _api() -> Any:
    from worker.api import Ratchet

    return Ratchet()


def _dump(value: Any) -> None:
    click.echo(shown_json(value, sort_keys=True))


def _record_json(record: RunRecord) -> dict[str, Any]:
    return record.model_dump(mode="json")


@click.group()
@click.option(
    "-A",
    "--app",
    "app_name",
    envvar="RATCHET_APP",
    default=None,
    metavar="MODULE",
    help="Your Celery app with ratchet installed, as for `celery -A` (env RATCHET_APP): "
    "what is sent goes through it, to the broker and queues its workers read.",
)
@click.version_option(package_name="ratchet")
def main(app_name: str | None) -> None:
    """Durable LLM-agent runs on Celery."""
    if app_name:
        from runtime.errors import ConfigInvalid
        from tasks.settings import EXIT_CONFIG_INVALID
        from worker.senders import use_app

        try:
            use_app(app_name)
        except ConfigInvalid as exc:
            click.echo(f"ratchet: {exc}", err=True)
            sys.exit(EXIT_CONFIG_INVALID)


@main.group()
def runs() -> None:
    """Start, list, show and follow runs."""
