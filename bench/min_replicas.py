"""What ``min_replicas`` costs a call that is not idempotent, and a turn. Prints figures.

    python -m bench.min_replicas [--rounds 10] [--appends 500] [--turns 100]

Starts a primary and a replica of it (``redis-server`` on free ports of 127.0.0.1,
AOF on, as a production store runs) and measures the same work on the run store
opened with ``?min_replicas=0`` and with ``?min_replicas=1``: the same servers, the
replica replicating in both; the only difference is the ``WAIT`` pipelined after a
journal entry of a call that is not idempotent (store/replicas.py). Each round measures
both back to back, the order swapped every round, so both see the same phase of the
machine; what is printed is each round's ratio (1 over 0) and their median.

1. **the journal append alone** (``RunStore.append_replicated`` of one ``tool.requested``,
   one after another on one run): wall µs and this process's CPU µs per append, and the
   servers' CPU µs per append (``INFO cpu``, primary plus replica).
2. **whole turns** (``tasks.turn.advance`` in this process, a worker's turn minus Celery):
   each a scripted model call and one call of a tool that is not idempotent and does
   nothing (``tests.slow_tools:slow_charge`` with ``sleep_s`` 0), so what a turn pays
   for durability is all there is: wall ms and CPU ms per turn, servers' CPU ms per turn.

On loopback a replica acknowledges within a round trip or two; across hosts add the
network's round trip to each call that waits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.models import RunStatus  # noqa: E402
from store import open_run_store, open_snapshot_store  # noqa: E402
from store.conformance.records import event, new_run, record  # noqa: E402
from store.runs import RunStore  # noqa: E402
from tasks.context import Context  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from tasks.start import create_run  # noqa: E402
from tasks.turn import advance  # noqa: E402
from tests.helpers import call, turn, write_agent  # noqa: E402
from tests.redis_server import RedisServer, _client, running_replicated_pair  # noqa: E402

MODES = (0, 1)


@dataclass
class Cost:
    """One block's cost per unit: wall, this process's CPU, the two servers' CPU (seconds),
    and the primary's commands (what a unit sent: WAITs and all)."""

    wall_s: float
    cpu_s: float
    servers_s: float
    commands: dict[str, float]


def servers_cpu_s(servers: tuple[RedisServer, RedisServer]) -> float:
    total = 0.0
    for server in servers:
        with _client(server.port) as client:
            cpu = client.info("cpu")
        total += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return total


def commands(server: RedisServer) -> dict[str, int]:
    with _client(server.port) as client:
        stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


def timed(servers: tuple[RedisServer, RedisServer], units: int, work: Callable[[], None]) -> Cost:
    before, sent = servers_cpu_s(servers), commands(servers[0])
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = commands(servers[0])
    # Less the two INFO calls this function makes itself.
    counted = {
        k: (n - sent.get(k, 0) - (2 if k == "info" else 0)) / units for k, n in after.items()
    }
    return Cost(wall / units, cpu / units, (servers_cpu_s(servers) - before) / units, counted)


def appends(store: RunStore, run_id: str, count: int) -> Callable[[], None]:
    """``count`` replicated appends of a ``tool.requested`` each, on a run made now."""
    new_run(store, run_id)

    def work() -> None:
        for seq in range(2, count + 2):
            requested = event(seq, "tool.requested", call_id=f"c{seq}", name="charge")
            latest = record(run_id, last_seq=seq, status=RunStatus.TOOLS)
            store.append_replicated(latest, [requested], owner=None)

    return work


def turns(ctx: Context, agent: Path, count: int) -> Callable[[], None]:
    """A run of ``count`` turns, each a model call and a call that is not idempotent."""
    run_id = create_run(ctx, agent, "bench").run_id

    def work() -> None:
        done = advance(ctx, run_id, None)
        for _ in range(count):
            done = advance(ctx, run_id, done.seq)
        if done.outcome != "completed":
            raise SystemExit(f"run {run_id} ended {done.outcome}, not completed")

    return work


