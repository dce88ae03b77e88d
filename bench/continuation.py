"""Latency from publishing a continuation to the next model call starting, over Redis.

Starts its own ``redis-server`` on a free port and one ``celery -A worker worker``
(broker and both stores on that server), creates runs that suspend on
``request_user_input``, then answers them one at a time and measures, for each,
the time from just before the publish to the ``model.requested`` event the
worker records when the next model call starts (its ``at_ms``; same host clock).

Two channels: ``ratchet.continue`` sent by a Celery client, and the plain-JSON
queue (``ratchet.continuations``) published with kombu, which takes one hop more.

    python bench/continuation.py [--runs 200] [--pool threads] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("bench: redis-server is not on PATH")
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--dir",
            str(directory),
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    process.kill()
    sys.exit("bench: redis-server did not start")


def write_agent(directory: Path) -> Path:
    script = {
        "turns": [
            {"content": "?", "tool_calls": [
                {"name": "request_user_input", "arguments": {"prompt": "Which order?"}}]},
            {"content": "Done."},
        ]
    }  # fmt: skip
    (directory / "ask.script.json").write_text(json.dumps(script))
    agent = directory / "ask.toml"
    agent.write_text(
        'name = "ask"\nmodel = "scripted"\nscript = "ask.script.json"\n'
        'tools = ["request_user_input"]\n[budgets]\nmax_turns = 5\n'
    )
    return agent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> None:  # noqa: C901 - a script, read top to bottom
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per channel")
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="ratchet-bench-"))
    redis_process, url = start_redis(directory)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_BROKER_URL=url,
        RATCHET_SNAPSHOT_STORE=url,
        RATCHET_RUN_STORE=url,
        RATCHET_DATA_DIR=str(directory / "data"),
        PYTHONPATH=str(ROOT),
    )
    os.environ.update({k: v for k, v in env.items() if k.startswith("RATCHET_")})
    sys.path.insert(0, str(ROOT))
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "worker",
            "worker",
            "--loglevel",
            "WARNING",
            "--without-mingle",
            "--without-gossip",
            "--pool",
            args.pool,
            "--concurrency",
            str(args.concurrency),
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        stdout=open(directory / "worker.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        from kombu import Connection, Queue

        from tasks.messages import enqueue_continue
        from worker.api import Ratchet
        from worker.app import app

        api = Ratchet()
        agent = write_agent(directory)
        results: dict[str, list[float]] = {}
        with Connection(url) as connection:
            producer = connection.Producer(serializer="json")
            queue = Queue("ratchet.continuations")

            def send_celery(run_id: str, cid: str) -> None:
                enqueue_continue(run_id=run_id, input="B2", continuation_id=cid, app=app)

            def send_json(run_id: str, cid: str) -> None:
                producer.publish(
                    {"run_id": run_id, "input": "B2", "continuation_id": cid},
                    exchange="",
                    routing_key="ratchet.continuations",
                    declare=[queue],
                )

            for channel, send in (("celery ratchet.continue", send_celery),
                                  ("plain JSON (kombu)", send_json)):  # fmt: skip
                run_ids = [api.start(agent, "refund") for _ in range(args.runs)]
                deadline = time.monotonic() + 120
                while not all(api.get(r).status.is_suspended for r in run_ids):
                    if time.monotonic() > deadline:
                        sys.exit(f"bench: runs did not suspend; see {directory}/worker.log")
                    time.sleep(0.05)
                send(run_ids[0], "warm-up")  # first message pays for connections
                latencies: list[float] = []
                for index, run_id in enumerate(run_ids[1:]):
                    seq = api.get(run_id).last_seq
                    t0_ns = time.time_ns()
                    send(run_id, f"c{index}")
                    while True:
                        started = [
                            e for e in api.ctx.runs.events(run_id, after_seq=seq)
                            if e.type == "model.requested"
                        ]  # fmt: skip
                        if started:
                            latencies.append(started[0].at_ms - t0_ns / 1e6)
                            break
                        time.sleep(0.002)
                results[channel] = latencies

        print(f"continuation → next model call, {args.runs - 1} runs per channel, "
              f"worker --pool {args.pool} -c {args.concurrency}, Redis on loopback")  # fmt: skip
        for channel, values in results.items():
            print(
                f"  {channel:26} p50 {percentile(values, 50):6.1f} ms   "
                f"p90 {percentile(values, 90):6.1f} ms   p99 {percentile(values, 99):6.1f} ms   "
                f"mean {statistics.fmean(values):6.1f} ms   max {max(values):6.1f} ms"
            )
        print("  (event at_ms has 1 ms resolution: figures are ±1 ms)")
    finally:
        os.killpg(worker.pid, 15)
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
        redis_process.kill()
        redis_process.wait()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
