"""The embedded broker: how fast a consumer picks up a message, and what it burns when idle.

    python -m bench.embedded_broker [--messages 200] [--idle-s 5]

Each variant is a real consumer process (kombu Connection + Consumer, as a
Celery worker drains its queue) on a fresh folder; this process publishes
messages one at a time at random offsets (so the arrival falls anywhere in a
poll period) and the consumer records ``CLOCK_MONOTONIC`` on delivery minus the
time the publisher stamped just before publishing. Then the consumer sits idle
for ``--idle-s`` and its CPU time (utime + stime from /proc) over that span is
read. Variants:

- ``kombu-filesystem``: kombu's own ``filesystem://`` transport, polling every
  10 ms (ratchet's setting before; the baseline the ratios are against);
- ``ratchet-poll-10ms``: ratchet's transport with the inotify wake-up off;
- ``ratchet-poll-1ms``: the same, polling every 1 ms (the cheap fix);
- ``ratchet-inotify``: ratchet's transport as the embedded default runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONSUMER = r"""
import json, os, sys, time
from kombu import Connection, Consumer, Exchange, Queue
import tasks.broker.embedded as transport

folder, transport_name, interval, count, idle_s, wake = sys.argv[1:7]
if wake == "off":
    transport.FolderWake.open = classmethod(lambda cls, folder: None)
options = {"data_folder_in": folder, "data_folder_out": folder, "control_folder": folder + "/c",
           "polling_interval": float(interval), "rejected_folder": folder + "/rejected"}
latencies = []
def on_message(body, message):
    latencies.append(time.monotonic() - body["sent"])
    message.ack()
with Connection("filesystem://", transport=transport_name, transport_options=options) as conn:
    queue = Queue("bench.q", Exchange("bench.q", "direct"), "bench.q")
    with Consumer(conn, [queue], callbacks=[on_message], accept=["json"]):
        print("ready", flush=True)
        while len(latencies) < int(count):
            try:
                conn.drain_events(timeout=5)
            except TimeoutError:
                break
        def cpu():
            with open(f"/proc/{os.getpid()}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        started, before = time.monotonic(), cpu()
        while time.monotonic() - started < float(idle_s):
            try:
                conn.drain_events(timeout=float(idle_s) - (time.monotonic() - started))
            except TimeoutError:
                pass
        idle_cpu = (cpu() - before) / (time.monotonic() - started)
print(json.dumps({"latencies": latencies, "idle_cpu": idle_cpu}), flush=True)
"""

VARIANTS = {
    "kombu-filesystem": ("filesystem", 0.01, "off"),
    "ratchet-poll-10ms": ("ratchet-filesystem", 0.01, "off"),
    "ratchet-poll-1ms": ("ratchet-filesystem", 0.001, "off"),
    "ratchet-inotify": ("ratchet-filesystem", 0.01, "on"),
}


def measure(name: str, messages: int, idle_s: float) -> dict[str, float]:
    from kombu import Connection, Exchange, Producer, Queue

    import tasks.broker.embedded  # noqa: F401  (registers the ratchet-filesystem alias)

    transport_name, interval, wake = VARIANTS[name]
    with tempfile.TemporaryDirectory(prefix="bench-broker-") as folder:
        options = {"data_folder_in": folder, "data_folder_out": folder,
                   "control_folder": folder + "/c", "rejected_folder": folder + "/rejected"}  # fmt: skip
        consumer = subprocess.Popen(
            [
                sys.executable,
                "-c",
                CONSUMER,
                folder,
                transport_name,
                str(interval),
                str(messages),
                str(idle_s),
                wake,
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert consumer.stdout is not None
        assert consumer.stdout.readline().strip() == "ready"
        with Connection("filesystem://", transport=transport_name, transport_options=options) as c:
            queue = Queue("bench.q", Exchange("bench.q", "direct"), "bench.q")
            producer = Producer(c, exchange=queue.exchange, routing_key="bench.q")
            producer.declare()
            queue(c).declare()
            rng = random.Random(7)
            publish: list[float] = []
            for _ in range(messages):
                time.sleep(0.005 + rng.random() * 0.02)
                sent = time.monotonic()
                producer.publish({"sent": sent}, serializer="json")
                publish.append(time.monotonic() - sent)
        result = json.loads(consumer.communicate(timeout=120)[0].splitlines()[-1])
    latencies = sorted(result["latencies"])
    if len(latencies) < messages:
        raise SystemExit(f"{name}: only {len(latencies)} of {messages} messages were delivered")
    return {
        "publish_ms": statistics.median(publish) * 1000,
        "median_ms": statistics.median(latencies) * 1000,
        "p90_ms": latencies[int(0.9 * len(latencies))] * 1000,
        "max_ms": latencies[-1] * 1000,
        "idle_cpu_pct": result["idle_cpu"] * 100,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--idle-s", type=float, default=5.0)
    args = parser.parse_args()
    print(f"loadavg {os.getloadavg()[0]:.2f}; {args.messages} messages each, idle {args.idle_s} s")
    figures = {name: measure(name, args.messages, args.idle_s) for name in VARIANTS}
    base = figures["kombu-filesystem"]
    print("publish→delivery, ms (the publish call itself: `publish`); CPU of the idle consumer")
    print(f"{'variant':<20} {'publish':>8} {'median':>8} {'p90':>8} {'max':>8} {'idle CPU %':>11}"
          f" {'median vs kombu':>16}")  # fmt: skip
    for name, f in figures.items():
        ratio = f["median_ms"] / base["median_ms"]
        print(f"{name:<20} {f['publish_ms']:>8.3f} {f['median_ms']:>8.3f} {f['p90_ms']:>8.3f} "
              f"{f['max_ms']:>8.3f} {f['idle_cpu_pct']:>11.2f} {ratio:>15.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
