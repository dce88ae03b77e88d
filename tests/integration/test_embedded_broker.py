"""The embedded ``filesystem://`` broker: whole messages only, and a wake-up instead of a poll.

kombu's filesystem transport creates a message file under its final name and
then writes into it, and its consumer takes any file it lists: a consumer that
lists the folder while a producer is still writing moves and reads half a
message, and the worker dies with ``Unrecoverable error: JSONDecodeError``
(kombu#1551). Here real producer processes publish large messages as fast as
they can while a real consumer drains the folder; every message must arrive
whole, and none may be set aside as unreadable.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Queue

import tasks.broker.embedded as transport
from tasks.broker.transport import ListenedEventDispatcher
from tasks.settings import Settings
from worker.app import make_app

pytestmark = pytest.mark.timeout(240)

TRANSPORT = transport.FILESYSTEM_ALIAS
MESSAGES = 40
PRODUCERS = 2
BODY_BYTES = 3 * 1024 * 1024
"""Large enough that writing one message takes a few milliseconds: a wide window."""

PRODUCER = r"""
import hashlib, sys
from kombu import Connection, Exchange, Producer, Queue
import tasks.broker.embedded

folder, transport_name, count, size, tag = sys.argv[1:6]
options = {"data_folder_in": folder, "data_folder_out": folder, "control_folder": folder + "/c",
           "rejected_folder": folder + "/rejected"}
