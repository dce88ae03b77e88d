"""The checks a worker makes on what it takes off a queue, without a worker.

A check that refuses a legitimate message drops work, so every message shape
ratchet itself sends is shown to pass, beside the shapes that must not.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kombu import Connection

import tasks  # noqa: F401  (registers the ratchet.* tasks on the app)
from worker.app import app
from worker.transport import envelope_problem


@pytest.fixture
def channel() -> Any:
    with Connection("memory://") as connection:
        yield connection.default_channel


def kombu_envelope(channel: Any, body: str) -> dict[str, Any]:
    """What kombu's virtual transports put on a queue for ``body``."""
    message = channel.prepare_message(body, content_type="application/json")
    channel._inplace_augment_message(message, "ratchet.turns", "ratchet.turns")
    return json.loads(json.dumps(message))  # type: ignore[no-any-return]


def test_an_envelope_kombu_wrote_passes(channel: Any) -> None:
    assert (
        envelope_problem(kombu_envelope(channel, '[["r", 1], {}, {}]'), channel.decode_body) is None
    )


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ([1, 2, 3], "the entry is a JSON list, not a kombu envelope"),
        ("text", "the entry is a JSON str, not a kombu envelope"),
        ({"body": "e30="}, "no `properties` object"),
        (
            {"properties": {"delivery_tag": 5}},
            "`properties.delivery_tag` must be a non-empty string",
        ),
        ({"properties": {"delivery_tag": "t"}}, "`properties.delivery_info` must be an object"),
        (
            {"properties": {"delivery_tag": "t", "delivery_info": {"exchange": ""}}},
            "with an exchange and a routing_key",
        ),
    ],
)
def test_what_is_not_an_envelope_is_named(channel: Any, payload: Any, problem: str) -> None:
    found = envelope_problem(payload, channel.decode_body)
    assert found is not None and problem in found


def test_a_body_that_is_not_base64_is_named(channel: Any) -> None:
    envelope = kombu_envelope(channel, "{}")
    envelope["body"] = "not base64!"
    found = envelope_problem(envelope, channel.decode_body)
    assert found is not None and "cannot be decoded as 'base64'" in found


def test_wrong_types_in_an_envelope_are_named(channel: Any) -> None:
    for key, value, problem in [
        ("headers", [], "`headers` must be an object"),
        ("content-type", 3, "`content-type` must be a string"),
        ("body", {"a": 1}, "`body` must be a string"),
    ]:
        envelope = {**kombu_envelope(channel, "{}"), key: value}
        found = envelope_problem(envelope, channel.decode_body)
        assert found is not None and problem in found, key


LEGITIMATE = [
    ("ratchet.turn", ("r1", 3), {}),
    ("ratchet.turn", ("r1", None), {}),
    ("ratchet.start", ("agent.toml", "refund it", "r1"), {}),
    ("ratchet.resume", ("r1", "sweeper", 7), {}),
    ("ratchet.resume", ("r1",), {}),
    ("ratchet.sweep", (), {}),
    ("ratchet.cancel", ("r1",), {"reason": "wrong customer"}),
    ("ratchet.continue", (), {"run_id": "r1", "input": "B2", "continuation_id": "c1"}),
    ("ratchet.continue", (), {"run_id": "r1", "approve": True, "suspension_seq": 4}),
    ("ratchet.reconcile", ("r1", "call-1", "result"), {"result": {"ok": [1, 2]}}),
    ("ratchet.reconcile", ("r1", "call-1", "fail", None, "it broke"), {}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), LEGITIMATE)
def test_every_message_ratchet_sends_passes_its_task_check(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    assert app.tasks[name].arguments_problem(args, kwargs) is None


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "problem"),
    [
        ("ratchet.turn", ("r1",), {}, "argument `expected_seq` is missing"),
        ("ratchet.turn", ("r1", "5"), {}, "argument `expected_seq` must be int | None, not str"),
        ("ratchet.turn", ("r1", True), {}, "argument `expected_seq` must be int | None, not bool"),
        ("ratchet.turn", ("r1", 1, 2), {}, "3 positional arguments, but it takes at most 2"),
        ("ratchet.turn", ("r1",), {"run_id": "r2"}, "argument `run_id` given twice"),
        ("ratchet.continue", (), {"run_id": "r1", "colour": "red"}, "unexpected argument `colour`"),
        (
            "ratchet.continue",
            (),
            {"run_id": "r1", "approve": "yes"},
            "`approve` must be bool | None",
        ),
        ("ratchet.sweep", ("now",), {}, "1 positional argument, but it takes at most 0"),
    ],
)
def test_a_bad_argument_is_named_with_what_it_must_be(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], problem: str
) -> None:
    found = app.tasks[name].arguments_problem(args, kwargs)
    assert found is not None and problem in found


def test_the_signature_a_refusal_quotes_is_the_task_s_own() -> None:
    assert (
        app.tasks["ratchet.turn"].call_form()
        == "ratchet.turn(run_id: str, expected_seq: int | None)"
    )
    assert app.tasks["ratchet.resume"].call_form() == (
        "ratchet.resume(run_id: str, by: str = 'operator', seen_seq: int | None = None)"
    )
