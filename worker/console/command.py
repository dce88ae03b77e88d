"""``ratchet console``: serve the operator console (registered on :mod:`worker.cli`'s group)."""

from __future__ import annotations

import ipaddress
import logging

import click

from runtime.errors import ExtraMissing
from worker.cli_base import main, refusals

log = logging.getLogger("ratchet.console")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@main.command("console")
@click.option("--host", default=None, help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to listen on (default 8765).")
@refusals
def console(host: str | None, port: int | None) -> None:
    """Serve the operator console: runs, a run's timeline, and the actions, in a browser.

    Log in with RATCHET_CONSOLE_TOKEN. Needs `pip install 'ratchet[console]'`.
    """
    try:
        import uvicorn

        from worker.console.app import make_app
    except ImportError as exc:
        raise ExtraMissing("console", exc.name) from exc
    from worker.api import Ratchet
    from worker.console.auth import console_settings, console_token

    settings = console_settings()
    token = console_token(settings)
    host = host or settings.host
    port = port or settings.port
    if not _loopback(host):
        click.echo(
            f"ratchet: the console listens on {host}, beyond this machine, over plain HTTP; "
            "put it behind TLS",
            err=True,
        )
    click.echo(f"ratchet console on http://{host}:{port}/ (log in with RATCHET_CONSOLE_TOKEN)")
    app = make_app(
        Ratchet(), token, max_streams=settings.max_streams, keepalive_s=settings.keepalive_s
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")
