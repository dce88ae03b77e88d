"""``min_replicas`` on a Redis store URL: parsed at the edge, and WAIT only where it counts.

On a real primary and replica of the module's own (tests/redis_server.py): a replicated
append returns once the replica holds it; a stopped replica makes it NotReplicated with
the events written all the same; with the option off, and for model calls and idempotent
tools, no WAIT is sent (counted by the server, ``INFO commandstats``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.errors import NotReplicated, StoreUrlInvalid
from runtime.models import RunStatus
from store import open_run_store, open_snapshot_store
from store.conformance.records import event, new_run, record
from store.replicas import ReplicaWait, split_replica_wait
from store.runs import RunStore
from store.sentinel import SentinelUrl
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import LOOK_REFUND_ANSWER, drive, refunds, write_agent
from tests.redis_server import (
    RedisServer,
    _client,
    replica_caught_up,
    running_replicated_pair,
)
from tests.sentinel_servers import running_sentinel_group
from tests.workers import wait_for
from worker.checks import store_persistence_problem


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, RedisServer]]:
    with running_replicated_pair(tmp_path_factory.mktemp("replicated")) as servers:
        yield servers


@pytest.fixture
def primary(pair: tuple[RedisServer, RedisServer]) -> Iterator[RedisServer]:
    """The pair's primary, emptied (scripts too), its command counts zeroed; its replica
    running and caught up."""
    server, replica = pair
    replica.resume()  # a test that stopped it and failed must not stop this one
    server.flush()
    with _client(server.port) as client:
        client.script_flush()
    wait_for("the replica has caught up", lambda: replica_caught_up(server, replica), 10)
    with _client(server.port) as client:
        client.config_resetstat()
    yield server


def commands(server: RedisServer, name: str) -> int:
    """How many ``name`` commands the server ran since its counts were zeroed."""
    with _client(server.port) as client:
        stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


def replicated_store(primary: RedisServer, min_replicas: int, timeout_ms: int = 100) -> RunStore:
    """A run store asking for ``min_replicas``, with run ``run-1`` in it at seq 2 (appended
    plainly: the server knows the append script from then on, as it does in a run)."""
    store = open_run_store(
        f"{primary.url}/0?min_replicas={min_replicas}&replica_timeout_ms={timeout_ms}"
    )
    new_run(store, "run-1")
    store.append(record("run-1", last_seq=2, status=RunStatus.MODEL), [event(2)], owner=None)
    return store


REQUESTED = [event(3, "tool.requested", call_id="c1", name="issue_refund")]
AT_3 = record("run-1", last_seq=3, status=RunStatus.TOOLS)


# --- the URL ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "plain", "wait"),
    [
        ("redis://h:6379/0?min_replicas=1", "redis://h:6379/0", ReplicaWait(1, 1000)),
        (
            "redis://:pw@h/2?max_connections=9&min_replicas=2&replica_timeout_ms=250",
            "redis://:pw@h/2?max_connections=9",
            ReplicaWait(2, 250),
        ),
        ("unix:///run/r.sock?db=3&min_replicas=1", "unix:///run/r.sock?db=3", ReplicaWait(1)),
        ("rediss://h/0?ssl_cert_reqs=required", "rediss://h/0?ssl_cert_reqs=required", None),
    ],
)
def test_the_replica_parameters_are_taken_out_of_the_url_and_the_rest_kept_as_written(
    url: str, plain: str, wait: ReplicaWait | None
) -> None:
    assert split_replica_wait(url) == (plain, wait or ReplicaWait())


def test_a_sentinel_url_keeps_its_own_parameters_and_gives_up_the_replica_ones() -> None:
    url = "redis+sentinel://a:26379,b:26380/svc/1?sentinel_password=s3&min_replicas=1"

    plain, wait = split_replica_wait(url)

    assert wait == ReplicaWait(1)
    parsed = SentinelUrl.parse(plain)
    assert (parsed.service, parsed.db, parsed.sentinel_password) == ("svc", 1, "s3")


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("min_replicas=-1", "`min_replicas=-1`: use a whole number of replicas from 0 to 16"),
        ("min_replicas=17", "from 0 to 16"),
        ("min_replicas=one", "`min_replicas=one`"),
        ("min_replicas=", "`min_replicas=`"),
        ("replica_timeout_ms=0", "`replica_timeout_ms=0`: use a whole number of milliseconds"),
        ("replica_timeout_ms=4001", "from 1 to 4000"),
        ("min_replicas=1&min_replicas=2", "`min_replicas` is given twice"),
    ],
)
def test_a_replica_parameter_out_of_range_is_one_line_naming_it_without_the_password(
    query: str, says: str
) -> None:
    url = f"redis://ana:hunter2@127.0.0.1:1/0?{query}"
    for opener in (open_run_store, open_snapshot_store):
        with pytest.raises(StoreUrlInvalid) as refused:
            opener(url)
        message = str(refused.value)
        assert says in message and "\n" not in message
        assert "hunter2" not in message


def test_a_url_with_the_parameters_opens_both_stores_on_the_server(redis_url: str) -> None:
    url = f"{redis_url}?min_replicas=0&replica_timeout_ms=20"
    runs, snapshots = open_run_store(url), open_snapshot_store(url)
    try:
        new_run(runs, "run-1")
        assert [e.seq for e in runs.events("run-1")] == [1]
        assert snapshots.load("run-1") is None
        assert runs.replica_wait == ReplicaWait(0, 20)
        # One server, one keyspace: the transition stays one script (runs.commits_with).
        assert runs.commits_with(snapshots)
    finally:
        runs.close()
        snapshots.close()


# --- the store: WAIT on the append's own connection ---------------------------


def test_a_replicated_append_returns_once_the_replica_holds_the_events(
    primary: RedisServer, pair: tuple[RedisServer, RedisServer]
) -> None:
    store = replicated_store(primary, 1)

    store.append_replicated(AT_3, REQUESTED, owner=None)

    # WAIT counted the replica's acknowledgement: it has applied the append already.
    with _client(pair[1].port) as replica:
        assert replica.llen("ratchet:run:{run-1}:events") == 3
    assert commands(primary, "wait") == 1
    store.close()


def test_a_replicated_append_a_stopped_replica_never_acknowledges_is_not_replicated(
    primary: RedisServer, pair: tuple[RedisServer, RedisServer]
) -> None:
    store = replicated_store(primary, 1, timeout_ms=50)
    pair[1].pause()

    with pytest.raises(NotReplicated) as short:
        store.append_replicated(AT_3, REQUESTED, owner=None)

    # Written on the primary all the same: the caller must start nothing on it.
    assert store.events("run-1")[2:] == REQUESTED
    assert (short.value.acked, short.value.needed, short.value.timeout_ms) == (0, 1, 50)
    assert "0 of the 1 replica(s) it requires acknowledged it within 50 ms" in str(short.value)
    assert "`ratchet runs resume run-1`" in str(short.value)
    store.close()


@pytest.mark.parametrize("min_replicas", [0, 1])
def test_a_replicated_append_sends_a_wait_only_when_the_url_asks_for_replicas(
    primary: RedisServer, min_replicas: int
) -> None:
    store = replicated_store(primary, min_replicas)
    scripts = commands(primary, "evalsha")

    store.append_replicated(AT_3, REQUESTED, owner=None)

    assert commands(primary, "evalsha") == scripts + 1
    assert commands(primary, "wait") == min_replicas
    store.close()


# --- the turn: only a call that is not idempotent waits ------------------------


def test_only_the_journal_of_a_call_that_is_not_idempotent_waits_for_the_replica(
    primary: RedisServer, tmp_path: Path, ledger: Path
) -> None:
    # Given an agent that looks an order up (idempotent), refunds it (not), then answers
    agent = write_agent(tmp_path / "agent", LOOK_REFUND_ANSWER)
    url = f"{primary.url}/0?min_replicas=1&replica_timeout_ms=1000"
    ctx = Context(Settings(), open_snapshot_store(url), open_run_store(url))
    try:
        run_id = create_run(ctx, agent, "refund B2").run_id

        # When a worker takes its turns on a store whose URL asks for one replica
        done = drive(ctx, run_id)

        # Then one WAIT was sent in the whole run: the refund's journal entry's
        assert done.outcome == "completed"
        assert commands(primary, "wait") == 1
        assert refunds(ledger) == ["refund B2 2900"]
        waited = [e for e in ctx.runs.events(run_id) if e.type == "tool.requested"]
        assert [e.data["name"] for e in waited] == ["lookup_order", "issue_refund"]
    finally:
        ctx.close()


def test_the_aof_check_at_start_still_asks_a_sentinel_store_whose_url_has_min_replicas(
    tmp_path: Path,
) -> None:
    with running_sentinel_group(tmp_path, sentinels=1) as group:
        with _client(group.primary.port) as client:
            client.config_set("appendonly", "no")

        problem = store_persistence_problem(Settings(run_store=f"{group.url(0)}?min_replicas=1"))

        assert problem is not None and "(the primary)" in problem and "append-only" in problem
