"""A worker host cut off from the network in the middle of runs, then healed.

Three hosts in network namespaces (tests/netns.py): ``store`` runs Redis (run
store, snapshot store and broker) and ``celery beat`` (the sweeper); ``w1`` and
``w2`` each run a ``celery -A worker worker``. Every process reaches Redis at
the store host's veth address, as a fleet on a LAN would.

The story: w1 holds three runs, each in a long call — a non-idempotent charge,
a model call, an idempotent lookup — and a fourth whose checkpoint it is about
to send, and w2 is running runs of its own, when w1's cable is pulled for 30 s
(the checkpoint goes into the dead link). Then:

- while w1 is cut off, its runs move to w2 within the recovery bound (the
  expiry of w1's claim, read from the settings, plus one sweep interval);
- once w1 is back, every write its stale turns attempt is refused by the
  store's fences (counted from w1's own log and its metrics), and the
  checkpoint it sent into the cut, which reaches Redis after the heal, does not
  fence out w2's own writes;
- no non-idempotent tool ran twice, and every run ends completed, or parked
  naming the call whose outcome is unknown.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from runtime.models import Event, RunStatus
from tasks.context import Context
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import call, turn, write_agent
from tests.netns import Fleet, Host
from tests.workers import ROOT, redis_context
from worker.app import make_app

pytestmark = [pytest.mark.slow, pytest.mark.multihost]

CUT_S = 30.0
"""How long w1 is cut off."""
REDIS_PORT = 6379
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


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting until {what}")
        time.sleep(0.05)


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
    redis_url: str = ""
    started: dict[str, Process] = field(default_factory=dict)

    def env(self, host: Host, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
        env.update(
            RATCHET_BROKER_URL=self.redis_url,
            RATCHET_SNAPSHOT_STORE=self.redis_url,
            RATCHET_RUN_STORE=self.redis_url,
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


def deploy(fleet: Fleet) -> Deployment:
    store, w1, w2 = fleet.add_host("store"), fleet.add_host("w1"), fleet.add_host("w2")
    deployment = Deployment(fleet, fleet.directory, store, w1, w2)
    deployment.redis_url = f"redis://{store.address}:{REDIS_PORT}/0"
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


class StoreMonitor:
    """Every command the store host's Redis executes from one address (Redis MONITOR).

    The store's own record of what reached it, whatever the sender believes.
    """

    def __init__(self, store: Host, address: str) -> None:
        self._needle = f" {address}:".encode()
        self._sock = socket.create_connection((store.address, REDIS_PORT), timeout=5)
        self._sock.sendall(b"MONITOR\r\n")
        self._sock.settimeout(None)
        self.seen: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="store-monitor", daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        with contextlib.suppress(OSError):
            while chunk := self._sock.recv(65536):
                buffer += chunk
                *lines, buffer = buffer.split(b"\r\n")
                for line in lines:
                    if self._needle in line:
                        at, _, text = line.lstrip(b"+").partition(b" ")
                        with self._lock:
                            self.seen.append((float(at), text.decode(errors="replace")))

    def first(self, after_s: float, containing: str) -> float | None:
        """When the first command after ``after_s`` (epoch s) naming ``containing`` ran."""
        with self._lock:
            return next((at for at, text in self.seen if at > after_s and containing in text), None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


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


W1_QUEUE = "w1.direct"
"""A queue only w1 consumes: the test hands w1 its runs, as a router pinning work to a host would."""
RECOVERY_EVENTS = {"run.resumed"}
"""Bookkeeping of a takeover; left out where the tests compare what the runs did."""


@pytest.mark.timeout(180)
def test_a_worker_host_cut_off_for_30_s_loses_its_runs_to_the_other_host_and_cannot_write(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], record_property: Callable[[str, object], None]
) -> None:
    settings = Settings()
    bound_s = recovery_bound_s(settings)
    d = deploy(fleet)
    ctx = redis_context(d.redis_url)
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
        # And a fourth run on w1 whose model answer is appended, its checkpoint held back
        hold.touch()
        late = start(
            "late",
            [turn("look", call("lookup_slow_first", key="k2", sleep_s=LONG_CALL_S)), turn("ok")],
            ["tests.slow_tools:lookup_slow_first"],
            W1_QUEUE,
        )
        wait_for("w1 holds the late run's checkpoint",
                 lambda: types(ctx, late)[-1] == "model.responded"
                 and "holding while" in w1.log(), timeout_s=30)  # fmt: skip
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
        monitor = StoreMonitor(d.store, d.w1.address)

        # When w1's cable is pulled for 30 s
        cut_ms = ctx.runs.clock()
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
            assert f"(run {run_id})" in w2.log(), f"w2 never took run {run_id}"
        # And the checkpoint w1 sent into the cut reaches the store after the heal (TCP
        # retransmits a socket's bytes after its client gave up on it and closed it)
        wait_for("w1's late checkpoint reaches the store",
                 lambda: monitor.first(cut_ms / 1000, f"{{{late}}}:snapshot") is not None,
                 timeout_s=60)  # fmt: skip
        landed_at = monitor.first(cut_ms / 1000, f"{{{late}}}:snapshot")
        assert landed_at is not None

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
        assert refusals(w2.log()) == {kind: [] for kind in REFUSALS}
        assert f"run {late}: checkpoint at seq 3 could not be saved" in w1.log()
        done = {r: [t for t in types(ctx, r) if t not in RECOVERY_EVENTS] for r in [*held, late]}
        assert done[charge] == ["run.created", "model.requested", "model.responded",
                                "tool.requested", "run.parked"]  # fmt: skip
        assert done[model] == ["run.created", "model.requested", "model.requested",
                               "model.responded", "tool.requested", "tool.completed",
                               "model.requested", "model.responded", "run.completed"]  # fmt: skip
        assert done[lookup] == ["run.created", "model.requested", "model.responded",
                                "tool.requested", "tool.completed", "model.requested",
                                "model.responded", "run.completed"]  # fmt: skip
        assert done[late] == done[lookup]
        # And no non-idempotent tool ran twice; the idempotent lookup ran again, on w2
        ran = effects(d)
        assert sorted(ran) == sorted(
            ["charge c1 w1", "lookup k1 w1", "lookup k1 w2", "lookup k2 w2", "refund M1 1500",
             "refund S0 100", "refund T0 200", "refund S1 100", "refund T1 200"]
        )  # fmt: skip
        once = [" ".join(line.split()[:2]) for line in ran if not line.startswith("lookup")]
        # And the refusals counted in w1's log are the ones its metrics counted
        writes_refused = len(refused["lease"]) + len(refused["seq"])
        renewals_refused = len(refused["renewal"])
        assert set(refused["lease"] + refused["seq"]) == held.keys()
        assert writes_refused == len(held)
        fenced_delta = after['ratchet_turns_total{outcome="fenced"}'] - before.get(
            'ratchet_turns_total{outcome="fenced"}', 0
        )
        lost_delta = after["ratchet_leases_lost_total"] - before.get("ratchet_leases_lost_total", 0)
        assert fenced_delta == writes_refused
        assert lost_delta == renewals_refused

        figures = {
            "recovery_bound_s": bound_s,
            "moved_within_bound": all(v <= bound_s for v in moved_s.values()),
            "cut_for_s": round(cut_for_s, 2),
            "moved_after_cut_s": {name: round(moved_s[r], 2)
                                  for name, r in (("charge", charge), ("model", model),
                                                  ("lookup", lookup), ("late", late))},
            "late_checkpoint_landed_after_heal_s": round(landed_at - healed_ms / 1000, 2),
            "writes_refused": writes_refused,
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
        client.close()
        ctx.close()
