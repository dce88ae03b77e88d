"""The floor of bench/io_fleet.py: a plain Celery task per turn, no durability.

``celery -A bench.io_floor worker -P POOL -c N`` runs it. Each task is one model turn of
the same agent io_fleet runs: the same HTTP call to the same OpenAI-compatible server
(tests/model_server.py, through ratchet's shared httpx client, so both pay the same
client), the tool the model asks for (``examples.refunds.lookup_order``) called in
process, and the next turn chained with ``apply_async``, the transcript travelling in the
message. Nothing is checkpointed, leased, journaled or indexed: what is left is what every
one-task-per-turn design pays. The last turn of a run pushes its finishing time (ms) to
the list ``DONE_KEY`` for the driver to count.

Celery settings are ratchet's own (``worker.app.celery_config``: JSON, ``acks_late`` with
``reject_on_worker_lost``, prefetch, task events as ratchet's default for the broker), on
a queue of its own. Environment: ``RATCHET_BROKER_URL`` (the broker, and ``DONE_KEY``'s
database), ``IO_FLOOR_MODEL_URL`` (the model server's base URL, up to ``/v1``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

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


@app.task(
    name="bench.io_floor.turn", acks_late=True, reject_on_worker_lost=True, ignore_result=True
)
def turn(messages: list[dict[str, Any]]) -> None:
    answer = shared_client().post(
        f"{_model_url}/chat/completions",
        json={"model": "io-fleet", "messages": messages, "tools": TOOLS},
    )
    answer.raise_for_status()
    message = answer.json()["choices"][0]["message"]
    messages.append(message)
    calls = message.get("tool_calls") or []
    for call in calls:
        result = lookup_order(**json.loads(call["function"]["arguments"]))
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    if calls:
        turn.apply_async((messages,))
    else:
        _done.rpush(DONE_KEY, time.time_ns() // 1_000_000)