def ratios(measured: list[dict[int, Cost]], field: str) -> list[float]:
    return [getattr(pair[1], field) / getattr(pair[0], field) for pair in measured]


def report(name: str, unit: str, scale: float, measured: list[dict[int, Cost]]) -> None:
    print(f"\n{name} (median of rounds; each round min_replicas=0 and =1 back to back)")
    for n in MODES:
        sent = {k: statistics.median(m[n].commands.get(k, 0) for m in measured)
                for k in measured[0][n].commands}  # fmt: skip
        shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(sent.items()) if v > 0.005)
        print(f"  commands the primary ran per unit at min_replicas={n}: {shown}")
    for field, what in (("wall_s", "wall"), ("cpu_s", "client CPU"), ("servers_s", "server CPU")):
        zero = statistics.median(getattr(m[0], field) for m in measured) * scale
        one = statistics.median(getattr(m[1], field) for m in measured) * scale
        paired = ratios(measured, field)
        print(
            f"  {what:10} {unit}: {zero:8.1f} at 0, {one:8.1f} at 1; paired ratio 1/0 median "
            f"{statistics.median(paired):.2f} (rounds "
            + ", ".join(f"{r:.2f}" for r in paired)
            + ")"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--appends", type=int, default=500, help="journal appends a block")
    parser.add_argument("--turns", type=int, default=100, help="turns a block")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, running_replicated_pair(Path(tmp)) as servers:
        primary = servers[0]
        urls = {n: f"{primary.url}/1?min_replicas={n}&replica_timeout_ms=1000" for n in MODES}
        stores = {n: open_run_store(urls[n]) for n in MODES}
        settings = Settings(data_dir=Path(tmp) / "data", allow_volatile_store=True)
        contexts = {n: Context(settings, open_snapshot_store(urls[n]), stores[n]) for n in MODES}
        script = [turn("charge", call("slow_charge", sleep_s=0)) for _ in range(args.turns)]
        agent = write_agent(
            Path(tmp) / "agent",
            [*script, turn("done")],
            tools=["tests.slow_tools:slow_charge"],
            budgets={"max_turns": args.turns + 5, "max_tool_calls": args.turns + 5},
        )
        loadavg = Path("/proc/loadavg")
        load = loadavg.read_text().split()[0] if loadavg.exists() else "?"
        print(f"primary :{primary.port}, replica :{servers[1].port}; 1-minute load {load}")
        for n in MODES:  # unmeasured: the agent loads, the scripts reach the server
            timed(servers, 10, appends(stores[n], f"warm-{n}", 10))
            timed(servers, args.turns + 1, turns(contexts[n], agent, args.turns))
        journal: list[dict[int, Cost]] = []
        whole: list[dict[int, Cost]] = []
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 == 0 else MODES[::-1]
            journal.append(
                {
                    n: timed(
                        servers, args.appends, appends(stores[n], f"a{round_}-{n}", args.appends)
                    )
                    for n in order
                }
            )
            whole.append(
                {
                    n: timed(servers, args.turns + 1, turns(contexts[n], agent, args.turns))
                    for n in order
                }
            )
            print(
                f"round {round_ + 1}: append µs {journal[-1][0].wall_s * 1e6:.0f} / "
                f"{journal[-1][1].wall_s * 1e6:.0f}, turn ms {whole[-1][0].wall_s * 1e3:.2f} / "
                f"{whole[-1][1].wall_s * 1e3:.2f} (min_replicas 0 / 1, wall)",
                flush=True,
            )
        report("the journal append of a non-idempotent call", "µs/append", 1e6, journal)
        report("a turn: a model call and a non-idempotent tool call", "ms/turn ", 1e3, whole)
        for ctx in contexts.values():
            ctx.close()


if __name__ == "__main__":
    main()
