"""The OpenAI-compatible provider's HTTP client: one per process, in shards that threads share."""

from __future__ import annotations

import threading
from collections import Counter

import httpx

from runtime_io.providers import http


def test_threads_share_the_process_client_spread_evenly_over_its_shards() -> None:
    # Given a worker with 500 slots sizing the process's client (tasks.pool adds 8)
    http.size_http_pool(508)
    try:
        drawn: dict[int, tuple[httpx.Client, httpx.Client]] = {}

        def draw(i: int) -> None:
            drawn[i] = (http.shared_client(), http.shared_client())

        # When 64 threads each ask for the client twice
        threads = [threading.Thread(target=draw, args=(i,)) for i in range(64)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        # Then each thread keeps to one client, the process holds 16 (508 / 32), and
        # the threads are spread over them evenly
        assert all(first is second for first, second in drawn.values())
        per_client = Counter(id(first) for first, _ in drawn.values())
        assert len(per_client) == 16
        assert set(per_client.values()) == {4}
    finally:
        http.size_http_pool(http.DEFAULT_HTTP_CONNECTIONS)


def test_a_small_process_has_a_single_client() -> None:
    http.size_http_pool(10)
    try:
        seen = set()

        def draw() -> None:
            seen.add(id(http.shared_client()))

        threads = [threading.Thread(target=draw) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(seen) == 1
    finally:
        http.size_http_pool(http.DEFAULT_HTTP_CONNECTIONS)
