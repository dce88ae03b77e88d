"""A worker host cut off from the network in the middle of runs, then healed.

Three hosts in network namespaces (tests/netns.py): ``store`` runs Redis (run
store, snapshot store and broker) and ``celery beat`` (the sweeper); ``w1`` and
``w2`` each run a ``celery -A worker worker``. Every process reaches Redis at
the store host's veth address, as a fleet on a LAN would.

The story: w1 holds three runs, each in a long call — a non-idempotent charge,
a model call, an idempotent lookup — and a fourth whose checkpoint it is about
to send, and w2 is running runs of its own, when w1's cable is pulled for 30 s
(the checkpoint goes into the dead link). It runs in both deployments of the snapshot
store: combined with the run store (one Redis database and prefix: the checkpoint held is
the whole transition script, events and snapshot) and apart (another database: the
answer's events are in, the checkpoint held is the snapshot save). And a third time with
both stores on a Redis Cluster (six nodes on the store host, three primaries with a
replica each; the broker on its own Redis there) and workers on three hosts: ``w3``
beside ``w2``, either of which may take w1's runs. Then:

- while w1 is cut off, its runs move to w2 (or w3) within the recovery bound (the
  expiry of w1's claim, read from the settings, plus one sweep interval);
- once w1 is back, every write its stale turns attempt is refused by the
  store's fences (counted from w1's own log and its metrics), and the
  checkpoint it sent into the cut, which reaches Redis after the heal, is refused
  and does not fence out w2's own writes;
- no non-idempotent tool ran twice, and every run ends completed, or parked
  naming the call whose outcome is unknown.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from runtime.models import Event, RunStatus
from store.runs.redis import RedisRunStore
from store.snapshots.redis import RedisSnapshotStore
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.netns import Fleet, Host
from tests.workers import ROOT, wait_for
from worker.app import make_app

pytestmark = [pytest.mark.slow, pytest.mark.multihost]

CUT_S = 30.0
"""How long w1 is cut off."""
REDIS_PORT = 6379
CLUSTER_PORTS = range(7000, 7006)
"""The cluster's nodes on the store host (each also listens on its port + 10000, the bus)."""
METRICS_PORT = 9808
LONG_CALL_S = 40.0
"""w1's calls in flight at the cut outlast it, so they try to write after the heal."""
MODEL_CALL_S = 36.0
"""The model call in flight at the cut: longer than the cut, and asked again by w2."""


def recovery_bound_s(settings: Settings) -> float:
    """How soon after a host vanishes its runs must move: its claim's expiry plus one sweep.

    A claim ends when its lease expires, or sooner when the settings have a process
    liveness record (``liveness_s``) and it lapses: whichever comes first.
    """
    expiry_s = min(float(getattr(settings, "liveness_s", settings.lease_s)), settings.lease_s)
    return expiry_s + settings.sweep_interval_s


