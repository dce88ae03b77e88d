"""The console's web app (Starlette): server-rendered pages, a little inline JS, no CDN.

Pages: ``/`` runs (filter by status and agent, paginated, counts per status),
``/runs/{id}`` a run (status, usage against budgets, time running and suspended,
what it waits for, the open call, the transcript, the event timeline). Both parts
marked live are fetched again every ``POLL_MS`` by an inline script and swapped in
when they changed. A run page also opens ``/runs/{id}/stream`` (server-sent events,
:func:`worker.watch.watch`): the model's answer shows as it forms and each tool's
progress as it reports it; each event's ``id`` is its watch cursor, so a browser that
reconnects (``Last-Event-ID``) misses nothing and sees nothing twice. Actions are POSTs to ``/runs/{id}/{action}``: the first shows a
confirmation, the confirmed one calls the API (:mod:`worker.console.actions`).

Defences, since run data comes from outside: Jinja2 autoescape everywhere; a CSP
that allows only this page's own nonce-tagged script and style; no framing; every
POST needs the session's CSRF token and a same-origin ``Origin`` when one is sent.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import anyio
import anyio.to_thread
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from runtime import json_values
from runtime.errors import InvalidRunId, RatchetError, RunNotFound
from runtime.models import RunStatus, validate_run_id
from worker.api import Ratchet
from worker.console import actions, views
from worker.console.auth import COOKIE, LoginThrottle, Session, Sessions, same_secret
from worker.watch import Seen

POLL_MS = 1500
"""How often a run page asks whether its run moved (cheap: one record read)."""
LIST_POLL_MS = 3000
"""How often the runs page reads its list and counts again (a list read per status)."""
MAX_FORM_BYTES = 64 * 1024
MAX_STREAMS = 64
"""Run pages a console streams to at once by default (``RATCHET_CONSOLE_MAX_STREAMS``); one
more is answered 503 with Retry-After. Each holds a thread of its own while it waits,
never one the pages' requests need."""
KEEPALIVE_S = 15.0
"""A comment line this often on a quiet stream: proxies keep the connection open, and a
browser that went away is noticed (the watcher's thread is given back) at the latest then."""

_templates = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=select_autoescape(["html"], default=True),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_templates.globals.update(when=views.when, statuses=[s.value for s in RunStatus])


