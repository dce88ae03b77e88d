"""Checks a worker makes before it consumes anything: ``worker_init`` refuses a bad fleet config.

Two checks: the broker's visibility timeout (RabbitMQ: its consumer timeout) against
the longest turn (below), and that every Redis store keeps an append-only file (at the
end of this module).

**The broker check.** A Redis broker redelivers a message whose task has run
longer than ``visibility_timeout`` — while the first copy still runs (a 35 s task
with a 10 s timeout runs three times at once). Ratchet's fencing makes the
copies harmless, but they hold workers and hammer the lease, so a worker whose
longest possible turn does not fit in the visibility timeout refuses to start.

The longest turn is the smaller of two bounds:

- Celery's hard time limit (``RATCHET_TURN_TIME_LIMIT_S`` or ``--time-limit``),
  but only in the prefork pool: the solo and threads pools do not enforce it;
- per agent named in ``RATCHET_AGENTS``: its model call plus, in the worst case,
  every tool call its budget allows in that one turn, each tried up to
  ``TOOL_TIMEOUT_ATTEMPTS`` times — ``model_timeout_s + max_tool_calls ×
  tool_timeout_s × attempts`` (the run's deadline cuts it earlier still, but a
  call already started runs to its own timeout, so the deadline is not counted).

With neither bound (solo or threads pool, no agents listed) the longest turn is
unknown: the worker starts and logs a warning saying what to set.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from celery.signals import import_modules, worker_init

from runtime.actions import TOOL_TIMEOUT_ATTEMPTS
from tasks.delivery import declaration_refusal
from tasks.pool import pool_name
from tasks.settings import Settings, get_settings
from worker.startup import shadow_problem

log = logging.getLogger("ratchet.checks")

TIME_LIMITED_POOLS = ("prefork",)
"""Pools that enforce Celery's hard time limit by killing the pool process."""


@dataclass(frozen=True)
class LongestTurn:
    seconds: float | None
    """None when nothing bounds a turn."""
    because: str
    """What bounds it, for the operator."""


def agent_longest_turn_s(agent_file: str) -> float:
    from runtime_io.agent_files import load_agent

    spec = load_agent(agent_file).spec
    return (
        spec.model_timeout_s
        + spec.budgets.max_tool_calls * spec.tool_timeout_s * TOOL_TIMEOUT_ATTEMPTS
    )


def longest_turn(settings: Settings, pool: str, time_limit_s: float | None) -> LongestTurn:
    bounds: list[tuple[float, str]] = []
    if time_limit_s and pool in TIME_LIMITED_POOLS:
        bounds.append((float(time_limit_s), f"the turn time limit ({time_limit_s:g} s)"))
    agents = [(agent_longest_turn_s(str(f)), str(f)) for f in settings.agent_files]
    if agents:
        seconds, path = max(agents)
        bounds.append(
            (
                seconds,
                f"agent {path} (model_timeout_s + max_tool_calls x tool_timeout_s x "
                f"{TOOL_TIMEOUT_ATTEMPTS} = {seconds:g} s)",
            )
        )
    if not bounds:
        return LongestTurn(None, f"the {pool} pool does not enforce the turn time limit")
    return LongestTurn(*min(bounds))


def broker_problem(
    settings: Settings, broker_url: str, pool: str, time_limit_s: float | None
) -> str | None:
    """One line saying why this worker must not start, or None."""
    if broker_url.startswith(("amqp", "amqps", "pyamqp")):
        return _consumer_timeout_problem(settings, pool, time_limit_s)
    if not broker_url.startswith(("redis", "rediss", "sentinel")):
        return None
    turn = longest_turn(settings, pool, time_limit_s)
    visibility_s = settings.visibility_timeout_s
    if turn.seconds is None:
        log.warning(
            "cannot tell the longest turn: %s and RATCHET_AGENTS names no agent; a turn "
            "longer than the Redis visibility timeout (%s s) is delivered twice",
            turn.because,
            visibility_s,
        )
        return None
    if turn.seconds < visibility_s:
        return None
    return (
        f"ratchet: refusing to start: RATCHET_VISIBILITY_TIMEOUT_S ({visibility_s} s) is not "
        f"longer than the longest turn, {turn.seconds:g} s ({turn.because}, {pool} pool); "
        "Redis would deliver such a turn again while it still runs. Raise "
        f"RATCHET_VISIBILITY_TIMEOUT_S above {turn.seconds:g}, or lower the agent's timeouts"
    )


