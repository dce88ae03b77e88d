"""The baseline: a plain Celery self-chain of no-op tasks, same broker settings as ratchet.

``celery -A bench.selfchain worker`` runs it; each task enqueues its successor
until ``hops_left`` is 0, then counts one finished chain in Redis.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from tasks.settings import Settings
from worker.app import celery_config

app = Celery("bench-selfchain")
config = celery_config(Settings())
config.update(imports=(), task_routes={}, task_default_queue="bench.selfchain", task_queues=None)
app.conf.update(config)
_counter = redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL", "redis://127.0.0.1:6379/15"))


@app.task(name="bench.hop", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def hop(chain_id: int, hops_left: int) -> None:
    if hops_left > 1:
        hop.apply_async((chain_id, hops_left - 1))
    else:
        _counter.incr("bench:chains_done")
