"""Watching runs on real workers: a real `celery -A worker worker` streams the answer of a
local OpenAI-compatible server (chunked server-sent events) into the run's live stream on
Redis, and real observers show it as it forms — the Python API, `ratchet runs watch` and
the console in Chromium.

The server holds each piece back until every observer has shown the one before (gates):
an observer that showed the answer only once it was whole would hold the stream up, and
the gate's wait would be recorded as a miss. How long each observer took after the server
sent the first piece is printed (`-s`); bench/streaming.py measures it at scale.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from runtime.models import RunStatus
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import write_agent
from tests.openai_server import OpenAIServer, serve
from tests.test_openai_runs import KEY_VAR, write_openai_agent
from tests.workers import ROOT, WorkerProcesses, redis_context, run_status
from worker.api import Ratchet
from worker.app import make_app
from worker.watch import Assembly, Seen

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FIRST = ["Let me ", "read the ", "order's history."]
SECOND = ["Order B2 ", "was lost ", "in transit; ", "it is covered."]


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def role() -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}


def text(piece: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": piece}}]}


def finish(reason: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


def calls_paged(pages: int) -> dict[str, Any]:
    function = {"name": "paged", "arguments": json.dumps({"pages": pages})}
    part = {"index": 0, "id": "call_p", "type": "function", "function": function}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [part]}}]}


def usage() -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 8}}


def gated(pieces: list[str], tail: list[Any]) -> tuple[list[Any], dict[int, threading.Event]]:
    """The events of an answer of ``pieces``, and a gate before each piece but the first
    and before the end (so the answer cannot commit before the last piece is shown)."""
    events = [role(), *(text(p) for p in pieces), *tail]
    gates = {1 + i: threading.Event() for i in range(1, len(pieces) + 1)}
    return events, gates


@pytest.fixture
def model_server() -> Iterator[OpenAIServer]:
    with serve() as running:
        yield running


def enqueue_turn(redis_url: str, run_id: str, watched: bool = True) -> None:
    """Send the run's first turn; by default once someone watches it (a model call
    streams only when its run is watched as it begins)."""
    if watched:
        ctx = redis_context(redis_url)
        try:
            live = ctx.runs.live()
            assert live is not None
            wait_for("an observer says it watches", lambda: live.watched(run_id))
        finally:
            ctx.close()
    make_app(Settings(broker_url=redis_url)).send_task(
        "ratchet.turn", (run_id, 1), queue="ratchet.turns"
    )


class ApiWatcher:
    """`Ratchet.stream` on a thread of the test, every item kept with when it came."""

    def __init__(self, api: Ratchet, run_id: str, after: str | None = None) -> None:
        self.items: list[tuple[float, Seen]] = []
        self.error: BaseException | None = None
        self._stream = api.stream(run_id, after=after, timeout_s=90)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for seen in self._stream:
                self.items.append((time.monotonic(), seen))
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def seen(self) -> list[Seen]:
        return [item for _, item in self.items]

    def text(self, model_call: int) -> str:
        return "".join(
            s.data.get("text", "")
            for s in self.seen()
            if s.kind == "model.delta" and s.data.get("model_call") == model_call
        )

    def first(self, predicate: Callable[[Seen], bool]) -> float:
        return next(at for at, seen in self.items if predicate(seen))


class CliWatcher:
    """`ratchet runs watch` as a person runs it, its screen read as it is written."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.process = subprocess.Popen(
            ["ratchet", "runs", "watch", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.output = ""
        self.errors = ""
        self.arrivals: list[tuple[float, int]] = []
        """(when, length of the output then), for each read."""

    def pump(self) -> None:
        assert self.process.stdout is not None
        if self.process.stdout.closed:
            return
        fd = self.process.stdout.fileno()
        while select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 65536)
            if not data:
                return
            self.output += data.decode()
            self.arrivals.append((time.monotonic(), len(self.output)))

    def shows(self, needle: str) -> bool:
        self.pump()
        return needle in self.output

    def first(self, needle: str) -> float:
        at = self.output.index(needle) + len(needle)
        return next(when for when, length in self.arrivals if length >= at)

    def finish(self) -> None:
        """Wait for the watcher to end (it ends with its run), then read what is left."""
        try:
            self.process.wait(timeout=30)
        finally:
            self.process.kill()
            self.pump()
            assert self.process.stdout is not None and self.process.stderr is not None
            self.errors = self.process.stderr.read().decode()
            self.process.stdout.close()
            self.process.stderr.close()
            self.process.wait(timeout=10)