with Connection("filesystem://", transport=transport_name, transport_options=options) as conn:
    producer = Producer(conn, exchange=Exchange("torn", "direct"), routing_key="torn")
    for i in range(int(count)):
        text = (f"{tag}-{i} " * (int(size) // 8))[: int(size)]
        producer.publish({"text": text, "sha": hashlib.sha256(text.encode()).hexdigest()},
                         serializer="json")
"""


def options(folder: Path) -> dict[str, Any]:
    return {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(folder / "c"),
        "rejected_folder": str(folder / "rejected"),
        "polling_interval": 0.001,
    }


def test_a_consumer_never_reads_a_message_a_producer_is_still_writing(tmp_path: Path) -> None:
    folder = tmp_path / "queue"
    folder.mkdir()
    received: list[dict[str, str]] = []

    def on_message(body: dict[str, str], message: Any) -> None:
        received.append(body)
        message.ack()

    with Connection("filesystem://", transport=TRANSPORT, transport_options=options(folder)) as c:
        queue = Queue("torn", Exchange("torn", "direct"), "torn")
        with Consumer(c, [queue], callbacks=[on_message], accept=["json"]):
            # When producer processes publish large messages while the consumer drains
            producers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        PRODUCER,
                        str(folder),
                        TRANSPORT,
                        str(MESSAGES),
                        str(BODY_BYTES),
                        f"p{n}",
                    ],  # fmt: skip
                    cwd=Path(__file__).resolve().parents[2],
                )
                for n in range(PRODUCERS)
            ]
            deadline = time.monotonic() + 180
            while len(received) < PRODUCERS * MESSAGES and time.monotonic() < deadline:
                try:
                    c.drain_events(timeout=1)
                except TimeoutError:
                    if all(p.poll() is not None for p in producers) and not list(
                        folder.glob("*.msg")
                    ):
                        break
            for producer in producers:
                assert producer.wait(timeout=60) == 0

    # Then every message arrived whole, and none was set aside as unreadable
    rejected = sorted(p.name for p in (folder / "rejected").glob("*")) if (
        folder / "rejected"
    ).exists() else []  # fmt: skip
    assert rejected == []
    assert len(received) == PRODUCERS * MESSAGES
    for body in received:
        assert hashlib.sha256(body["text"].encode()).hexdigest() == body["sha"]


def test_an_idle_consumer_sleeps_on_the_folder_and_wakes_for_a_message(tmp_path: Path) -> None:
    # Given a consumer draining an empty folder with the wake-up (no fast poll)
    folder = tmp_path / "queue"
    folder.mkdir()
    wake = transport.FolderWake.open(str(folder))
    assert wake is not None, "inotify is available on Linux"
    # When nothing arrives, a wait lasts its whole span
    started = time.monotonic()
    wake.wait(0.3)
    assert time.monotonic() - started >= 0.29
    # When a temp file is written and renamed into a message, the wait returns
    (folder / ".x.tmp").write_bytes(b"{}")
    (folder / ".x.tmp").rename(folder / "1_x.torn.msg")
    started = time.monotonic()
    wake.wait(30)
    assert time.monotonic() - started < 10
    # and a temp file alone does not wake it
    (folder / ".y.tmp").write_bytes(json.dumps({}).encode())
    started = time.monotonic()
    wake.wait(0.3)
    assert time.monotonic() - started >= 0.29
    # An ack (a free prefetch slot) pokes it from another thread
    poker = threading.Timer(0.05, wake.poke)
    poker.start()
    started = time.monotonic()
    wake.wait(30)
    assert time.monotonic() - started < 10
    poker.join()
    wake.close()


def test_an_ack_wakes_a_consumer_whose_prefetch_slots_were_all_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (no once-a-second look: only a wake-up can end the wait before the drain's timeout)
    monkeypatch.setattr(transport, "IDLE_POLL_S", 600.0)
    # Given a consumer with one prefetch slot, holding its message unacknowledged (names
    # of its own: kombu keeps a process's bindings per transport class)
    folder = tmp_path / "queue"
    folder.mkdir()
    held: list[Any] = []
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options(folder)) as c:
        queue = Queue("acked", Exchange("acked", "direct"), "acked")
        with Consumer(c, [queue], callbacks=[lambda body, m: held.append(m)], accept=["json"]) as k:
            k.qos(prefetch_count=1)
            producer = c.Producer(exchange=queue.exchange, routing_key="acked")
            producer.publish({"n": 1}, serializer="json")
            producer.publish({"n": 2}, serializer="json")
            c.drain_events(timeout=30)
            assert len(held) == 1
            # When another thread acknowledges it while this one waits (the slot frees)
            acker = threading.Timer(0.05, held[0].ack)
            acker.start()
            started = time.monotonic()
            c.drain_events(timeout=30)
            # Then the waiting drain takes the next message, woken by the ack: not at the
            # end of its 30 s (after which a last look would find it too)
            assert sorted(m.payload["n"] for m in held) == [1, 2]
            assert time.monotonic() - started < 20
            acker.join()
            held[1].ack()


def test_a_consumer_that_took_every_message_looks_again_only_when_one_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a consumer that has taken the only message in its folder (folder listings
    # counted; no once-a-second look within the drains below)
    monkeypatch.setattr(transport, "IDLE_POLL_S", 600.0)
    listed: list[int] = []
    names = transport.FilesystemChannel._names

    def counted(channel: transport.FilesystemChannel) -> list[str]:
        listed.append(1)
        return names(channel)

    monkeypatch.setattr(transport.FilesystemChannel, "_names", counted)
    folder = tmp_path / "queue"
    folder.mkdir()
    got: list[Any] = []
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options(folder)) as c:
        queue = Queue("once", Exchange("once", "direct"), "once")
        with Consumer(c, [queue], callbacks=[lambda body, m: got.append(m)], accept=["json"]):
            producer = c.Producer(exchange=queue.exchange, routing_key="once")
            producer.publish({"n": 1}, serializer="json")
            c.drain_events(timeout=30)
            assert [m.payload["n"] for m in got] == [1]
            got[0].ack()  # (its poke: a free prefetch slot)
            # When it drains again, is poked meanwhile, and nothing arrives
            listed.clear()
            poker = threading.Timer(0.05, c.transport.poke)
            poker.start()
            with pytest.raises(TimeoutError):
                c.drain_events(timeout=0.5)
            poker.join()
            # Then it listed the folder once, at the end of the drain, not after the
            # delivery and the pokes too
            assert len(listed) == 1
            # and a message that arrives is still taken at once
            producer.publish({"n": 2}, serializer="json")
            started = time.monotonic()
            c.drain_events(timeout=30)
            assert [m.payload["n"] for m in got] == [1, 2]
            assert time.monotonic() - started < 20
            got[1].ack()


def test_task_events_reach_the_folder_once_a_receiver_listens(tmp_path: Path) -> None:
    # Given a ratchet app's event dispatcher on a filesystem broker that nobody listens to
    folder = tmp_path / "queue"
    folder.mkdir()
    app = make_app(Settings(data_dir=tmp_path / "data"))
    seen: list[dict[str, Any]] = []

    def on_event(body: dict[str, Any], message: Any) -> None:
        seen.append(body)
        message.ack()

    with Connection("filesystem://", transport=TRANSPORT, transport_options=options(folder)) as c:
        dispatcher = app.events.Dispatcher(c, hostname="w@h")
        assert isinstance(dispatcher, ListenedEventDispatcher)
        # When it sends a task event, no message is written for it
        dispatcher.send("task-received", uuid="unheard")
        assert list(folder.glob("*.msg")) == []
        # When a receiver binds its queue to the events exchange, as `celery events` does
        queue = Queue("listener", Exchange("celeryev", "topic"), "#")
        with Consumer(c, [queue], callbacks=[on_event], accept=["json"]):
            dispatcher.send("task-received", uuid="heard")
            c.drain_events(timeout=30)
        dispatcher.close()
    # Then the next event reaches it
    assert [(e["type"], e["uuid"]) for e in seen] == [("task-received", "heard")]
    app.close()