def _consumer_timeout_problem(
    settings: Settings, pool: str, time_limit_s: float | None
) -> str | None:
    # RabbitMQ closes a channel holding a delivery unacknowledged past its consumer_timeout:
    # the worker exits (Celery 5.7, RabbitMQ 3.10) and the turn, with every other it held, runs again.
    turn = longest_turn(settings, pool, time_limit_s)
    timeout_s = settings.amqp_consumer_timeout_s
    if turn.seconds is None:
        log.warning(
            "cannot tell the longest turn: %s and RATCHET_AGENTS names no agent; a turn "
            "longer than RabbitMQ's consumer_timeout (%s s) closes the worker's channel",
            turn.because,
            timeout_s,
        )
        return None
    if turn.seconds < timeout_s:
        return None
    return (
        f"ratchet: refusing to start: RATCHET_AMQP_CONSUMER_TIMEOUT_S ({timeout_s} s, RabbitMQ's "
        f"consumer_timeout) is not longer than the longest turn, {turn.seconds:g} s "
        f"({turn.because}, {pool} pool); RabbitMQ would close the worker's channel and deliver "
        "the turn again. Raise consumer_timeout in rabbitmq.conf, and "
        f"RATCHET_AMQP_CONSUMER_TIMEOUT_S with it, above {turn.seconds:g} s, or lower "
        "RATCHET_TURN_TIME_LIMIT_S"
    )


@worker_init.connect
def _check_at_worker_start(sender: Any = None, **_: Any) -> None:
    from runtime.errors import RatchetError

    conf = sender.app.conf
    try:
        problem = broker_problem(
            get_settings(),
            conf.broker_url or "",
            pool_name(sender.pool_cls),
            getattr(sender, "time_limit", None),
        )
    except (RatchetError, OSError) as exc:
        problem = f"ratchet: refusing to start: an agent in RATCHET_AGENTS cannot be loaded: {exc}"
    if problem is not None:
        # SystemExit passes through Celery's signal dispatch (it catches Exception only).
        print(problem, file=sys.stderr, flush=True)
        raise SystemExit(2)


# --- the store persistence check ---------------------------------------------------
#
# A Redis store that keeps nothing durable comes back from a restart empty, or at its
# last RDB save: the runs' events and snapshots roll back to that point, the leases
# and tool journals with them, and the sweeper resumes each run from where the store
# says it was — re-running every tool call since, idempotent or not (issue 9: ten
# refunds charged twice, all "completed"). Only the append-only file records every
# write before it is acknowledged, so a store without AOF refuses to start the
# worker; RDB snapshots alone do not count. RATCHET_ALLOW_VOLATILE_STORE=1 is the
# operator saying they accept the rollback (a throwaway environment).

REDIS_STORE_SCHEMES = (
    "redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://", "rediss+cluster://"
)  # fmt: skip


@dataclass(frozen=True)
class Persistence:
    durable: bool | None
    """True with AOF on, False without, None when the server would not say."""
    evidence: str
    """What the server answered, for the operator."""


