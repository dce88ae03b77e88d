"""``ratchet limits``: each limit's use now, and changing limits and caps at run time.

``ratchet limits`` lists every limit key the fleet has used (requests and tokens
this minute against the limit in force, how far its schedule runs ahead, the runs
waiting in its lines, a 429's hold) and every concurrency cap (places held, runs
waiting). ``set`` / ``unset`` and ``cap`` / ``uncap`` change them in the limit store;
running workers read the change within a few seconds (tasks/limits.py) — no restart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from runtime.limits import check_key
from runtime.numbers import is_finite
from store.limits import LimitStore
from worker.cli_base import _dump, finite, json_flag, main, refusals


def _store() -> Any:
    from tasks.context import get_context
    from tasks.limits import limit_store

    return limit_store(get_context())


@main.group(invoke_without_command=True)
@json_flag("One JSON object: limits and caps.")
@click.pass_context
@refusals
def limits(context: click.Context, as_json: bool) -> None:
    """Fleet-wide model rate limits and concurrency caps, and their use right now."""
    if context.invoked_subcommand is not None:
        return
    store = _store()
    keys, caps = store.known()
    overrides, cap_overrides = store.overrides(), store.cap_overrides()
    shown_limits = []
    for key in keys:
        use = store.use(key)
        shown_limits.append(
            {
                "key": key,
                "set_at_run_time": overrides.get(key, {}),
                "requests_this_minute": use.requests_this_minute,
                "tokens_this_minute": use.tokens_this_minute,
                "ahead_s": {unit: round(s, 3) for unit, s in use.ahead_s.items()},
                "blocked_s": round(use.blocked_s, 3),
                "waiting": {"under_way": use.waiting[0], "new": use.waiting[1]},
            }
        )
    shown_caps = []
    for cap_key in caps:
        use = store.cap_use(cap_key)
        shown_caps.append(
            {
                "key": cap_key,
                "set_at_run_time": cap_overrides.get(cap_key),
                "holders": list(use.holders),
                "waiting": list(use.waiting),
            }
        )
    if as_json:
        _dump({"limits": shown_limits, "caps": shown_caps})
        return
    if not shown_limits and not shown_caps:
        click.echo("no limits used yet (set them in an agent file's [limits], or `limits set`)")
    for item in shown_limits:
        set_now = ", ".join(f"{k}={v}" for k, v in sorted(item["set_at_run_time"].items()))
        ahead = ", ".join(f"{u} {s:g} s" for u, s in item["ahead_s"].items()) or "-"
        click.echo(
            f"{item['key']}: {item['requests_this_minute']} requests, "
            f"{item['tokens_this_minute']} tokens this minute; ahead {ahead}; waiting "
            f"{item['waiting']['under_way']} under way + {item['waiting']['new']} new"
            + (f"; held off {item['blocked_s']:g} s (429)" if item["blocked_s"] else "")
            + (f"; set at run time: {set_now}" if set_now else "")
        )
    for item in shown_caps:
        click.echo(
            f"{item['key']}: {len(item['holders'])} in progress, {len(item['waiting'])} waiting"
            + (
                f"; cap set at run time: {item['set_at_run_time']}"
                if item["set_at_run_time"]
                else ""
            )
        )


@limits.command("set")
@click.argument("key")
@click.option("--rpm", type=click.IntRange(min=1), default=None, help="Requests a minute.")
@click.option("--tpm", type=click.IntRange(min=1), default=None, help="Tokens a minute.")
@click.option(
    "--burst-s", type=finite(min=0, min_open=True, max=60), default=None,
    help="How far ahead of even spacing calls may run, in seconds of the rate.",
)  # fmt: skip
@refusals
def limits_set(key: str, rpm: int | None, tpm: int | None, burst_s: float | None) -> None:
    """Set KEY's limits at run time (over the agent files'); workers follow within seconds."""
    check_key(key, "a limit key")
    values = {
        name: value
        for name, value in (
            ("requests_per_minute", rpm), ("tokens_per_minute", tpm), ("burst_s", burst_s)
        )
        if value is not None
    }  # fmt: skip
    if not values:
        raise click.UsageError("give --rpm, --tpm or --burst-s")
    store = _store()
    # A stored value that is not a finite number (set before they were refused) is dropped.
    kept = {k: v for k, v in store.overrides().get(key, {}).items() if is_finite(v)}
    store.set_override(key, {**kept, **values})
    click.echo(f"{key}: " + ", ".join(f"{k}={v}" for k, v in sorted(values.items())))


# A negative count is an argument to refuse by its range, not an unknown option `-1`.
@limits.command("cap", context_settings={"ignore_unknown_options": True})
@click.argument("key")
@click.argument("places", type=click.IntRange(min=1))
@refusals
def limits_cap(key: str, places: int) -> None:
    """At most PLACES runs in progress under KEY (`agent:NAME`, or `key:TENANT`)."""
    check_key(key, "a concurrency key")
    _store().set_cap_override(key, places)
    click.echo(f"{key}: at most {places} runs in progress")


def _dropping(name: str, what: str, drop: Callable[[LimitStore, str], None],
              applies: str, help: str) -> None:  # fmt: skip
    """Register ``ratchet limits NAME KEY``: drop KEY's run-time value, say what applies."""

    @limits.command(name, help=help)
    @click.argument("key")
    @refusals
    def dropped(key: str) -> None:
        drop(_store(), check_key(key, what))
        click.echo(f"{key}: {applies}")


_dropping("unset", "a limit key", lambda store, key: store.set_override(key, None),
          "the agent files' limits apply", "Drop KEY's run-time limits: the agent files' apply again.")  # fmt: skip
_dropping("uncap", "a concurrency key", lambda store, key: store.set_cap_override(key, None),
          "the agent files' cap applies", "Drop KEY's run-time cap: the agent files' apply again.")  # fmt: skip
