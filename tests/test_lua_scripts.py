"""Every Redis script is a ``.lua`` file beside its backend, read once when the backend's
module is imported, and loaded into a server once per client: a call sends the script's
SHA (EVALSHA), never its source."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import redis

import store.limits.redis
import store.runs.redis
import store.snapshots.redis
from runtime.models import Event, RunStatus
from store.conformance import FakeClock
from store.conformance.records import new_run, record
from store.conformance.snapshots import grown, make_state
from store.limits.redis import RedisLimitStore
from store.packing import pack
from store.runs import Checkpoint
from store.runs.redis import RedisRunStore
from store.snapshots import format as snapshot_format
from store.snapshots.redis import RedisSnapshotStore

ROOT = Path(__file__).resolve().parents[1]
BACKENDS: dict[str, ModuleType] = {
    "store/runs/lua": store.runs.redis,
    "store/snapshots/lua": store.snapshots.redis,
    "store/limits/lua": store.limits.redis,
}
"""Each folder of scripts, and the backend module beside it that runs them."""


def constants(module: ModuleType) -> list[str]:
    """The module's strings: its str constants, and those of its dicts (a table of scripts)."""
    found: list[str] = []
    for value in vars(module).values():
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, dict):
            found += [v for v in value.values() if isinstance(v, str)]
    return found


def test_every_lua_file_is_read_into_its_backend_when_the_module_is_imported() -> None:
    scripts = sorted((ROOT / "store").rglob("*.lua"))
    assert len(scripts) >= 20
    for path in scripts:
        module = BACKENDS[str(path.parent.relative_to(ROOT))]
        # A script read at call time, or never used, is in no constant of its module.
        assert any(path.read_text(encoding="utf-8") in c for c in constants(module)), path


def every_script_once(
    runs: RedisRunStore, snapshots: RedisSnapshotStore, limits: RedisLimitStore, n: int
) -> None:
    """One call of each Redis script the three stores run, on run ``r<n>``."""
    from runtime.limits import Rate

    run_id, process = f"r{n}", f"host:{n}:t"
    owner = f"{process}/1"
    new_run(runs, run_id)
    runs.renew_liveness(process, 3)
    assert runs.claim_lease(run_id, owner, 30).taken
    assert runs.acquire_and_get(run_id, owner, 30)[0]
    assert runs.renew_leases([(run_id, owner)], 30) == []
    state = make_state(run_id)
    snapshots.save(state, None)
    after = grown(state, "one").model_copy(update={"seq": 2})
    moved = record(run_id, last_seq=2, status=RunStatus.MODEL)
    event = Event(seq=2, type="model.requested", at_ms=2, data={})
    runs.commit(moved, [event], owner, Checkpoint(snapshots, after, 1))
    runs.release_lease(run_id, owner)
    runs.postpone(run_id, 2, 10)
    runs.orphaned()
    done = record(run_id, last_seq=3, status=RunStatus.COMPLETED)
    runs.append(done, [Event(seq=3, type="run.completed", at_ms=3, data={})], None)
    runs.purge(runs.clock() + 10**9)
    snapshots._put(f"q{n}", make_state(f"q{n}"), b"{}", None)
    assert snapshots.quarantine(f"q{n}")
    rate = Rate("tokens", 60_000, burst_s=1.0)
    limits.admit("k", run_id, 1, 2, [rate], [10], 0, True)
    limits.settle("k", 5, rate)
    limits.block("k", 1)
    limits.acquire("cap", run_id, 1)
    limits.release("cap", run_id, 1)


def calls(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name: int(value["calls"]) for name, value in stats.items()}


