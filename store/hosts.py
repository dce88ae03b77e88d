"""The ``user:password@host:port,host:port`` part of a URL that names several servers:
the Sentinels of ``redis+sentinel://`` (:mod:`store.sentinel`) and the nodes of
``redis+cluster://`` (:mod:`store.redis_cluster`) are written, and read, alike."""

from __future__ import annotations

from urllib.parse import unquote


def credentials(userinfo: str) -> tuple[str | None, str | None]:
    """The user and password of ``user:password`` (percent-decoded); None for each absent."""
    if not userinfo:
        return None, None
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None)


def address(text: str, what: str, default_port: int, form: str) -> tuple[str, int]:
    """``host[:port]`` or ``[v6]:port`` as (host, port); ValueError naming ``what`` (a
    sentinel, a node) and the accepted ``form``."""
    text = text.strip()
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"{what} `{text}` has no host; use {form}")
    try:
        number = int(port) if port else default_port
    except ValueError:
        raise ValueError(f"{what} `{text}`: the port is not a number; use {form}") from None
    if not 0 < number < 65536:
        raise ValueError(f"{what} `{text}`: the port is out of range; use {form}")
    return host, number


def netloc(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
