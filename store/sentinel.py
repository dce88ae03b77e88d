"""Redis behind Sentinel: one URL for the stores and the broker, parsed once.

::

    redis+sentinel://[[user]:password@]host:port[,host:port…]/service[/db][?sentinel_username=…&sentinel_password=…]

``host:port`` are the sentinels (port 26379 when left out), ``service`` the name
they monitor the primary under (``sentinel monitor <service> …``), ``db`` the
database (0 when left out). ``user``/``password`` are the primary's and its
replicas'; ``sentinel_username``/``sentinel_password`` the sentinels' own, when
they require one. The form is the one several Redis clients already read
(``redis+sentinel://host:port,host:port/service/db``).

A client made from it asks the sentinels where the primary is when it connects,
and again whenever its connection to the primary fails or finds a replica there:
after a failover every process finds the promoted replica by itself, without a
restart or a new setting.

The broker needs kombu's form instead (``sentinel://host:port;sentinel://host:port/db``
with the ``master_name`` transport option): :meth:`SentinelUrl.kombu` renders it, and
:meth:`SentinelUrl.from_kombu` reads it back (a team's own app configured that way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from store.hosts import address, credentials, netloc

SCHEME = "redis+sentinel"
FORM = "redis+sentinel://[[user]:password@]host:port[,host:port…]/service[/db]"
DEFAULT_PORT = 26379
_QUERY = ("sentinel_username", "sentinel_password")


def is_sentinel(url: str) -> bool:
    return url.startswith(f"{SCHEME}://")


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    """The name the sentinels monitor the primary under."""
    db: int = 0
    username: str | None = None
    password: str | None = None
    """The primary's (and its replicas') credentials."""
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelUrl:
        """ValueError naming what is wrong and the accepted form."""
        parts = urlsplit(url)
        if parts.scheme != SCHEME:
            raise ValueError(f"not a {SCHEME}:// URL; use {FORM}")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        username, password = credentials(userinfo)
        sentinels = tuple(
            address(h, "sentinel", DEFAULT_PORT, FORM) for h in hosts.split(",") if h.strip()
        )
        if not sentinels:
            raise ValueError(f"name at least one sentinel (host:port); use {FORM}")
        path = [unquote(p) for p in parts.path.split("/")[1:] if p]
        if not path or len(path) > 2:
            raise ValueError(f"name the service the sentinels monitor, then the db; use {FORM}")
        db = _db(path[1]) if len(path) == 2 else 0
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        unknown = sorted(set(query) - set(_QUERY))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {', '.join(unknown)}; accepted: {', '.join(_QUERY)}"
            )
        return cls(
            sentinels,
            path[0],
            db,
            username,
            password,
            query.get("sentinel_username") or None,
            query.get("sentinel_password") or None,
        )

    @classmethod
    def from_kombu(cls, url: str, transport_options: dict[str, Any]) -> SentinelUrl:
        """kombu's ``sentinel://[:password@]host:port[;sentinel://host:port…][/db]`` with its
        ``master_name`` (and ``sentinel_kwargs``) transport options."""
        master = transport_options.get("master_name")
        if not master:
            raise ValueError(
                "a sentinel:// broker needs the `master_name` transport option; "
                f"or give RATCHET_BROKER_URL as {FORM}"
            )
        first = urlsplit(url.split(";", 1)[0])
        sentinels = tuple(
            address(urlsplit(each).netloc.rpartition("@")[2], "sentinel", DEFAULT_PORT, FORM)
            for each in url.split(";")
            if each.strip()
        )
        username, password = credentials(first.netloc.rpartition("@")[0])
        db = next((p for p in first.path.split("/") if p), "0")
        own = transport_options.get("sentinel_kwargs") or {}
        return cls(
            sentinels,
            str(master),
            _db(db),
            username,
            password,
            own.get("username"),
            own.get("password"),
        )

    def kombu(self) -> tuple[str, dict[str, Any]]:
        """The broker URL and transport options kombu's Sentinel transport reads."""
        userinfo = ""
        if self.password is not None or self.username is not None:
            userinfo = (
                f"{quote(self.username or '', safe='')}:{quote(self.password or '', safe='')}@"
            )
        hosts = [f"sentinel://{netloc(host, port)}" for host, port in self.sentinels]
        hosts[0] = f"sentinel://{userinfo}{netloc(*self.sentinels[0])}/{self.db}"
        options: dict[str, Any] = {"master_name": self.service}
        if self.sentinel_kwargs():
            options["sentinel_kwargs"] = self.sentinel_kwargs()
        return ";".join(hosts), options

    def sentinel_kwargs(self, **socket: Any) -> dict[str, Any]:
        """What a client of the sentinels themselves is given (their credentials, ``socket``)."""
        own = {"username": self.sentinel_username, "password": self.sentinel_password}
        return {**socket, **{k: v for k, v in own.items() if v is not None}}

    def primary_kwargs(self) -> dict[str, Any]:
        """What a connection to the primary is given besides its address."""
        own = {"db": self.db, "username": self.username, "password": self.password}
        return {k: v for k, v in own.items() if v is not None}

    def url(self) -> str:
        """This URL in ratchet's form, credentials included."""
        userinfo = ""
        if self.password is not None or self.username is not None:
            password = "" if self.password is None else f":{quote(self.password, safe='')}"
            userinfo = f"{quote(self.username or '', safe='')}{password}@"
        hosts = ",".join(netloc(h, p) for h, p in self.sentinels)
        own = {
            "sentinel_username": self.sentinel_username,
            "sentinel_password": self.sentinel_password,
        }
        query = "&".join(f"{k}={quote(v, safe='')}" for k, v in own.items() if v is not None)
        return f"{SCHEME}://{userinfo}{hosts}/{quote(self.service, safe='')}/{self.db}" + (
            f"?{query}" if query else ""
        )

    def shown(self) -> str:
        """The URL without passwords, fit for a message."""
        user = f"{self.username or ''}:***@" if self.password is not None else ""
        if self.username is not None and self.password is None:
            user = f"{self.username}@"
        hosts = ",".join(netloc(h, p) for h, p in self.sentinels)
        return f"{SCHEME}://{user}{hosts}/{quote(self.service, safe='')}/{self.db}"

    def identity(self) -> tuple[Any, ...]:
        """Which keyspace a client of this URL writes: the same for two URLs naming the
        same service, database and user through any of its sentinels' lists."""
        return ("sentinel", self.service, frozenset(self.sentinels), self.db, self.username)


def _db(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"database `{text}` is not a number; use {FORM}")
    return int(text)
