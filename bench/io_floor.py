"""The floor of bench/io_fleet.py: a plain Celery task per turn, no durability.

``celery -A bench.io_floor worker -P POOL -c N`` runs it. Each task is one model turn of
the same agent io_fleet runs: the same HTTP call to the same OpenAI-compatible server
(tests/model_server.py, through ratchet's shared httpx client, so both pay the same
client), the tool the model asks for (``examples.refunds.lookup_order``) called in
process, and the next turn chained with ``apply_async``, the transcript travelling in the
message. Nothing is checkpointed, leased, journaled or indexed: what is left is what every
one-task-per-turn design pays. The last turn of a run pushes its finishing time (ms) to
the list ``DONE_KEY`` for the driver to count.

**The durable floor** (a task sent with a run id): the same turn plus the writes the
mission asks of every turn, each the cheapest this design could make them — one Lua
script call each, compact JSON, no snapshot (the event list is the run's state), no
index, no status, no limits, no outbox:

1. the lease taken (``SET NX PX``) with ``model.requested`` journaled, before the call;
2. ``model.responded`` appended under the lease before any tool runs, and with it the
   ``tool.requested`` of its calls: the workload's tool is idempotent, so a crash before
   it starts may leave it requested (it runs again, as ratchet runs it again; a tool that
   is not idempotent would need a write of its own just before it starts);
3. ``tool.completed`` appended and the lease released; then the next turn is chained
   with ``apply_async`` as the floor does (a crash between the two is the sweeper's to
   mend, which this floor leaves out).

Three writes a tool turn, as ratchet makes for it. The last turn writes 1, and 2 with
``run.completed`` and the release. A fence that refuses raises (the run is then not
finished, and the bench says so). What ratchet pays above this floor is what its design adds to the durability the mission fixes.

Celery settings are ratchet's own (``worker.app.celery_config``: JSON, ``acks_late`` with
``reject_on_worker_lost``, prefetch, task events as ratchet's default for the broker), on
a queue of its own. Environment: ``RATCHET_BROKER_URL`` (the broker, and ``DONE_KEY``'s
database), ``IO_FLOOR_MODEL_URL`` (the model server's base URL, up to ``/v1``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Final

import redis
from celery import Celery

from examples.refunds import lookup_order
from runtime_io.providers.http import shared_client
from tasks.settings import Settings
from worker.app import celery_config

DONE_KEY = "bench:io_floor:done_ms"
QUEUE = "bench.io_floor"
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_order", "description": "Find an order by id.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                       "required": ["order_id"]}}},
]  # fmt: skip

app = Celery("bench-io-floor")
config = celery_config(Settings())
config.update(imports=(), task_routes={}, task_default_queue=QUEUE, task_queues=None)
app.conf.update(config)
_done = redis.Redis.from_url(os.environ.get("RATCHET_BROKER_URL", "redis://127.0.0.1:6379/0"))
_model_url = os.environ.get("IO_FLOOR_MODEL_URL", "")

LEASE_MS: Final = 60_000
EVENTS_KEY: Final = "bench:io_floor:events:{}"
LEASE_KEY: Final = "bench:io_floor:lease:{}"
_take_and_append = _done.register_script(
    "if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then "
    "return redis.call('rpush', KEYS[2], ARGV[3]) end return -1"
)
_fenced_append = _done.register_script(  # ARGV: token, release ("1") or not, events...
    "if redis.call('get', KEYS[1]) ~= ARGV[1] then return -1 end "
    "local n = 0 for i = 3, #ARGV do n = redis.call('rpush', KEYS[2], ARGV[i]) end "
    "if ARGV[2] == '1' then redis.call('del', KEYS[1]) end return n"
)


def _write(script: Any, run: str, *args: object) -> None:
    if script(keys=[LEASE_KEY.format(run), EVENTS_KEY.format(run)], args=args) < 0:
        raise RuntimeError(f"run {run}: the lease fence refused a write")


def _event(kind: str, data: object) -> str:
    return json.dumps({"type": kind, "at_ms": time.time_ns() // 1_000_000, "data": data},
                      separators=(",", ":"), ensure_ascii=False)  # fmt: skip


@app.task(
    name="bench.io_floor.turn", acks_late=True, reject_on_worker_lost=True, ignore_result=True
)
def turn(messages: list[dict[str, Any]], run: str | None = None) -> None:
    """One model turn; with ``run``, the durable floor's writes around it."""
    token = "" if run is None else os.urandom(8).hex()
    if run is not None:
        _write(_take_and_append, run, token, LEASE_MS, _event("model.requested", len(messages)))
    answer = shared_client().post(
        f"{_model_url}/chat/completions",
        json={"model": "io-fleet", "messages": messages, "tools": TOOLS},
    )
    answer.raise_for_status()
    message = answer.json()["choices"][0]["message"]
    messages.append(message)
    calls = message.get("tool_calls") or []
    if run is not None:
        events = [_event("model.responded", message)]
        events += [_event("tool.requested", call) for call in calls]
        if not calls:
            events.append(_event("run.completed", None))
        _write(_fenced_append, run, token, "0" if calls else "1", *events)
    for i, call in enumerate(calls):
        result = lookup_order(**json.loads(call["function"]["arguments"]))
        content = json.dumps(result)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        if run is not None:
            done = _event("tool.completed", {"call_id": call["id"], "result": content})
            _write(_fenced_append, run, token, "1" if i == len(calls) - 1 else "0", done)
    if calls:
        turn.apply_async((messages, run))
        return
    _done.rpush(DONE_KEY, time.time_ns() // 1_000_000)