class Console:
    """The app's state: the API it calls, the token it checks, the sessions it gave out."""

    def __init__(
        self,
        api: Ratchet,
        token: str,
        max_streams: int = MAX_STREAMS,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.api = api
        self.keepalive_s = keepalive_s
        self.token = token
        self.sessions = Sessions()
        self.throttle = LoginThrottle()
        self.max_streams = max_streams
        self.streams = anyio.CapacityLimiter(max_streams)
        self.streaming = 0

    # --- responses ------------------------------------------------------------

    def page(
        self,
        template: str,
        status_code: int = 200,
        session: Session | None = None,
        **values: Any,
    ) -> HTMLResponse:
        nonce = secrets.token_urlsafe(16)
        flashes = []
        # A live fragment shows no flashes, so it must not use them up.
        if session is not None and not template.startswith("_"):
            flashes, session.flashes = session.flashes, []
        values.setdefault("poll_ms", POLL_MS)
        html = _templates.get_template(template).render(
            nonce=nonce,
            csrf=session.csrf if session else "",
            logged_in=session is not None,
            flashes=flashes,
            **values,
        )
        return HTMLResponse(html, status_code, headers=_headers(nonce))

    # --- who is asking --------------------------------------------------------

    def session(self, request: Request) -> Session | None:
        return self.sessions.get(request.cookies.get(COOKIE))

    def unless_bearer(self, request: Request) -> Response | None:
        """None for a request with the right bearer token; else its refusal: 429 while
        its address must wait, or the login page (a wrong token counts as a failure)."""
        refused = self.throttled(request)
        if refused is not None:
            return refused
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            if same_secret(value.strip(), self.token):
                return None
            self.throttle.failed(_address(request))
        return self.login_redirect(request)

    def throttled(self, request: Request) -> Response | None:
        """429 while the client's address has sent too many wrong tokens lately; else None."""
        wait_s = self.throttle.wait_s(_address(request))
        if not wait_s:
            return None
        seconds = max(1, math.ceil(wait_s))
        response = self.page(
            "login.html",
            429,
            next="/",
            error=f"too many wrong tokens from this address: try again in {seconds} s",
        )
        response.headers["Retry-After"] = str(seconds)
        return response

    def login_redirect(self, request: Request) -> Response:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse("/login?" + urlencode({"next": target}), 303)

    async def form(self, request: Request, session: Session) -> dict[str, str] | None:
        """The POSTed form if it carries the session's CSRF token from this origin; else None."""
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return None
        length = request.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_FORM_BYTES:
            return None
        async with request.form(max_files=0, max_fields=32) as form:
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
        if not same_secret(fields.get("csrf"), session.csrf):
            return None
        return fields

    # --- routes -----------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        return self.page("login.html", next=_local(request.query_params.get("next")), error="")

    async def login(self, request: Request) -> Response:
        refused = self.throttled(request)
        if refused is not None:
            return refused
        async with request.form(max_files=0, max_fields=4) as form:
            token = form.get("token")
            target = _local(str(form.get("next") or "/"))
        if not isinstance(token, str) or not same_secret(token, self.token):
            self.throttle.failed(_address(request))
            return self.page(
                "login.html", 401, next=target, error="wrong token: the console refused it"
            )
        self.throttle.succeeded(_address(request))
        session_id, _ = self.sessions.open()
        response = RedirectResponse(target, 303)
        response.set_cookie(
            COOKIE,
            session_id,
            max_age=int(self.sessions.lifetime_s),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request) -> Response:
        session = self.session(request)
        if session is not None and await self.form(request, session) is not None:
            self.sessions.close(request.cookies.get(COOKIE))
        response = RedirectResponse("/login", 303)
        response.delete_cookie(COOKIE)
        return response

    async def runs(self, request: Request) -> Response:
        session = self.session(request)
        denied = None if session is not None else self.unless_bearer(request)
        if denied is not None:
            return denied
        params = request.query_params
        status = params.get("status", "")
        if status and status not in RunStatus.__members__.values():
            return self.page("error.html", 400, session, message=f"unknown status {status!r}")
        page_number = int(params["page"]) if params.get("page", "").isdigit() else 1
        listing = await run_in_threadpool(
            views.runs_page, self.api, status, params.get("agent", "").strip(), max(page_number, 1)
        )
        template = "_runs_live.html" if params.get("live") else "runs.html"
        return self.page(
            template,
            session=session,
            listing=listing,
            live_src=_live_src(request),
            poll_ms=LIST_POLL_MS,
        )

    async def run(self, request: Request) -> Response:
        session = self.session(request)
        denied = None if session is not None else self.unless_bearer(request)
        if denied is not None:
            return denied
        live = bool(request.query_params.get("live"))
        seen = request.query_params.get("version")
        if live and seen:
            # The poll's cheap path: one record read, no events, when nothing moved.
            try:
                record = await run_in_threadpool(self.api.get, request.path_params["run_id"])
            except (InvalidRunId, RunNotFound):
                return Response(status_code=404)
            if f"{record.status.value}:{record.last_seq}" == seen:
                return Response(status_code=204, headers={"Cache-Control": "no-store"})
        return await self._run_page(request, session, live=live)

    async def stream(self, request: Request) -> Response:
        """The run's answer as it forms, its tools' progress and its events, as
        server-sent events (``delta``, ``aborted``, ``progress``, ``event``)."""
        session = self.session(request)
        denied = None if session is not None else self.unless_bearer(request)
        if denied is not None:
            return denied
        after = request.headers.get("last-event-id") or request.query_params.get("after")
        try:
            seen = self.api.stream(
                request.path_params["run_id"], after=after or None, idle_s=self.keepalive_s
            )
        except (InvalidRunId, RunNotFound) as exc:
            return PlainTextResponse(actions.refusal_line(exc), 404)
        except RatchetError as exc:
            return PlainTextResponse(actions.refusal_line(exc), 400)
        if self.streaming >= self.max_streams:
            retry = {"Retry-After": "5", "Cache-Control": "no-store"}
            busy = f"this console streams to {self.max_streams} pages already; try again shortly"
            return PlainTextResponse(busy, 503, headers=retry)
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            self._server_sent(seen), media_type="text/event-stream", headers=headers
        )

    async def _server_sent(self, seen: Iterator[Seen]) -> AsyncIterator[bytes]:
        """``seen`` as server-sent events; each blocking step of the watcher in a thread
        of the streams' own, apart from the pool the pages' requests use."""
        self.streaming += 1
        try:
            async for chunk in _server_sent(seen, self.streams):
                yield chunk
        finally:
            self.streaming -= 1

    async def _run_page(
        self,
        request: Request,
        session: Session | None,
        live: bool = False,
        error: str = "",
        status_code: int = 200,
    ) -> Response:
        run_id = request.path_params["run_id"]
        try:
            view = await run_in_threadpool(views.run_page, self.api, validate_run_id(run_id))
        except (InvalidRunId, RunNotFound) as exc:
            return self.page("error.html", 404, session, message=actions.refusal_line(exc))
        return self.page(
            "_run_live.html" if live else "run.html",
            status_code,
            session,
            view=view,
            error=error,
            live_src=_live_src(request),
        )

    async def act(self, request: Request) -> Response:
        session = self.session(request)
        if session is None:
            return self.login_redirect(request)
        name = request.path_params["action"]
        if name not in actions.ACTIONS:
            return self.page("error.html", 404, session, message=f"no action {name!r}")
        form = await self.form(request, session)
        if form is None:
            return self.page(
                "error.html",
                403,
                session,
                message="this form is stale or not from this console: reload the page and try again",
            )
        run_id = request.path_params["run_id"]
        if form.get("confirmed") != "yes":
            return self.page(
                "confirm.html",
                session=session,
                run_id=run_id,
                name=name,
                action=actions.ACTIONS[name],
                fields=actions.carried(name, form),
            )
        try:
            outcome = await run_in_threadpool(actions.perform, self.api, name, run_id, form)
        except (RatchetError, OSError) as exc:
            return await self._run_page(
                request, session, error=actions.refusal_line(exc), status_code=409
            )
        session.flashes.append(outcome)
        return RedirectResponse(f"/runs/{run_id}", 303)