def test_a_client_loads_each_script_once_and_then_sends_only_its_sha(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    runs = RedisRunStore.from_url(redis_url, clock=FakeClock())
    snapshots = RedisSnapshotStore.from_url(redis_url)
    limits = RedisLimitStore(client)
    try:
        # Given each script has run once on this server (loaded on its first call)
        every_script_once(runs, snapshots, limits, 1)
        before = calls(client)

        # When they all run again
        every_script_once(runs, snapshots, limits, 2)

        # Then no script was sent again, whole (EVAL) or to load (SCRIPT LOAD): only SHAs
        spent = {k: v - before.get(k, 0) for k, v in calls(client).items() if v != before.get(k)}
        assert spent.get("cmdstat_evalsha", 0) >= 15, spent
        assert "cmdstat_eval" not in spent and "cmdstat_script|load" not in spent, spent
    finally:
        snapshots.close()
        runs.close()
        client.close()


def test_a_server_that_lost_its_scripts_is_sent_them_again_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    runs = RedisRunStore.from_url(redis_url, clock=FakeClock())
    snapshots = RedisSnapshotStore.from_url(redis_url)
    limits = RedisLimitStore(client)
    try:
        # Given every script ran once, and then the server forgot them (a restart, a failover)
        every_script_once(runs, snapshots, limits, 3)
        client.script_flush()
        before = calls(client)

        # When they all run again: the transition and the lease's, sent as bare EVALSHA too
        every_script_once(runs, snapshots, limits, 4)

        # Then each was loaded again once, and the stores did their work
        spent = {k: v - before.get(k, 0) for k, v in calls(client).items() if v != before.get(k)}
        assert 10 <= spent.get("cmdstat_script|load", 0) <= spent["cmdstat_evalsha"], spent
        assert runs.get("r4") is None  # purged, as every_script_once leaves it
        assert snapshots.load("r4") is not None
    finally:
        snapshots.close()
        runs.close()
        client.close()


def test_a_transition_stores_exactly_the_bytes_the_encoders_give(redis_url: str) -> None:
    # The transition script takes its scalars in one argument: what it stores must stay the
    # record, events, snapshot head and fragments byte for byte, and the index fields as
    # the values they are.
    client = redis.Redis.from_url(redis_url)
    clock = FakeClock()
    runs = RedisRunStore.from_url(redis_url, clock=clock)
    snapshots = RedisSnapshotStore.from_url(redis_url)
    try:
        # Given a run with a snapshot at seq 1, its lease held by an owner
        run_id, owner = "bytes-1", "host:1:t/1"
        new_run(runs, run_id)
        state = make_state(run_id)
        snapshots.save(state, None)
        assert runs.acquire_and_get(run_id, owner, 30)[0]
        # When one transition appends two events, saves the grown state and lets the lease go
        after = grown(state, "one").model_copy(update={"seq": 3, "status": RunStatus.COMPLETED})
        moved = record(run_id, last_seq=3, status=RunStatus.COMPLETED, output="ok")
        events = [
            Event(seq=2, type="model.requested", at_ms=2, data={"turn": 1}),
            Event(seq=3, type="run.completed", at_ms=3, data={"output": "ok ☃ " * 20}),
        ]
        runs.commit(moved, events, owner, Checkpoint(snapshots, after, 1), release=True)

        # Then every stored value is what the encoders give, and the lease is gone
        key = f"ratchet:run:{{{run_id}}}"
        fields = client.hgetall(f"{key}:record")
        assert fields == {
            b"record": moved.model_dump_json().encode(),
            b"last_seq": b"3",
            b"status": b"completed",
            b"due": b"",
            b"next": b"",
            b"fin": str(moved.updated_at_ms).encode(),
        }
        stored = client.lrange(f"{key}:events", 0, -1)
        assert stored[1:] == [pack(e.model_dump_json().encode()) for e in events]
        head = client.hmget(f"{key}:snapshot", "seq", "head", "n")
        assert head == [b"3", pack(snapshot_format.encode_head(after)), b"3"]
        fragments = [snapshot_format.encode_fragment(m) for m in after.transcript]
        assert client.lrange(f"{key}:transcript", 0, -1) == [pack(f) for f in fragments]
        assert snapshots.load_document(run_id) == snapshot_format.encode(after)
        assert runs.lease(run_id) is None
    finally:
        snapshots.close()
        runs.close()
        client.close()


def test_a_heartbeat_round_is_one_round_trip_even_after_the_server_lost_its_scripts(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    runs = RedisRunStore.from_url(redis_url, clock=FakeClock())
    try:
        # Given three leases held, one of them since taken by another owner
        for run_id in ("hb-1", "hb-2", "hb-3"):
            new_run(runs, run_id)
            assert runs.acquire_and_get(run_id, "me", 30)[0]
        runs.release_lease("hb-3", "me")
        assert runs.acquire_and_get("hb-3", "other", 30)[0]
        leases = [("hb-1", "me"), ("hb-2", "me"), ("hb-3", "me")]
        assert runs.renew_leases(leases, 30) == ["hb-3"]
        before = calls(client)

        # When the heartbeat renews them again
        assert runs.renew_leases(leases, 30) == ["hb-3"]

        # Then that was the scripts' SHAs in one pipeline: no SCRIPT EXISTS before it
        spent = {k: v - before.get(k, 0) for k, v in calls(client).items() if v != before.get(k)}
        assert spent["cmdstat_evalsha"] == 3, spent
        assert not [k for k in spent if k.startswith("cmdstat_script")], spent

        # And when the server forgot its scripts, a round still renews what it holds
        client.script_flush()
        assert runs.renew_leases(leases, 30) == ["hb-3"]
        lease = runs.lease("hb-1")
        assert lease is not None and lease.owner == "me"
    finally:
        runs.close()
        client.close()


def test_a_run_that_finishes_on_one_redis_drops_its_snapshot_and_lease_in_its_last_script(
    redis_url: str, tmp_path: Path
) -> None:
    from tasks.start import create_run
    from tasks.turn import advance
    from tests.helpers import turn, write_agent
    from tests.workers import redis_context

    # Given a run on one Redis (both stores) whose first answer completes it
    ctx = redis_context(redis_url)
    run = create_run(ctx, write_agent(tmp_path, [turn("Done.")]), "hi")
    admin = redis.Redis.from_url(redis_url)
    admin.config_resetstat()

    # When its turn is taken
    assert advance(ctx, run.run_id, None).outcome == "completed"

    # Then the snapshot and the lease are gone with the last script: no MULTI/EXEC deleted
    # the snapshot on its own (the snapshot store's delete), and the run is complete
    calls = admin.info("commandstats")
    assert "cmdstat_multi" not in calls and "cmdstat_exec" not in calls, sorted(calls)
    assert ctx.snapshots.load(run.run_id) is None and run.run_id not in ctx.snapshots.list()
    assert ctx.runs.lease(run.run_id) is None
    record = ctx.runs.get(run.run_id)
    assert record is not None and record.status == RunStatus.COMPLETED
    admin.close()
    ctx.close()