def redis_persistence(client: Any) -> Persistence:
    """Ask a Redis server whether it keeps an append-only file.

    ``CONFIG GET appendonly`` first; a server that refuses CONFIG (renamed, or denied
    by an ACL, as managed services do) is asked ``INFO persistence`` instead. Raises
    redis-py's connection errors when the server cannot be reached.
    """
    import redis

    try:
        value = client.config_get("appendonly").get("appendonly")
        if value is not None:
            return Persistence(value == "yes", f"CONFIG GET appendonly: {value}")
    except redis.exceptions.ResponseError:  # unknown command, NOPERM
        pass
    try:
        info = client.info("persistence")
    except redis.exceptions.ResponseError:
        return Persistence(None, "the server refuses both CONFIG and INFO")
    if "aof_enabled" in info:
        enabled = str(info["aof_enabled"]) == "1"
        return Persistence(enabled, f"INFO persistence: aof_enabled:{info['aof_enabled']}")
    return Persistence(None, "INFO persistence does not report aof_enabled")


def store_persistence_problem(settings: Settings) -> str | None:
    """One line saying why a Redis store makes this worker refuse to start, or None.

    Behind Sentinel, the primary and every replica the sentinels list are asked: a
    replica is the primary after a failover. On a cluster, every node it lists (and
    those its URL names). Logs a warning (and returns None) when a
    server cannot be asked, or when ``RATCHET_ALLOW_VOLATILE_STORE`` accepts a store
    without AOF.
    """
    import redis

    from store.cluster_url import ClusterUrl, is_cluster
    from store.replicas import split_replica_wait
    from store.sentinel import SentinelUrl, is_sentinel

    stores = {"snapshot store": settings.resolved_snapshot_store}
    stores["run store"] = settings.resolved_run_store
    servers: dict[tuple[Any, ...], list[tuple[str, str]]] = {}
    for name, url in stores.items():
        if url.startswith(REDIS_STORE_SCHEMES):
            try:
                plain, _ = split_replica_wait(url)  # ratchet's parameters, not the server's
                if is_sentinel(plain):
                    server = SentinelUrl.parse(plain).identity()
                elif is_cluster(plain):
                    server = ClusterUrl.parse(plain).identity()
                else:
                    kwargs = redis.connection.parse_url(plain)
                    server = (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"))
            except ValueError:
                continue  # opening the store says what is wrong with its URL
            servers.setdefault(server, []).append((name, plain))
    for named in servers.values():
        names = " and ".join(name for name, _ in named)
        for shown, persistence in _asked(named[0][1], names):
            problem = _persistence_problem(settings, names, shown, persistence)
            if problem is not None:
                return problem
    return None


def _asked(url: str, names: str) -> Iterator[tuple[str, Persistence]]:
    """Each server behind ``url`` (a primary and, behind Sentinel, its replicas; every node
    of a cluster) as an error message names it, with what it said of its AOF; one that
    cannot be asked is logged and skipped."""
    import redis

    from store.cluster_url import is_cluster
    from store.sentinel import SentinelUrl, is_sentinel
    from store.snapshots.redis import SOCKET_TIMEOUT_S, connect, disconnect, where

    servers: list[tuple[str, Callable[[], Any]]] = [(where(url), lambda: connect(url))]
    if is_cluster(url):
        servers = _cluster_nodes(url)
    if is_sentinel(url):
        parsed = SentinelUrl.parse(url)
        servers[0] = (f"{where(url)} (the primary)", servers[0][1])
        try:
            replicas = redis.sentinel.Sentinel(
                parsed.sentinels,
                sentinel_kwargs=parsed.sentinel_kwargs(socket_timeout=SOCKET_TIMEOUT_S),
            ).discover_replicas(parsed.service)
        except redis.exceptions.RedisError as exc:
            log.warning("cannot ask the sentinels of %s for replicas (%r)", where(url), exc)
            replicas = []
        for address in replicas:
            host, port = str(address[0]), int(address[1])
            servers.append(
                (
                    f"{where(url)} (replica {host}:{port})",
                    functools.partial(
                        redis.Redis,
                        host,
                        port,
                        socket_timeout=SOCKET_TIMEOUT_S,
                        **parsed.primary_kwargs(),
                    ),
                )
            )
    for shown, opener in servers:
        client = opener()
        try:
            yield shown, redis_persistence(client)
        except redis.exceptions.RedisError as exc:
            log.warning(
                "cannot check that the %s's Redis at %s keeps an append-only file (%s); "
                "without AOF a restart rolls runs back and re-runs their tools",
                names,
                shown,
                type(exc).__name__,
            )
        finally:
            disconnect(client)


def _cluster_nodes(url: str) -> list[tuple[str, Callable[[], Any]]]:
    """Every node of the cluster ``url`` names, primaries and replicas (a replica is a
    primary after a failover), with an opener of a plain client of each."""
    import redis

    from runtime.errors import StoreError
    from store.cluster_url import ClusterUrl
    from store.snapshots.redis import SOCKET_TIMEOUT_S, connect, disconnect, where

    parsed = ClusterUrl.parse(url)
    nodes = set(parsed.nodes)
    try:
        client = connect(url)
        try:
            listed = client.cluster_nodes()
        finally:
            disconnect(client)
        for address, node in listed.items():
            if "noaddr" not in str(node.get("flags", "")):
                host, _, port = str(address).rpartition(":")
                nodes.add((host, int(port.split("@")[0])))
    except (StoreError, redis.exceptions.RedisError) as exc:
        log.warning("cannot ask the cluster %s for its nodes (%r)", where(url), exc)
    return [
        (
            f"{where(url)} (node {host}:{port})",
            functools.partial(
                redis.Redis, host, port, socket_timeout=SOCKET_TIMEOUT_S, **parsed.client_kwargs()
            ),
        )
        for host, port in sorted(nodes)
    ]


def _persistence_problem(
    settings: Settings, names: str, shown: str, persistence: Persistence
) -> str | None:
    if persistence.durable is None:
        log.warning(
            "cannot tell whether the %s's Redis at %s keeps an append-only file (%s); "
            "make sure it runs with appendonly yes: without it a restart rolls runs "
            "back and re-runs their tools",
            names,
            shown,
            persistence.evidence,
        )
    elif not persistence.durable and settings.allow_volatile_store:
        log.warning(
            "the %s's Redis at %s keeps no append-only file (%s); started anyway "
            "because RATCHET_ALLOW_VOLATILE_STORE is set: a restart of it rolls runs "
            "back and re-runs their tools",
            names,
            shown,
            persistence.evidence,
        )
    elif not persistence.durable:
        return (
            f"ratchet: refusing to start: the {names}'s Redis at {shown} keeps no "
            f"append-only file ({persistence.evidence}), so a restart rolls runs back and "
            "re-runs tools that already ran (RDB snapshots alone lose the writes since "
            "the last save); run it with `--appendonly yes` (CONFIG SET appendonly yes), "
            "or set RATCHET_ALLOW_VOLATILE_STORE=1 to accept the rollback"
        )
    return None


@worker_init.connect
def _check_store_persistence(**_: Any) -> None:
    problem = store_persistence_problem(get_settings())
    if problem is not None:
        print(problem, file=sys.stderr, flush=True)
        raise SystemExit(2)


# --- stores, broker and tasks at start (issue 10) -----------------------------

PROBE_RUN_ID_PREFIX = "ratchet-start-check-"
"""Run id of the probe a starting worker reads and leases; no run ever has it."""
EXPECTED_TASKS = (
    "ratchet.start",
    "ratchet.turn",
    "ratchet.continue",
    "ratchet.cancel",
    "ratchet.resume",
    "ratchet.sweep",
    "ratchet.reconcile",
)
"""Every task a worker must have registered before it consumes a message."""


def store_problems(settings: Settings) -> list[str]:
    """Open each store and make a real round trip; one line per store that cannot be used.

    The snapshot store reads and deletes a probe snapshot, the run store takes and
    releases a probe lease (no run record is written). URLs are shown without passwords.
    """
    import uuid

    from runtime.errors import RatchetError
    from store import RunStore, SnapshotStore, open_run_store, open_snapshot_store
    from tasks.settings import masked

    probe = PROBE_RUN_ID_PREFIX + uuid.uuid4().hex[:16]
    problems = []
    checks = (
        ("RATCHET_SNAPSHOT_STORE", settings.resolved_snapshot_store, _snapshot_round_trip),
        (
            "RATCHET_RUN_STORE",
            settings.resolved_run_store,
            lambda store, probe: _run_store_round_trip(store, probe, settings.max_clock_skew_s),
        ),
    )
    opener: dict[str, Callable[..., SnapshotStore | RunStore]] = {
        "RATCHET_SNAPSHOT_STORE": open_snapshot_store,
        "RATCHET_RUN_STORE": open_run_store,
    }
    for variable, url, round_trip in checks:
        try:
            store = opener[variable](url, redis_prefix=settings.redis_prefix)
            try:
                round_trip(store, probe)
            finally:
                store.close()
        except (RatchetError, OSError, ValueError, ImportError) as exc:
            problem = " ".join(str(exc).split()) or type(exc).__name__
            problems.append(
                f"ratchet: refusing to start: {variable}={masked(url)} cannot be used: {problem}"
            )
    return problems


def _snapshot_round_trip(store: Any, probe: str) -> None:
    store.load_document(probe)
    store.delete(probe)


def _run_store_round_trip(store: Any, probe: str, max_skew_s: float) -> None:
    from runtime.errors import ClockSkewed

    # First: the probe lease is then taken on the store's clock.
    reading = store.measure_clock()
    if reading is not None and abs(reading.offset_ms) > max_skew_s * 1000:
        raise ClockSkewed(reading.offset_ms, max_skew_s, reading.source)
    store.get(probe)
    if not store.acquire_lease(probe, probe, 5.0):
        raise OSError(f"the probe lease {probe} is held by someone else")
    store.release_lease(probe, probe)


def broker_unreachable(app: Any, retries: int) -> str | None:
    """Connect to the broker, retrying ``retries`` times (1-5 s apart); None, or why not."""
    from tasks.settings import masked

    connection = app.connection_for_write()
    try:
        connection.ensure_connection(
            max_retries=retries, interval_start=1, interval_step=1, interval_max=5
        )
    except Exception as exc:  # kombu raises the transport's own errors; all mean "not usable"
        problem = " ".join(str(exc).split()) or type(exc).__name__
        return (
            f"ratchet: refusing to start: the broker RATCHET_BROKER_URL="
            f"{masked(app.conf.broker_url or '')} cannot be reached after {retries} retries "
            f"({problem}); start it, fix the URL, or raise RATCHET_BROKER_START_RETRIES"
        )
    finally:
        connection.release()
    return None


def missing_tasks(registered: Any) -> list[str]:
    return [name for name in EXPECTED_TASKS if name not in registered]


def _refuse(problem: str) -> None:
    print(problem, file=sys.stderr, flush=True)
    raise SystemExit(2)


@import_modules.connect
def _check_ratchet_is_imported(sender: Any = None, **_: Any) -> None:
    # Before Celery imports the task modules: a shadowing `store.py` would otherwise end
    # in an ImportError traceback, a shadowing `tasks.py` in a worker with no tasks.
    problem = shadow_problem()
    if problem is not None:
        _refuse(problem)


@worker_init.connect
def _check_tasks_stores_and_broker(sender: Any = None, **_: Any) -> None:
    app = sender.app
    if app.main != "ratchet":
        return  # another Celery app in this process (bench/selfchain.py's baseline)
    missing = missing_tasks(app.tasks)
    if missing:
        shadow = shadow_problem()
        _refuse(
            shadow
            or f"ratchet: refusing to start: ratchet's tasks {', '.join(missing)} are not "
            "registered; start the worker with `celery -A worker worker` from a directory "
            "that holds no module named like ratchet's packages (tasks, store, runtime)"
        )
    problems = store_problems(get_settings())
    if problems:
        _refuse(problems[0])
    problem = broker_unreachable(app, get_settings().broker_start_retries)
    if problem is not None:
        _refuse(problem)
    refusal = declaration_refusal(app)
    if refusal is not None:
        _refuse(f"ratchet: refusing to start: {refusal}")