_SSE_KIND = {"model.delta": "delta", "model.aborted": "aborted", "tool.progress": "progress"}


async def _server_sent(
    seen: Iterator[Seen], threads: anyio.CapacityLimiter
) -> AsyncIterator[bytes]:
    """``seen`` as server-sent events; each blocking step of the watcher in a thread of
    ``threads``, apart from the pool the pages' requests use."""
    done = object()
    yield b"retry: 1000\n\n"
    while True:
        item = await anyio.to_thread.run_sync(next, seen, done, limiter=threads)
        if item is done:
            yield b"event: end\ndata: {}\n\n"
            return
        assert isinstance(item, Seen)
        if item.kind == "idle":
            yield b": keepalive\n\n"
            continue
        if item.event is not None:
            kind, data = "event", {"seq": item.event.seq, "type": item.event.type}
            if item.event.type == "model.responded":
                data["content"] = item.event.data.get("content") or ""
        else:
            kind, data = _SSE_KIND.get(item.kind, item.kind), item.data
        text = json_values.dumps(data, separators=(",", ":")).decode()
        yield f"id: {item.cursor}\nevent: {kind}\ndata: {text}\n\n".encode()


def _address(request: Request) -> str:
    """The client's address as the socket sees it (a proxy's, behind one)."""
    return request.client.host if request.client is not None else "unknown"


def _headers(nonce: str) -> dict[str, str]:
    return {
        "Content-Security-Policy": (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
            "connect-src 'self'; img-src 'self'; form-action 'self'; "
            "frame-ancestors 'none'; base-uri 'none'"
        ),
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        # no-referrer would make Chrome send `Origin: null` on our own forms.
        "Referrer-Policy": "same-origin",
        "Cache-Control": "no-store",
    }


_LOCAL_PATH = re.compile(r"/(?![/\\])[A-Za-z0-9/_.~%?=&+-]*")


def _local(target: str | None) -> str:
    """Only a path on this console: a login never sends a browser elsewhere.

    Browsers drop tabs and newlines from URLs and read ``\\`` as ``/``, so anything
    but plain path and query characters is refused, not cleaned.
    """
    if not target or not _LOCAL_PATH.fullmatch(target):
        return "/"
    return target


def _live_src(request: Request) -> str:
    query = dict(request.query_params)
    query["live"] = "1"
    return request.url.path + "?" + urlencode(query)


async def _healthz(request: Request) -> Response:
    return PlainTextResponse("ok")


def make_app(
    api: Ratchet, token: str, max_streams: int = MAX_STREAMS, keepalive_s: float = KEEPALIVE_S
) -> Starlette:
    """The console over ``api``, for the operators who know ``token``."""
    console = Console(api, token, max_streams, keepalive_s)
    return Starlette(
        routes=[
            Route("/healthz", _healthz),
            Route("/login", console.login_page, methods=["GET"]),
            Route("/login", console.login, methods=["POST"]),
            Route("/logout", console.logout, methods=["POST"]),
            Route("/", console.runs),
            Route("/runs/{run_id}", console.run),
            Route("/runs/{run_id}/stream", console.stream),
            Route("/runs/{run_id}/{action}", console.act, methods=["POST"]),
        ]
    )
