"""Wrong console tokens are rate-limited per client address, in bounded memory.

Against a real ``python -m worker console`` over TCP: the client address is the
socket's, so a second loopback address (127.0.0.2) is a second client.
"""

from __future__ import annotations

import httpx
import pytest

from tests.console.conftest import TOKEN, ConsoleServer
from worker.console.auth import MAX_FAILURES, LoginThrottle

pytestmark = pytest.mark.timeout(90)


def client(server: ConsoleServer, address: str) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=server.url, transport=transport, timeout=10)


def test_an_address_that_sends_too_many_wrong_tokens_must_wait(
    console_server: ConsoleServer,
) -> None:
    with (
        client(console_server, "127.0.0.1") as guesser,
        client(console_server, "127.0.0.2") as other,
    ):
        # Given an address that sent MAX_FAILURES wrong tokens, each refused as wrong
        for attempt in range(MAX_FAILURES):
            wrong = guesser.post("/login", data={"token": f"guess-{attempt:04d}-xxxxxxxxxx"})
            assert wrong.status_code == 401, (attempt, wrong.text)
        # When it tries again, even with the right token
        refused = guesser.post("/login", data={"token": TOKEN})
        # Then it is told to wait, and gets no session
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert "too many wrong tokens from this address" in refused.text
        assert "ratchet_console" not in refused.cookies
        # and a bearer token from it is refused the same way
        read = guesser.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert read.status_code == 429
        # while another address logs in at once
        logged_in = other.post("/login", data={"token": TOKEN})
        assert logged_in.status_code == 303 and "ratchet_console" in logged_in.cookies


def test_wrong_bearer_tokens_count_as_wrong_logins(console_server: ConsoleServer) -> None:
    with client(console_server, "127.0.0.3") as guesser:
        for attempt in range(MAX_FAILURES):
            read = guesser.get("/", headers={"Authorization": f"Bearer guess-{attempt}"})
            assert read.status_code == 303  # to the login page
        assert guesser.post("/login", data={"token": TOKEN}).status_code == 429


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_throttle_forgets_old_failures_and_remembers_a_bounded_number_of_addresses() -> None:
    clock = Clock()
    throttle = LoginThrottle(max_failures=3, window_s=60, max_addresses=100, clock=clock)
    for _ in range(3):
        throttle.failed("10.0.0.1")
    assert throttle.wait_s("10.0.0.1") == 60
    clock.now += 45
    assert throttle.wait_s("10.0.0.1") == 15
    clock.now += 15
    assert throttle.wait_s("10.0.0.1") == 0
    # A login forgets the address's failures
    throttle.failed("10.0.0.2")
    throttle.succeeded("10.0.0.2")
    assert throttle.wait_s("10.0.0.2") == 0
    # A flood of addresses keeps at most max_addresses, pushing out the oldest
    for n in range(10_000):
        throttle.failed(f"2001:db8::{n:x}")
    assert len(throttle) == 100
    assert throttle.wait_s("10.0.0.1") == 0
    for _ in range(3):
        throttle.failed("2001:db8::ffff:1")
    assert throttle.wait_s("2001:db8::ffff:1") == 60
