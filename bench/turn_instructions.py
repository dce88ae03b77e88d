"""Instructions per turn, counted by callgrind: a turn's own cost, the same on a busy box.

    python -m bench.turn_instructions [--turns 40] [--backend redis|sqlite]
        [--provider scripted|openai] [--processes 1|2] [--against PATH]

This machine's speed drifts by tens of percent within minutes, so a change worth a few
percent of a turn's CPU is lost in any timing. ``valgrind --tool=callgrind`` counts the
instructions a process executes instead: the same program on the same inputs gives the
same count whatever else the box is doing. So this bench drives turns in one process, as
bench/turn_cpu.py does (``tasks.turn.advance``: the lease, the load, the model call, the
tool call, every checkpoint; no Celery delivery), under callgrind, twice: once with a
few turns, once with ``--turns`` more; the difference over the turns added is the
instructions of a turn, start-up and imports taken out. The store's server (Redis) runs
outside valgrind: what is counted is the worker's side. Messages are ~1 KiB of prose, one
tool call a turn, as in bench/turn_cpu.py. Runs under ``PYTHONHASHSEED=0``, after one run
without valgrind that leaves every module's bytecode cached (compiling it is counted
otherwise). Two counts of the same code differ by a few parts in a million.

``--provider openai``: the model is tests/model_server.py, an OpenAI-compatible server in a
process of its own (outside valgrind, as Redis is), called over HTTP by the built-in
provider, as bench/io_fleet.py's fleets call it: the provider's path (httpx, its retry and
deadline, the response's validation) is counted too. Its answers are short (a tool call
each turn), not the scripted model's prose.

``--processes 2``: the turns alternate between two contexts with stores of their own, as
a prefork pool's two processes take a chain's turns (the next turn is pushed while the
process that pushed it is still busy, so the other one gets it): each turn starts from
the state its context saw two turns ago, takes the lease without the journaled first
write (tasks/ahead.py) and reads what the other wrote since.

``--against PATH``: the same on the checkout at PATH, and this checkout's count over its.
Under valgrind a process is ~50x slower: a count takes a minute or two; both checkouts'
counts run side by side, one per core.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FEW = 4
"""Turns of the short count (after one warm-up turn in both)."""


def drive(
    turns: int, backend: str, url: str, directory: Path, model_url: str = "", processes: int = 1
) -> None:
    """The measured program: create a run and take ``turns`` + 1 turns of it in this process
    (with ``model_url``, of an agent whose model is the OpenAI-compatible server there),
    turn i on the ``i % processes``-th of ``processes`` contexts."""
    from bench.turn_cpu import script
    from store import open_run_store, open_snapshot_store
    from tasks.context import Context
    from tasks.settings import Settings
    from tasks.start import create_run
    from tasks.turn import advance
    from tests.helpers import write_agent

    budgets = {"max_turns": turns + 5, "max_tool_calls": turns + 5}
    if model_url:
        agent = directory / "openai-agent.toml"
        agent.write_text(
            'name = "instructions"\nsystem = "Look the order up, then answer."\n'
            'tools = ["examples.refunds:lookup_order"]\nmodel = "openai:io-fleet"\n'
            f'[provider]\nbase_url = "{model_url}"\n[budgets]\n'
            + "".join(f"{key} = {value}\n" for key, value in budgets.items())
        )
    else:
        agent = write_agent(
            directory, script(turns + 1), tools=["examples.refunds:lookup_order"], budgets=budgets
        )
    store = url if backend == "redis" else f"sqlite://{directory / 'runs.sqlite3'}"
    # Background threads wake by the clock, and under valgrind the clock runs ~50x faster
    # than the program: beats and lease renewals far apart keep the count the turns' own.
    settings = Settings(
        data_dir=directory / "data",
        allow_volatile_store=True,
        lease_s=3600,
        heartbeat_interval_s=600,
        liveness_s=1800,
    )
    contexts = [
        Context(settings, open_snapshot_store(store), open_run_store(store))
        for _ in range(processes)
    ]
    try:
        run_id = create_run(contexts[0], agent, "bench").run_id
        # The warm-up turns, one a context: first-time costs in both counts.
        done = advance(contexts[0], run_id, None)
        for ctx in contexts[1:]:
            done = advance(ctx, run_id, done.seq)
        for i in range(turns):
            if done.outcome != "next":
                raise SystemExit(f"the run ended {done.outcome} early")
            done = advance(contexts[i % processes], run_id, done.seq)
    finally:
        for ctx in contexts:
            ctx.close()


TOTAL = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.M)


def count(
    checkout: Path,
    turns: int,
    backend: str,
    url: str,
    model_url: str = "",
    counted: bool = True,
    processes: int = 1,
) -> int:
    """Instructions of a process that drives ``turns`` turns on ``checkout``'s code
    (``counted=False``: run it without valgrind, and return 0)."""
    with tempfile.TemporaryDirectory(prefix="ratchet-instr-") as tmp:
        out = Path(tmp) / "callgrind.out"
        db = f"{url}/{turns % 15 + 1}" if url else ""
        # This file drives both checkouts' turns (the program measured is the same but for
        # the code under test): ``checkout`` is first on the path for everything it imports.
        run_this_file = (
            f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
        )
        command = [sys.executable, "-c", run_this_file, "--inner", str(turns),
                   "--backend", backend, "--url", db, "--dir", tmp,
                   "--model-url", model_url, "--processes", str(processes)]  # fmt: skip
        if counted:
            command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command]
        env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, timeout=3600,
                              check=False)  # fmt: skip
        found = TOTAL.search(out.read_bytes()) if out.exists() else None
        if done.returncode == 0 and not counted:
            return 0
        if done.returncode != 0 or found is None:
            tail = done.stderr.decode(errors="replace")[-1500:]
            raise SystemExit(f"callgrind on {checkout} ({turns} turns) failed:\n{tail}")
        return int(found.group(1))


def per_turn(
    checkout: Path, turns: int, backend: str, url: str, model_url: str = "", processes: int = 1
) -> float:
    # Once without valgrind first: the imports compile what has no bytecode cached yet, which
    # would otherwise fall into one count and not the other.
    count(checkout, 1, backend, url, model_url, counted=False, processes=processes)
    with ThreadPoolExecutor(2) as pool:
        few, many = pool.map(
            lambda n: count(checkout, n, backend, url, model_url, processes=processes),
            [FEW, FEW + turns],
        )
    return (many - few) / turns


@contextmanager
def model_server() -> Iterator[str]:
    """tests/model_server.py in a process of its own, answering every turn with a tool call:
    its base URL."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.model_server", "--port", "0", "--latency", "0",
         "--turns", "1000000"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        if not url.startswith("http://"):
            raise SystemExit(f"the model server did not start (it printed {url!r})")
        yield url
    finally:
        assert server.stdin is not None
        server.stdin.close()  # it ends when its stdin closes
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40, help="turns the long count adds")
    parser.add_argument("--backend", choices=["redis", "sqlite"], default="redis")
    parser.add_argument("--provider", choices=["scripted", "openai"], default="scripted")
    parser.add_argument("--processes", type=int, choices=[1, 2], default=1,
                        help="contexts the turns alternate between")  # fmt: skip
    parser.add_argument("--against", type=Path, help="another checkout: before and after")
    parser.add_argument("--inner", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-url", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner is not None:
        drive(args.inner, args.backend, args.url, args.dir, args.model_url, args.processes)
        return
    sys.path.insert(0, str(ROOT))
    from tests.redis_server import running_redis_server

    checkouts = [ROOT] + ([args.against.resolve()] if args.against else [])
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        model_url = stack.enter_context(model_server()) if args.provider == "openai" else ""
        url = ""
        if args.backend == "redis":
            url = stack.enter_context(running_redis_server(Path(tmp), appendonly=False)).url
        counts = [
            per_turn(c, args.turns, args.backend, url, model_url, args.processes) for c in checkouts
        ]
    for checkout, n in zip(checkouts, counts, strict=True):
        print(f"{checkout}: {n / 1e6:.3f} M instructions per turn ({args.backend}, "
              f"{args.provider}, {args.processes} process(es), {args.turns} turns over "
              f"{FEW})")  # fmt: skip
    if args.against:
        print(f"this checkout / {checkouts[1]}: {counts[0] / counts[1]:.4f}")


if __name__ == "__main__":
    main()
