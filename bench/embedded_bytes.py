"""Bytes the embedded default writes per turn, on a real worker, by cause. Prints figures.

    python -m bench.embedded_bytes [--turns 200] [--by-file] [--against PATH [--rounds 3]]

Starts ``celery -A worker worker`` (prefork ``-c 2``, the embedded default: a
``filesystem://`` broker and the SQLite run store holding the snapshots, all under a
fresh data dir), warms it with two short runs, then drives one run of ``--turns``
turns shaped like the peer benchmark's workload (each turn one model answer of
~1 KB of prose-like text with one tool call, and a ~1 KB tool result) and reads
``wchar`` and ``write_bytes`` from ``/proc/<pid>/io`` of the worker and its pool
processes before and after: bytes handed to ``write()``-family calls, and bytes the
block layer was asked to write, per turn. The driver's own ``start`` is not counted.

``--by-file`` also runs the worker under ``strace -f`` for the measured run and sums
the bytes of every ``write``/``pwrite64``/``writev`` by the file they went to
(the SQLite WAL, the database file that checkpoints copy the WAL into, the broker's
message files, the pipes between the worker and its pool, the rest), with the
``fsync``/``fdatasync`` calls per file: where the bytes go.

``--against PATH``: before and after a change. Each of ``--rounds`` rounds measures
this checkout and the checkout at PATH (each in a fresh process and data dir, the
order alternated round by round) and prints this checkout's wchar per turn over
PATH's: the median of the rounds' ratios and each round's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_BYTES = 1000
TOOL = '''
import random

def search(query: str, k: int) -> str:
    """Search the corpus (a stand-in: ~1 KB of prose-like text)."""
    rng = random.Random(query)
    return " ".join(rng.choice(WORDS) for _ in range(250))[:1000]

WORDS = [
    "".join(random.Random(i).choices("etaoinshrdlucmfwypvbgk", k=2 + i % 9)) for i in range(4096)
]
'''


def text(rng: random.Random) -> str:
    """~1 KB of prose-like words (compresses about as prose does, unlike a filler string)."""
    words = [
        "".join(rng.choices("etaoinshrdlucmfwypvbgk", k=rng.randint(2, 10))) for _ in range(300)
    ]
    return " ".join(words)[:TEXT_BYTES]


def write_agent(directory: Path, name: str, turns: int) -> Path:
    rng = random.Random(name)
    script = {
        "turns": [
            {
                "content": text(rng),
                "tool_calls": [{"name": "search", "arguments": {"query": f"q {i}", "k": 5}}],
                "usage": {"input_tokens": 100, "output_tokens": 250},
            }
            for i in range(turns)
        ]
        + [{"content": "done", "usage": {"input_tokens": 100, "output_tokens": 1}}]
    }
    (directory / f"{name}.script.json").write_text(json.dumps(script))
    agent = directory / f"{name}.toml"
    agent.write_text(
        f'name = "{name}"\nmodel = "scripted"\nscript = "{name}.script.json"\n'
        'system = "bench"\ntools = ["bytes_tool:search"]\n'
        f"[budgets]\nmax_turns = {turns + 5}\nmax_tool_calls = {turns + 5}\n"
    )
    return agent


def tree(root: int) -> list[int]:
    """``root`` and its children (a prefork worker's pool processes)."""
    children = Path(f"/proc/{root}/task/{root}/children").read_text().split()
    return [root, *map(int, children)]


def io(pids: list[int]) -> tuple[int, int, float]:
    """(wchar, write_bytes, CPU seconds) summed over ``pids``."""
    wchar = written = ticks = 0
    for pid in pids:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        wchar += int(fields["wchar"])
        written += int(fields["write_bytes"])
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(stat[11]) + int(stat[12])
    return wchar, written, ticks / os.sysconf("SC_CLK_TCK")


def database_bytes(path: Path) -> int:
    """The pages a SQLite database uses (its free pages left out)."""
    with sqlite3.connect(path) as conn:
        count, free, size = (
            conn.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("page_count", "freelist_count", "page_size")
        )
    return int((count - free) * size)


CALL = re.compile(
    r"^\d+\s+(write|pwrite64|writev|pwritev2?|fsync|fdatasync)\((\d+)<([^>]*)>.*\)\s+=\s+(-?\d+)"
)


def cause(path: str, data: Path) -> str:
    """What a file written to is, for the by-file table."""
    name = path.replace(str(data), "<data>")
    if name.endswith("runs.sqlite3-wal"):
        return "SQLite WAL (commits)"
    if name.endswith("runs.sqlite3"):
        return "SQLite db file (WAL checkpoints)"
    if name.endswith("runs.sqlite3-shm"):
        return "SQLite shm"
    if "-live" in name or "live" in name.rsplit("/", 1)[-1]:
        return f"live stream ({name.rsplit('/', 1)[-1]})"
    if "/broker/" in name:
        return "broker message files"
    if name.startswith("pipe:"):
        return "pipes (worker <-> pool)"
    if name.startswith("socket:"):
        return "sockets"
    return name


def by_file(trace: Path, data: Path) -> dict[str, dict[str, int]]:
    """Bytes, write calls and fsyncs per cause, from an ``strace -y`` log."""
    found: dict[str, dict[str, int]] = {}
    for line in trace.read_text(errors="replace").splitlines():
        match = CALL.match(line)
        if match is None:
            continue
        call, _, path, result = match.groups()
        row = found.setdefault(cause(path, data), {"bytes": 0, "writes": 0, "fsyncs": 0})
        if call in ("fsync", "fdatasync"):
            row["fsyncs"] += 1
        elif int(result) > 0:
            row["bytes"] += int(result)
            row["writes"] += 1
    return found


def measure(turns: int, with_strace: bool, code: Path) -> dict[str, object]:
    """One worker, one measured run of ``turns`` turns, of the ratchet checkout at ``code``
    (this process must import the same: it is on PYTHONPATH)."""
    tmp = Path(tempfile.mkdtemp(prefix="embedded-bytes-"))
    data = tmp / "data"
    (tmp / "bytes_tool.py").write_text(TOOL)
    os.environ["RATCHET_DATA_DIR"] = str(data)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(code), str(tmp)])
    sys.path.insert(0, str(tmp))
    command = [
        sys.executable, "-m", "celery", "-A", "worker", "worker", "--loglevel", "WARNING",
        "--pool", "prefork", "--concurrency", "2", "--without-mingle", "--without-gossip",
        "--hostname", f"bytes-{os.getpid()}@%h",
    ]  # fmt: skip
    log = (tmp / "worker.log").open("ab")
    worker = subprocess.Popen(command, cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    tracer: subprocess.Popen[bytes] | None = None
    try:
        from worker.api import Ratchet

        api = Ratchet()

        def run(name: str, count: int) -> None:
            api.start(write_agent(tmp, name, count), "go", run_id=name)
            record = api.wait(name, timeout_s=600, poll_s=0.005)
            if record.status.value != "completed":
                raise SystemExit(f"run {name} ended {record.status.value}; see {tmp}/worker.log")

        for i in range(2):
            run(f"warm{i}", 2)
        pids = tree(worker.pid)
        agent = write_agent(tmp, "measured", turns)
        if with_strace:
            trace = tmp / "strace.log"
            tracer = subprocess.Popen(
                ["strace", "-f", "-qq", "-y", "-s", "0", "-o", str(trace),
                 "-e", "trace=write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync",
                 *(a for pid in pids for a in ("-p", str(pid)))],
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(1.0)  # strace attaches to every thread before the run starts
        before, used = io(pids), database_bytes(data / "runs.sqlite3")
        api.start(agent, "go", run_id="measured")
        record = api.wait("measured", timeout_s=1200, poll_s=0.005)
        after = io(pids)
        if record.status.value != "completed":
            raise SystemExit(f"the run ended {record.status.value}; see {tmp}/worker.log")
        stored = sum(len(e.model_dump_json()) for e in api.events("measured"))
        result: dict[str, object] = {
            "turns": turns,
            "wchar_per_turn": (after[0] - before[0]) / turns,
            "write_bytes_per_turn": (after[1] - before[1]) / turns,
            "cpu_ms_per_turn": (after[2] - before[2]) * 1000 / turns,
            "database_bytes_per_turn": (database_bytes(data / "runs.sqlite3") - used) / turns,
            "stored_event_bytes_per_turn": stored / turns,
        }
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=60)
            tracer = None
            result["by_file"] = by_file(tmp / "strace.log", data)
        return result
    finally:
        if tracer is not None:
            tracer.kill()
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def report(result: dict[str, object]) -> None:
    turns = int(result["turns"])  # type: ignore[call-overload]
    print(f"{turns} turns: wchar {result['wchar_per_turn']:,.0f} B/turn, block-layer "
          f"write_bytes {result['write_bytes_per_turn']:,.0f} B/turn; events stored "
          f"{result['stored_event_bytes_per_turn']:,.0f} B/turn, database grew "
          f"{result['database_bytes_per_turn']:,.0f} B/turn; worker CPU "
          f"{result['cpu_ms_per_turn']:.2f} ms/turn")  # fmt: skip
    files = result.get("by_file")
    if isinstance(files, dict):
        print(f"\n{'cause (strace -f -y, measured run)':40} {'B/turn':>10} {'writes/turn':>12} "
              f"{'fsyncs/turn':>12}")  # fmt: skip
        for name, row in sorted(files.items(), key=lambda kv: -kv[1]["bytes"]):
            print(f"{name[:40]:40} {row['bytes'] / turns:10,.0f} {row['writes'] / turns:12.2f} "
                  f"{row['fsyncs'] / turns:12.3f}")  # fmt: skip
        total = sum(row["bytes"] for row in files.values())
        print(f"{'total':40} {total / turns:10,.0f}")


def one(checkout: Path, turns: int) -> dict[str, float]:
    """One measurement of ``checkout``'s code in a fresh process (by this file: a checkout
    from before the bench existed can be measured too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env["PYTHONPATH"] = str(checkout)
    command = [sys.executable, __file__, "--turns", str(turns), "--code", str(checkout), "--json"]
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=1800, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"bench.embedded_bytes on {checkout} failed:\n{done.stdout}{done.stderr}")
    found: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def against(other: Path, turns: int, rounds: int) -> None:
    """This checkout's bytes (and CPU) per turn over ``other``'s, rounds alternated."""
    here = ROOT
    keys = ("wchar_per_turn", "write_bytes_per_turn", "database_bytes_per_turn", "cpu_ms_per_turn")
    ratios: dict[str, list[float]] = {key: [] for key in keys}
    for round_ in range(rounds):
        order = [here, other] if round_ % 2 == 0 else [other, here]
        measured = {checkout: one(checkout, turns) for checkout in order}
        for key, found in ratios.items():
            found.append(measured[here][key] / max(measured[other][key], 1e-9))
        print(f"  round {round_ + 1}: " + ", ".join(
            f"{key} {measured[here][key]:,.2f} / {measured[other][key]:,.2f}" for key in keys
        ), flush=True)  # fmt: skip
    print(f"\nper turn, {here} / {other}, paired by round:")
    for key, found in ratios.items():
        print(f"  {key:24} median {statistics.median(found):.3f} (rounds: "
              + ", ".join(f"{r:.3f}" for r in found) + ")")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--by-file", action="store_true", help="attribute bytes (strace)")
    parser.add_argument("--against", type=Path, help="another checkout: before and after")
    parser.add_argument("--rounds", type=int, default=3, help="with --against")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--code", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.against is not None:
        against(args.against.resolve(), args.turns, args.rounds)
        return
    if args.by_file and shutil.which("strace") is None:
        parser.error("--by-file needs strace")
    result = measure(args.turns, args.by_file, args.code.resolve())
    if args.json:
        print(json.dumps(result))
    else:
        report(result)


if __name__ == "__main__":
    main()
