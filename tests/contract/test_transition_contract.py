"""``RunStore.commit``: a transition's events, snapshot and lease release, on every store pair.

The pairs a deployment runs: memory + memory, SQLite + file, Redis + S3
(separate calls), and the two where the run store ``commits_with`` the
snapshot store: SQLite + SQLite in one database file (the embedded default),
the whole transition one transaction, and Redis + Redis on one server and
prefix, the whole transition one atomic script. Every fence holds on both paths: a zombie's
transition (lease lost, seq moved on) writes nothing anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from runtime.errors import LeaseLost, StaleWrite
from runtime.models import Event, Message, RunState
from store.runs import Checkpoint, RunRecord, RunStore
from store.runs.redis import RedisRunStore
from store.snapshots import SnapshotStore
from store.snapshots import format as snapshot_format
from store.snapshots.redis import DEFAULT_PREFIX, RedisSnapshotStore
from tests.contract.conftest import FakeClock, open_run_store, open_snapshot_store
from tests.contract.test_snapshot_store_contract import make_state

LEASE_S = 30

PAIRS = {
    "memory+memory": ("memory", "memory", False),
    "sqlite+file": ("sqlite", "file", False),
    "sqlite+sqlite": ("sqlite", "sqlite", True),
    "redis+s3": ("redis", "s3", False),
    "redis+redis": ("redis", "redis", True),
}


@pytest.fixture(params=list(PAIRS))
def stores(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> Iterator[tuple[RunStore, SnapshotStore, bool]]:
    runs_backend, snapshots_backend, joint = PAIRS[request.param]
    runs = open_run_store(runs_backend, request, tmp_path, clock)
    snapshots = open_snapshot_store(snapshots_backend, request, tmp_path)
    yield runs, snapshots, joint
    snapshots.close()
    runs.close()


def said(state: RunState, text: str) -> RunState:
    """``state`` one seq on, the assistant having said ``text``."""
    message = Message(role="assistant", content=text)
    return state.model_copy(
        update={"seq": state.seq + 1, "transcript": (*state.transcript, message)}
    )


def event(seq: int, text: str) -> Event:
    return Event(seq=seq, type="model.responded", at_ms=seq, data={"text": text})


def record_of(state: RunState) -> RunRecord:
    return RunRecord.from_state(state, state.created_at_ms + state.seq, None)


def started(runs: RunStore, snapshots: SnapshotStore, owner: str = "worker-a") -> RunState:
    """A run at seq 1 with its snapshot saved, its lease held by ``owner``."""
    state = make_state()
    runs.create(
        record_of(state), Event(seq=1, type="run.created", at_ms=1, data={"run_id": "run-1"})
    )
    snapshots.save(state, None)
    assert runs.acquire_lease("run-1", owner, LEASE_S)
    return state


def test_the_combined_path_is_taken_exactly_for_one_redis_behind_both_stores(
    stores: tuple[RunStore, SnapshotStore, bool],
) -> None:
    runs, snapshots, joint = stores
    assert runs.commits_with(snapshots) is joint


def test_a_transition_writes_its_events_record_and_snapshot(
    stores: tuple[RunStore, SnapshotStore, bool],
) -> None:
    runs, snapshots, _ = stores
    state = started(runs, snapshots)
    after = said(said(state, "one"), "two")
    events = [event(2, "one"), event(3, "two")]

    runs.commit(record_of(after), events, "worker-a", Checkpoint(snapshots, after, state.seq))

    assert runs.events("run-1")[1:] == events
    assert runs.get("run-1") == record_of(after)
    assert snapshots.load("run-1") == after
    assert snapshots.load_document("run-1") == snapshot_format.encode(after)
    # Without `release` the lease stays with its holder
    lease = runs.lease("run-1")
    assert lease is not None and lease.owner == "worker-a"


def test_a_transition_that_releases_lets_the_lease_go_with_it(
    stores: tuple[RunStore, SnapshotStore, bool],
) -> None:
    runs, snapshots, _ = stores
    state = started(runs, snapshots)
    after = said(state, "one")

    runs.commit(
        record_of(after), [event(2, "one")], "worker-a", Checkpoint(snapshots, after, 1), True
    )

    assert runs.lease("run-1") is None
    assert runs.acquire_lease("run-1", "worker-b", LEASE_S)


def test_transitions_chain_and_the_snapshot_grows_by_appends(
    stores: tuple[RunStore, SnapshotStore, bool],
) -> None:
    runs, snapshots, _ = stores
    state = started(runs, snapshots)
    for i in range(2, 12):
        after = said(state, f"message {i}")
        checkpoint = Checkpoint(snapshots, after, state.seq)
        runs.commit(record_of(after), [event(i, f"message {i}")], "worker-a", checkpoint)
        state = after
    assert snapshots.load("run-1") == state
    assert [e.seq for e in runs.events("run-1")] == list(range(1, 12))


def test_a_zombies_transition_after_a_takeover_writes_nothing(
    stores: tuple[RunStore, SnapshotStore, bool], clock: FakeClock
) -> None:
    runs, snapshots, _ = stores
    state = started(runs, snapshots)
    # Given worker A's lease expired and worker B took the run
    clock.advance(LEASE_S * 1000 + 1)
    assert runs.acquire_lease("run-1", "worker-b", LEASE_S)
    before = runs.get("run-1"), runs.events("run-1"), snapshots.load_document("run-1")
    after = said(state, "zombie")

    # When A commits its transition, it is refused
    with pytest.raises(LeaseLost):
        runs.commit(
            record_of(after),
            [event(2, "zombie")],
            "worker-a",
            Checkpoint(snapshots, after, 1),
            True,
        )

    # Then nothing changed: events, record, snapshot, and B's lease
    assert (runs.get("run-1"), runs.events("run-1"), snapshots.load_document("run-1")) == before
    lease = runs.lease("run-1")
    assert lease is not None and lease.owner == "worker-b"


def test_a_transition_behind_the_log_is_stale_and_writes_nothing(
    stores: tuple[RunStore, SnapshotStore, bool],
) -> None:
    runs, snapshots, _ = stores
    state = started(runs, snapshots)
    ahead = said(state, "theirs")
    runs.commit(record_of(ahead), [event(2, "theirs")], "worker-a", Checkpoint(snapshots, ahead, 1))
    before = runs.get("run-1"), runs.events("run-1"), snapshots.load_document("run-1")
    late = said(state, "mine")

    with pytest.raises(StaleWrite):
        runs.commit(record_of(late), [event(2, "mine")], "worker-a", Checkpoint(snapshots, late, 1))

    assert (runs.get("run-1"), runs.events("run-1"), snapshots.load_document("run-1")) == before


def test_a_transition_retried_after_its_reply_was_lost_succeeds_once(
    stores: tuple[RunStore, SnapshotStore, bool],
) -> None:
    runs, snapshots, joint = stores
    state = started(runs, snapshots)
    after = said(state, "one")
    args = (record_of(after), [event(2, "one")], "worker-a")
    runs.commit(*args, Checkpoint(snapshots, after, 1))

    # The same transition sent again (what a retry of a lost reply does) is told it succeeded
    if joint:
        runs.commit(*args, Checkpoint(snapshots, after, 1))
    else:
        # Apart, the events' retry is found landed; the snapshot's own retry finds its document.
        runs.append(*args)
        snapshots.save(after, 1)

    assert runs.events("run-1")[1:] == [event(2, "one")]
    assert snapshots.load("run-1") == after


# --- only the combined path -----------------------------------------------------


@pytest.fixture
def redis_pair(
    redis_url: str, clock: FakeClock
) -> Iterator[tuple[RedisRunStore, RedisSnapshotStore]]:
    runs = RedisRunStore.from_url(redis_url, clock=clock)
    snapshots = RedisSnapshotStore.from_url(redis_url)
    yield runs, snapshots
    snapshots.close()
    runs.close()


def test_a_snapshot_behind_its_compare_and_set_refuses_the_whole_transition(
    redis_pair: tuple[RedisRunStore, RedisSnapshotStore],
) -> None:
    runs, snapshots = redis_pair
    state = started(runs, snapshots)
    after = said(state, "one")
    before = runs.get("run-1"), runs.events("run-1"), snapshots.load_document("run-1")

    # A checkpoint that expects no snapshot, where one is stored: refused, and so are the events
    with pytest.raises(StaleWrite):
        runs.commit(
            record_of(after), [event(2, "one")], "worker-a", Checkpoint(snapshots, after, None)
        )

    assert (runs.get("run-1"), runs.events("run-1"), snapshots.load_document("run-1")) == before


def test_another_prefix_or_database_is_not_the_same_redis(redis_url: str) -> None:
    runs = RedisRunStore.from_url(redis_url)
    assert runs.commits_with(RedisSnapshotStore.from_url(redis_url))
    assert not runs.commits_with(RedisSnapshotStore.from_url(redis_url, prefix="other"))
    other_db = redis_url.rsplit("/", 1)[0] + "/9" if redis_url.count("/") > 2 else redis_url + "/9"
    assert not runs.commits_with(RedisSnapshotStore.from_url(other_db))


def test_a_transition_is_one_round_trip_and_touches_no_index_it_does_not_change(
    redis_pair: tuple[RedisRunStore, RedisSnapshotStore], redis_url: str
) -> None:
    runs, snapshots = redis_pair
    state = started(runs, snapshots)
    first = said(state, "one")  # (the first call also loads the script into the server)
    runs.commit(record_of(first), [event(2, "one")], "worker-a", Checkpoint(snapshots, first, 1))
    client = redis.Redis.from_url(redis_url)
    calls = client.info("commandstats")
    after = said(first, "two")
    runs.commit(record_of(after), [event(3, "two")], "worker-a", Checkpoint(snapshots, after, 2))
    spent = {
        k: v["calls"] - calls.get(k, {"calls": 0})["calls"]
        for k, v in client.info("commandstats").items()
        if v["calls"] != calls.get(k, {"calls": 0})["calls"]
    }
    client.close()
    # One script (the snapshot's tip came from this process's memory of its save);
    # the status did not change, so no status, created or finished index was written.
    assert spent.get("cmdstat_evalsha") == 1, spent
    assert "cmdstat_zrem" not in spent, spent
    assert spent.get("cmdstat_zadd", 0) <= 1, spent  # the due index, whose time moved


def test_a_process_lease_index_follows_the_fast_path_and_the_release_on_a_transition(
    redis_pair: tuple[RedisRunStore, RedisSnapshotStore], redis_url: str
) -> None:
    # The index RunStore.orphaned walks (the runs each process holds): a lease taken with
    # its record in one call enters it, and the release that rides on a turn's last
    # checkpoint takes the run out again, as release_lease does.
    runs, snapshots = redis_pair
    process = "host-a:101:aaaa"
    owner = f"{process}/t1"
    held = f"{DEFAULT_PREFIX}:proc:{process}:leases"
    client = redis.Redis.from_url(redis_url)
    state = started(runs, snapshots, owner)
    assert runs.acquire_and_get("run-1", owner, LEASE_S) == (True, runs.get("run-1"))
    assert client.smembers(held) == {b"run-1"}
    after = said(state, "one")

    runs.commit(record_of(after), [event(2, "one")], owner, Checkpoint(snapshots, after, 1), True)

    assert runs.lease("run-1") is None
    assert client.smembers(held) == set()
    assert runs.acquire_and_get("run-1", owner, LEASE_S)[0]
    runs.release_lease("run-1", owner)
    assert client.smembers(held) == set()
    client.close()