@dataclass
class Process:
    name: str
    log_path: Path
    popen: Any = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Deployment:
    """The fleet's hosts and the processes on them."""

    fleet: Fleet
    directory: Path
    store: Host
    w1: Host
    w2: Host
    w3: Host | None = None
    """The third worker host, on the cluster only."""
    redis_url: str = ""
    """The broker's URL (and the run store's, but on the cluster)."""
    run_url: str = ""
    snapshot_url: str = ""
    store_ports: tuple[int, ...] = (REDIS_PORT,)
    """Where the stores' commands go: the Redis, or every node of the cluster."""
    started: dict[str, Process] = field(default_factory=dict)

    def env(self, host: Host, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
        env.update(
            RATCHET_BROKER_URL=self.redis_url,
            RATCHET_SNAPSHOT_STORE=self.snapshot_url,
            RATCHET_RUN_STORE=self.run_url,
            RATCHET_DATA_DIR=str(self.directory / f"data-{host.name}"),
            RATCHET_EXAMPLE_LEDGER=str(self.directory / "refunds.ledger"),
            RATCHET_TEST_CALLS=str(self.directory / "effects.log"),
            RATCHET_TEST_HOST=host.name,
            RATCHET_SCRIPTED_CALL_LOG=str(self.directory / f"model-calls-{host.name}.log"),
            PYTHONPATH=str(ROOT),
            **extra,
        )
        return env

    def start(self, name: str, host: Host, argv: list[str], env: dict[str, str]) -> Process:
        process = Process(name, self.directory / f"{name}.log")
        process.popen = self.fleet.popen(host, argv, env, process.log_path, cwd=ROOT)
        self.started[name] = process
        return process

    def worker(self, name: str, host: Host, *args: str, **extra: str) -> Process:
        env = self.env(
            host,
            RATCHET_METRICS_PORT=str(METRICS_PORT),
            RATCHET_METRICS_ADDRESS=host.address,
            **extra,
        )
        argv = [sys.executable, "-m", "celery", "-A", "worker", "worker", "--loglevel", "INFO",
                "--without-mingle", "--without-gossip", "--hostname", f"{name}@{host.name}",
                *args]  # fmt: skip
        worker = self.start(name, host, argv, env)
        wait_for(f"{name} is ready", lambda: _ready(worker), timeout_s=60)
        return worker


def _ready(process: Process) -> bool:
    assert process.popen.poll() is None, f"{process.name} exited:\n{process.log()}"
    return "ready." in process.log()


COMBINED, SEPARATE, CLUSTER = "combined", "separate", "cluster"
"""The deployments of the snapshot store: in the run store's Redis database and
prefix (a transition is one script, the default), or in another database (the run
store's calls, then the snapshot store's); or both stores on a Redis Cluster, combined
(a transition is one script, on the node that holds the run's shard)."""


def deploy(fleet: Fleet, snapshots: str) -> Deployment:
    store, w1, w2 = fleet.add_host("store"), fleet.add_host("w1"), fleet.add_host("w2")
    deployment = Deployment(fleet, fleet.directory, store, w1, w2)
    deployment.redis_url = deployment.run_url = f"redis://{store.address}:{REDIS_PORT}/0"
    snapshot_db = 0 if snapshots == COMBINED else 1
    deployment.snapshot_url = f"redis://{store.address}:{REDIS_PORT}/{snapshot_db}"
    if snapshots == CLUSTER:
        deployment.w3 = fleet.add_host("w3")
        deployment.run_url = deployment.snapshot_url = start_cluster(deployment)
        deployment.store_ports = tuple(CLUSTER_PORTS)
    redis_dir = fleet.directory / "redis"
    redis_dir.mkdir()
    deployment.start(
        "redis",
        store,
        ["redis-server", "--bind", store.address, "--port", str(REDIS_PORT),
         "--protected-mode", "no", "--save", "", "--appendonly", "yes",
         "--dir", str(redis_dir)],
        {},
    )  # fmt: skip
    fleet.wait_for_port(store, REDIS_PORT)
    beat = [sys.executable, "-m", "celery", "-A", "worker", "beat", "--loglevel", "INFO",
            "-s", str(fleet.directory / "beat-schedule")]  # fmt: skip
    deployment.start("beat", store, beat, deployment.env(store))
    return deployment


def start_cluster(d: Deployment) -> str:
    """Six cluster nodes on the store host, made one cluster (three primaries, a replica
    each); the stores' URL, naming every node."""
    nodes = []
    for port in CLUSTER_PORTS:
        node_dir = d.directory / f"cluster-{port}"
        node_dir.mkdir()
        d.start(
            f"cluster-{port}",
            d.store,
            ["redis-server", "--bind", d.store.address, "--port", str(port),
             "--protected-mode", "no", "--save", "", "--appendonly", "yes",
             "--dir", str(node_dir), "--cluster-enabled", "yes",
             "--cluster-config-file", str(node_dir / "nodes.conf"),
             "--cluster-announce-ip", d.store.address, "--cluster-node-timeout", "2000",
             "--repl-diskless-sync-delay", "0"],
            {},
        )  # fmt: skip
        nodes.append(f"{d.store.address}:{port}")
    for port in CLUSTER_PORTS:
        d.fleet.wait_for_port(d.store, port)
    made = subprocess.run(
        ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, f"redis-cli --cluster create failed:\n{made.stdout}{made.stderr}"

    def ready() -> bool:
        for port in CLUSTER_PORTS:
            with redis.Redis(host=d.store.address, port=port, socket_timeout=5) as client:
                info = client.execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" not in info or f"cluster_known_nodes:{len(nodes)}" not in info:
                return False
        return True

    wait_for("the cluster is ready", ready, timeout_s=30)
    return "redis+cluster://" + ",".join(nodes)


class StoreMonitor:
    """Every command the store's Redis (each node of a cluster) executes from one address
    (Redis MONITOR).

    The store's own record of what reached it, whatever the sender believes.
    """

    def __init__(self, store: Host, address: str, ports: tuple[int, ...] = (REDIS_PORT,)) -> None:
        self._needle = f" {address}:".encode()
        self._socks = [socket.create_connection((store.address, port), timeout=5) for port in ports]
        self.seen: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        for sock in self._socks:
            sock.sendall(b"MONITOR\r\n")
            sock.settimeout(None)
            threading.Thread(
                target=self._read, args=(sock,), name="store-monitor", daemon=True
            ).start()

    def _read(self, sock: socket.socket) -> None:
        buffer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                buffer += chunk
                *lines, buffer = buffer.split(b"\r\n")
                for line in lines:
                    if self._needle in line:
                        at, _, text = line.lstrip(b"+").partition(b" ")
                        with self._lock:
                            self.seen.append((float(at), text.decode(errors="replace")))
                            self.seen.sort()  # the nodes' lines, merged in time order

    def commands(self, after_s: float, matching: Callable[[str], bool]) -> list[tuple[float, str]]:
        """The commands run after ``after_s`` (epoch s) ``matching``, with when each ran."""
        with self._lock:
            return [(at, text) for at, text in self.seen if at > after_s and matching(text)]

    def save(self, path: Path) -> None:
        """What the store saw from this address, one command a line (for a failure's reader)."""
        with self._lock:
            path.write_text("".join(f"{at:.6f} {text}\n" for at, text in self.seen))

    def close(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def types(ctx: Context, run_id: str) -> list[str]:
    return [e.type for e in ctx.runs.events(run_id)]


def first_event_after(ctx: Context, run_id: str, at_ms: int) -> Event | None:
    return next((e for e in ctx.runs.events(run_id) if e.at_ms > at_ms), None)


def scrape(host: Host) -> dict[str, float]:
    url = f"http://{host.address}:{METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


REFUSALS = {
    "lease": re.compile(r"run (\w+): worker \S+ no longer holds the run's lease"),
    "seq": re.compile(
        r"run (\w+): write expected seq \S+ but the store holds .*this write is dropped"
    ),
    "renewal": re.compile(r"run (\w+): lease lost during the turn"),
}


def refusals(log: str) -> dict[str, list[str]]:
    """The store's refusals of this worker's writes, by kind: the run id of each."""
    return {kind: pattern.findall(log) for kind, pattern in REFUSALS.items()}


def effects(d: Deployment) -> list[str]:
    """Every tool invocation's note (``charge c1 w1``) and refund ledger line (``refund M1 1500``)."""
    lines = []
    for name in ("effects.log", "refunds.ledger"):
        path = d.directory / name
        if path.exists():
            lines += path.read_text().splitlines()
    return lines


def fenced_turns(log: str, run_id: str) -> int:
    return len(re.findall(rf"succeeded in \S+: 'fenced' \(run {run_id}\)", log))


HELD_AFTER = {COMBINED: "tool.requested", SEPARATE: "tool.completed", CLUSTER: "tool.requested"}
"""The late run's last event while w1 holds its write at ``snapshot.before_save``, the turn's
last checkpoint (the lookup's outcome; the answer before it, ``model.responded`` with the
idempotent lookup's ``tool.requested``, went as events alone): combined, the outcome's events
and the snapshot are one script not sent yet; apart, its events are appended and the
snapshot is not saved yet."""
HELD_SEQ = 5
"""The seq of the held checkpoint: created, model requested, answered, lookup requested,
lookup completed."""
HELD_WRITE = {
    COMBINED: "transition script",
    SEPARATE: "snapshot save",
    CLUSTER: "transition script",
}


def held_write(snapshots: str, late: str, owner: str) -> Callable[[str], bool]:
    """Which command the store saw is the late run's held write: apart, a snapshot save (in
    the snapshots' own database); combined, a transition script of the turn that held it
    (``owner``; the events with a snapshot to save: the snapshot mode argument, which an
    events-only append such as a stall's leaves empty)."""

    def matching(command: str) -> bool:
        if snapshots == SEPARATE:
            return command.startswith("[1 ") and f"{{{late}}}:snapshot" in command
        return (
            f"{{{late}}}:events" in command
            and f'"{owner}"' in command
            and ('"replace"' in command or '"append"' in command)
        )

    return matching


def check_late_log(
    ctx: Context,
    snapshots: str,
    late: str,
    held_seq: int,
    cut_ms: int,
    resumed_at_tool: list[str],
) -> None:
    """The late run's log holds nothing of w1's held write.

    Apart, the lookup's outcome was in before the cut, only the snapshot was late: the run
    resumed at its next model call. Combined, the held transition script reached the store
    after the heal and was refused, all of it: the log past the lookup's request is w2's
    takeover, the lookup run again, and the turns after it, every event stamped after the
    cut, none of the held script's (stamped before it). Either way the run did what a run
    whose lookup was cut off does.
    """
    done = [t for t in types(ctx, late) if t not in RECOVERY_EVENTS]
    assert done == resumed_at_tool
    if snapshots == SEPARATE:
        return
    past = ctx.runs.events(late)[held_seq:]
    assert past[0].type == "run.resumed"
    assert all(e.at_ms > cut_ms for e in past), [e for e in past if e.at_ms <= cut_ms]


W1_QUEUE = "w1.direct"
"""A queue only w1 consumes: the test hands w1 its runs, as a router pinning work to a host would."""
RECOVERY_EVENTS = {"run.resumed"}
"""Bookkeeping of a takeover; left out where the tests compare what the runs did."""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("snapshots", [COMBINED, SEPARATE, CLUSTER])
def test_a_worker_host_cut_off_for_30_s_loses_its_runs_to_the_other_host_and_cannot_write(
    fleet: Fleet,
    snapshots: str,
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
) -> None:
    settings = Settings()
    bound_s = recovery_bound_s(settings)
    d = deploy(fleet, snapshots)
    ctx = Context(
        settings=Settings(),
        snapshots=RedisSnapshotStore.from_url(d.snapshot_url),
        runs=RedisRunStore.from_url(d.run_url),
    )
    # The deployment is the one named: a transition is one store call only when combined
    assert ctx.runs.commits_with(ctx.snapshots) is (snapshots != SEPARATE)
    client = make_app(Settings(broker_url=d.redis_url))
    agents = fleet.directory / "agents"
    monitor: StoreMonitor | None = None

    def start(name: str, turns: list[dict[str, Any]], tools: list[str], queue: str) -> str:
        agent = write_agent(agents / name, turns, name=name, tools=tools)
        state = create_run(ctx, agent, f"run {name}")
        client.send_task("ratchet.turn", (state.run_id, state.seq), queue=queue)
        return state.run_id

    def status(run_id: str) -> RunStatus:
        record = ctx.runs.get(run_id)
        assert record is not None
        return record.status

    try:
        hold = fleet.directory / "hold-checkpoint"
        w1 = d.worker("w1", d.w1, "--pool", "prefork", "--concurrency", "4",
                      "-Q", f"ratchet.turns,ratchet.control,{W1_QUEUE}",
                      RATCHET_FAILPOINT="snapshot.before_save@1",
                      RATCHET_FAILPOINT_HOLD=str(hold))  # fmt: skip
        w2 = d.worker("w2", d.w2, "--pool", "threads", "--concurrency", "6")
        # (and on the cluster, w3 beside it: w1's runs may move to either)
        others = [w2] + ([d.worker("w3", d.w3, "--pool", "threads", "--concurrency", "6")]
                         if d.w3 is not None else [])  # fmt: skip
        # Given w1 holding three runs, each in a call that outlasts the cut: a charge (not
        # idempotent), a model call, and a lookup (idempotent, quick when tried again)
        charge = start(
            "charge",
            [turn("charge", call("charge_once", charge_id="c1", sleep_s=LONG_CALL_S)), turn("ok")],
            ["tests.slow_tools:charge_once"],
            W1_QUEUE,
        )
        model = start(
            "model",
            [
                {**turn("refund", call("issue_refund", order_id="M1", amount_cents=1500)),
                 "sleep_s": MODEL_CALL_S},
                turn("Refunded."),
            ],
            ["examples.refunds:issue_refund"],
            W1_QUEUE,
        )  # fmt: skip
        lookup = start(
            "lookup",
            [turn("look", call("lookup_slow_first", key="k1", sleep_s=LONG_CALL_S)), turn("ok")],
            ["tests.slow_tools:lookup_slow_first"],
            W1_QUEUE,
        )
        held = {charge: "tool.requested", model: "model.requested", lookup: "tool.requested"}

        def in_call_on_w1(run_id: str) -> bool:
            lease = ctx.runs.lease(run_id)
            return (
                types(ctx, run_id)[-1] == held[run_id]
                and lease is not None
                and d.w1.owns_pid(int(lease.owner.split(":")[1]))
            )

        wait_for("w1 holds its three runs in their calls",
                 lambda: all(in_call_on_w1(r) for r in held), timeout_s=60)  # fmt: skip
        # And a fourth run on w1 whose lookup (quick this time) has answered, the turn's last
        # checkpoint held back: apart, the outcome's events are appended and the snapshot is
        # not saved yet; combined, events and snapshot are one script that is not sent yet
        hold.touch()
        late = start(
            "late",
            [turn("look", call("lookup_slow_first", key="k2", sleep_s=0.0)), turn("ok")],
            ["tests.slow_tools:lookup_slow_first"],
            W1_QUEUE,
        )
        wait_for("w1 holds the late run's checkpoint",
                 lambda: types(ctx, late)[-1] == HELD_AFTER[snapshots]
                 and "snapshot.before_save hit at turn 1: holding while" in w1.log(),
                 timeout_s=30)  # fmt: skip
        late_seq = ctx.runs.events(late)[-1].seq
        late_lease = ctx.runs.lease(late)
        assert late_lease is not None
        # And w2 (w1's pool is full) running two runs of its own, each with two refunds
        own = [
            start(
                f"steady{i}",
                [
                    {**turn("one", call("issue_refund", order_id=f"S{i}", amount_cents=100)),
                     "sleep_s": 2.0},
                    {**turn("two", call("issue_refund", order_id=f"T{i}", amount_cents=200)),
                     "sleep_s": 2.0},
                    {**turn("Done."), "sleep_s": 2.0},
                ],
                ["examples.refunds:issue_refund"],
                "ratchet.turns",
            )
            for i in range(2)
        ]  # fmt: skip
        wait_for("w2 works on its runs",
                 lambda: all("model.requested" in types(ctx, r) for r in own), timeout_s=30)  # fmt: skip
        before = scrape(d.w1)
        monitor = StoreMonitor(d.store, d.w1.address, d.store_ports)

        # When w1's cable is pulled for 30 s
        cut_ms = ctx.runs.clock()
        late_checkpoint = held_write(snapshots, late, late_lease.owner)
        cut_at = time.monotonic()
        fleet.cut(d.w1)
        # (and the held checkpoint is let go, into the dead link: its bytes wait in the kernel)
        hold.unlink()
        moved_s: dict[str, float] = {}

        def all_moved() -> bool:
            for run_id in {*held, late} - moved_s.keys():
                event = first_event_after(ctx, run_id, cut_ms)
                if event is not None:
                    moved_s[run_id] = (event.at_ms - cut_ms) / 1000
            return moved_s.keys() == {*held, late}

        # Then its runs move to w2 while it is cut off
        wait_for("w1's runs move to w2", all_moved, timeout_s=CUT_S)
        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
        fleet.heal(d.w1)
        healed_ms = ctx.runs.clock()
        cut_for_s = time.monotonic() - cut_at
        asked_ms = next(e.at_ms for e in ctx.runs.events(model) if e.type == "model.requested")
        assert healed_ms < asked_ms + MODEL_CALL_S * 1000, (
            "the premise failed: w1's model call ended before the heal (the machine took "
            f"{(cut_ms - asked_ms) / 1000:.1f} s from the call to the cut)"
        )
        for run_id in [*held, late]:
            assert any(f"(run {run_id})" in w.log() for w in others), f"nobody took {run_id}"
        # And the checkpoint w1 sent into the cut reaches the store after the heal (TCP
        # retransmits a socket's bytes after its client gave up on it and closed it)
        wait_for("w1's late checkpoint reaches the store",
                 lambda: monitor.commands(cut_ms / 1000, late_checkpoint) != [],
                 timeout_s=60)  # fmt: skip
        landed_at, landed = monitor.commands(cut_ms / 1000, late_checkpoint)[0]
        connection = landed.split("]")[0]  # "[db address:port": the socket it was sent on

        # And once w1 is back, each of its three turns tries to write, is refused, and stops
        wait_for("w1's stale turns stop, fenced",
                 lambda: all(fenced_turns(w1.log(), r) == 1 for r in held), timeout_s=60)  # fmt: skip
        ends = {charge: RunStatus.NEEDS_RECONCILIATION, model: RunStatus.COMPLETED,
                lookup: RunStatus.COMPLETED, late: RunStatus.COMPLETED,
                **dict.fromkeys(own, RunStatus.COMPLETED)}  # fmt: skip
        wait_for("every run ends", lambda: all(not status(r).is_live for r in ends), timeout_s=90)
        refused = refusals(w1.log())
        after = scrape(d.w1)

        # And every run ended as it should: completed, or parked naming the charge in flight
        assert {r: status(r) for r in ends} == ends
        parked = ctx.runs.get(charge)
        assert parked is not None and parked.error is not None
        assert "tool `charge_once` (call call_1_1) was in flight" in parked.error
        assert ctx.runs.events(charge)[-1].data["call_id"] == "call_1_1"
        # And nothing a stale turn wrote got in: each log is exactly what w2's turns wrote,
        # and w2, which took the runs over, never had a write refused (the late checkpoint
        # did not fence it out)
        for w in others:
            assert refusals(w.log()) == {kind: [] for kind in REFUSALS}, w.name
            # (nor got in before its next save, which would have found it and replaced it)
            assert "a late checkpoint of a worker that lost the run" not in w.log()
        if snapshots == CLUSTER:
            # And w1's late turn: redis-py's cluster client tried its write again (refreshing
            # the slot table) until the heal, when the store refused it by its seq fence
            assert f"run {late}: write expected seq" in w1.log()
            fenced_runs = {*held, late}
        else:
            # And w1's late turn, its write timed out in the cut, said so and stopped: its
            # checkpoint not saved, the stall it then tried not recorded (the store unreachable)
            assert f"run {late}: checkpoint at seq {HELD_SEQ} could not be saved" in w1.log()
            assert f"run {late}: could not record the stall" in w1.log()
            fenced_runs = set(held)
        done = {r: [t for t in types(ctx, r) if t not in RECOVERY_EVENTS] for r in [*held, late]}
        assert done[charge] == ["run.created", "model.requested", "model.responded",
                                "tool.requested", "run.parked"]  # fmt: skip
        assert done[model] == ["run.created", "model.requested", "model.requested",
                               "model.responded", "tool.requested", "tool.completed",
                               "model.requested", "model.responded", "run.completed"]  # fmt: skip
        assert done[lookup] == ["run.created", "model.requested", "model.responded",
                                "tool.requested", "tool.completed", "model.requested",
                                "model.responded", "run.completed"]  # fmt: skip
        check_late_log(ctx, snapshots, late, late_seq, cut_ms, done[lookup])
        # And no non-idempotent tool ran twice; the idempotent lookup ran again, on w2
        ran = effects(d)
        # (w2 and w3 alike are "the other host": either may have taken a lookup over)
        by_others = [re.sub(r" w[23]$", " w2|w3", line) for line in ran]
        assert sorted(by_others) == sorted(
            ["charge c1 w1", "lookup k1 w1", "lookup k1 w2|w3", "lookup k2 w1",
             "refund M1 1500", "refund S0 100", "refund T0 200", "refund S1 100", "refund T1 200"]
            # (the late lookup again on the other host where its outcome was in the held script)
            + ([] if snapshots == SEPARATE else ["lookup k2 w2|w3"])
        )  # fmt: skip
        once = [" ".join(line.split()[:2]) for line in ran if not line.startswith("lookup")]
        # And the refusals counted in w1's log are the ones its metrics counted
        logged_refused = len(refused["lease"]) + len(refused["seq"])
        renewals_refused = len(refused["renewal"])
        assert set(refused["lease"] + refused["seq"]) == fenced_runs
        assert logged_refused == len(fenced_runs)
        fenced_delta = after['ratchet_turns_total{outcome="fenced"}'] - before.get(
            'ratchet_turns_total{outcome="fenced"}', 0
        )
        lost_delta = after["ratchet_leases_lost_total"] - before.get("ratchet_leases_lost_total", 0)
        assert fenced_delta == logged_refused
        assert lost_delta == renewals_refused
        # And the held write (each copy sent on that socket), which the store refused after
        # the heal: its reply went to a socket w1 had closed, so only the store's record and
        # the run's log tell
        held_refused = [
            at
            for at, text in monitor.commands(cut_ms / 1000, late_checkpoint)
            if text.startswith(connection + "]")
        ]
        writes_refused = logged_refused + len(held_refused)

        figures = {
            "snapshots": snapshots,
            "held_write": HELD_WRITE[snapshots],
            "recovery_bound_s": bound_s,
            "moved_within_bound": all(v <= bound_s for v in moved_s.values()),
            "cut_for_s": round(cut_for_s, 2),
            "moved_after_cut_s": {name: round(moved_s[r], 2)
                                  for name, r in (("charge", charge), ("model", model),
                                                  ("lookup", lookup), ("late", late))},
            "late_checkpoint_landed_after_heal_s": round(landed_at - healed_ms / 1000, 2),
            "writes_refused": writes_refused,
            "held_writes_refused_at_store": len(held_refused),
            "renewals_refused": renewals_refused,
            "effects": {kind: sum(1 for line in ran if line.startswith(kind))
                        for kind in ("charge", "refund", "lookup")},
            "non_idempotent_run_twice": len(once) - len(set(once)),
        }  # fmt: skip
        for key, value in figures.items():
            record_property(key, value)
        with capsys.disabled():
            print(f"\npartition figures: {json.dumps(figures)}")
    finally:
        if monitor is not None:
            monitor.close()
            monitor.save(d.directory / "monitor-w1.log")
        client.close()
        ctx.close()