def streaming_agent(tmp_path: Path, model_server: OpenAIServer) -> Path:
    return write_openai_agent(tmp_path, model_server, provider={"stream": "true"}, tools=[])


def test_a_worker_killed_mid_answer_shows_its_attempt_abandoned_and_the_next_once(
    worker_processes: WorkerProcesses, model_server: OpenAIServer, redis_url: str, tmp_path: Path
) -> None:
    # Given a threads worker streaming an answer, held after its second piece
    answer = ["The ", "toaster ", "was lost; ", "refunding."]
    held = threading.Event()
    events = [role(), *(text(p) for p in answer), finish("stop"), usage()]
    cut = model_server.enqueue_stream(events, gates={3: held})
    retried, gates = gated(answer, [finish("stop"), usage()])
    model_server.enqueue_stream(retried, gates=gates)
    env = {KEY_VAR: "sk-not-a-secret", "RATCHET_LEASE_S": "1"}
    doomed = worker_processes.start("--pool", "threads", "-c", "4", **env)
    ctx = redis_context(redis_url)
    run_id = create_run(ctx, streaming_agent(tmp_path, model_server), "refund B2").run_id
    api = ApiWatcher(Ratchet(ctx), run_id)
    cli = CliWatcher({**worker_processes.base_env, **env}, run_id)
    enqueue_turn(redis_url, run_id)
    wait_for("the first two pieces are shown", lambda: api.text(1) == "The toaster ")
    # When that worker is SIGKILLed, another starts, and the sweeper resumes the run
    doomed.kill()
    held.set()
    worker_processes.start("--pool", "threads", "-c", "4", **env)
    wait_for("the lease expires", lambda: ctx.runs.overdue() == [run_id], timeout_s=15)
    swept = subprocess.run(
        ["ratchet", "sweep", "--once"],
        cwd=ROOT,
        env={**worker_processes.base_env, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert swept.returncode == 0, swept.stderr

    def retried_shows(so_far: str) -> Callable[[], bool]:
        return lambda: (
            any(s.kind == "model.aborted" for s in api.seen())
            and api.text(1).endswith("The toaster " + so_far)
        )

    for index, gate in sorted(gates.items()):  # attempt 2, each piece once shown
        wait_for("the retry's pieces are shown", retried_shows("".join(answer[: index - 1])))
        gate.set()
    wait_for("the run completes", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED)
    api.thread.join(30)
    cli.finish()

    # Then the observer saw attempt 1 abandoned, then attempt 2 whole, each piece once
    assert cut.sent_at and api.error is None
    seen = api.seen()
    requested = [
        s.event.seq for s in seen if s.event is not None and s.event.type == "model.requested"
    ]
    assert len(requested) == 2, [s.kind for s in seen]
    first_at, second_at = requested
    aborted = [i for i, s in enumerate(seen) if s.kind == "model.aborted"]
    assert len(aborted) == 1 and seen[aborted[0]].data["at"] == first_at
    before = [s.data["text"] for s in seen[: aborted[0]] if s.kind == "model.delta"]
    after = [s for s in seen[aborted[0] :] if s.kind == "model.delta"]
    assert "".join(before) == "The toaster "
    assert all(s.data["at"] == second_at for s in after), "a dead attempt's piece came late"
    assert "".join(s.data["text"] for s in after) == "".join(answer)
    cursors = [s.cursor for s in seen]
    assert len(set(cursors)) == len(cursors)
    assembly = Assembly()
    for item in seen:
        assembly.add(item)
    assert assembly.answers == ["".join(answer)]
    assert "attempt 1 abandoned" in cli.output
    assert cli.output.count(f"│ {''.join(answer)}\n") == 1, cli.output
    ctx.close()


def test_a_reader_killed_mid_answer_comes_back_with_its_cursor_and_misses_nothing(
    worker_processes: WorkerProcesses, model_server: OpenAIServer, redis_url: str, tmp_path: Path
) -> None:
    # Given a gevent worker streaming an answer piece by piece, and a reader printing JSON
    pieces = [f"part {i}; " for i in range(8)]
    events, gates = gated(pieces, [finish("stop"), usage()])
    model_server.enqueue_stream(events, gates=gates)
    env = {KEY_VAR: "sk-not-a-secret"}
    worker_processes.start("--pool", "gevent", "-c", "20", **env)
    ctx = redis_context(redis_url)
    run_id = create_run(ctx, streaming_agent(tmp_path, model_server), "count").run_id
    cli_env = {**worker_processes.base_env, **env}
    reader = CliWatcher(cli_env, run_id, "--json")
    enqueue_turn(redis_url, run_id)
    lines: list[dict[str, Any]] = []

    def read_lines(watcher: CliWatcher) -> list[dict[str, Any]]:
        watcher.pump()
        complete = watcher.output[: watcher.output.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines()]

    def texts(items: list[dict[str, Any]]) -> str:
        return "".join(i.get("text", "") for i in items if i["kind"] == "model.delta")

    def shown(watcher: CliWatcher, before: list[dict[str, Any]], so_far: str) -> Callable[[], bool]:
        return lambda: texts(before + read_lines(watcher)) == so_far

    for index in range(2, 6):  # the first reader sees five pieces...
        so_far = "".join(pieces[: index - 1])
        wait_for(f"the reader shows {so_far!r}", shown(reader, [], so_far))
        gates[index].set()
    wait_for("five pieces", lambda: texts(read_lines(reader)) == "".join(pieces[:5]))
    # When it is SIGKILLed and started again with the last cursor it printed
    reader.process.send_signal(signal.SIGKILL)
    reader.finish()
    lines = read_lines(reader)
    again = CliWatcher(cli_env, run_id, "--json", "--after", lines[-1]["cursor"])
    for index in range(6, len(pieces) + 2):
        so_far = "".join(pieces[: index - 1])
        wait_for(f"the reader shows {so_far!r}", shown(again, lines, so_far))
        gates[index].set()
    wait_for("the run completes", lambda: run_status(ctx, run_id) == RunStatus.COMPLETED)
    again.finish()
    lines += read_lines(again)

    # Then the two readers together printed every piece once, in order, and the run's end
    assert model_server.gate_misses == []
    assert texts(lines) == "".join(pieces)
    cursors = [line["cursor"] for line in lines]
    assert len(set(cursors)) == len(cursors), cursors
    kinds = [line["event"]["type"] for line in lines if line["kind"] == "event"]
    assert kinds == ["run.created", "model.requested", "model.responded", "run.completed"]
    ctx.close()


def test_a_long_answer_keeps_only_maxlen_pieces_and_its_stream_expires(
    worker_processes: WorkerProcesses, redis_url: str, tmp_path: Path
) -> None:
    # Given a worker whose streams keep 20 entries for 1 s, and an answer of 300 pieces
    content = "".join(chr(ord("a") + i % 26) for i in range(300))
    agent = write_agent(tmp_path, [{"content": content}], tools=[])
    script = agent.with_name(f"{agent.stem}.script.json")
    played = json.loads(script.read_text())
    script.write_text(json.dumps({**played, "stream": {"chunk_chars": 1, "interval_s": 0}}))
    worker_processes.start("--pool", "threads", RATCHET_LIVE_MAXLEN="20", RATCHET_LIVE_KEEP_S="1")
    ctx = redis_context(redis_url)
    run_id = create_run(ctx, agent, "go on").run_id
    client = redis.Redis.from_url(redis_url)
    key = f"ratchet:run:{{{run_id}}}:live"
    lengths: list[int] = []
    live = ctx.runs.live()
    assert live is not None
    live.watch(run_id, 60)
    enqueue_turn(redis_url, run_id)
    # When it streams, its stream never holds more than 20 entries...
    deadline = time.monotonic() + 60
    while run_status(ctx, run_id) != RunStatus.COMPLETED and time.monotonic() < deadline:
        lengths.append(int(client.xlen(key)))
        time.sleep(0.002)
    wait_for(
        "the last 20 pieces are kept",
        lambda: [e.data.get("text") for e in live.read(run_id)] == list(content[-20:]),
    )
    assert 0 < max(lengths) <= 20, max(lengths)
    # ...and it is gone a second after the run's last write
    wait_for("the stream expires", lambda: client.exists(key) == 0, timeout_s=10)
    client.close()
    ctx.close()
