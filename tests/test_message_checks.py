"""The checks a worker makes on what it takes off a queue, without a worker.

A check that refuses a legitimate message drops work, so every message shape
ratchet itself sends is shown to pass, beside the shapes that must not.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from kombu import Connection

import tasks  # noqa: F401  (registers the ratchet.* tasks on the app)
from runtime.errors import MessageRefused
from tasks.broker.entries import envelope_problem
from tasks.messages import (
    MESSAGES,
    VERSION,
    Resume,
    Turn,
    call_form,
    decode,
    enqueue_turn,
    enqueue_wake,
)
from tasks.task_base import RatchetTask, _check_parameters, ratchet_task
from worker.app import app


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
    # The previous release's shapes (v0): by position, or by keyword
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
    ("ratchet.wake", ("r1", 4), {}),
    ("ratchet.deliver", ("child-1",), {}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), LEGITIMATE)
def test_every_message_the_previous_release_sent_is_still_read(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    message = decode(name, args, kwargs)
    # Then it means what it meant: the arguments it names, by name, and defaults for the rest
    given = {**dict(zip(message.v0_order, args, strict=False)), **kwargs}
    assert message.model_fields_set == set(given)
    assert {field: getattr(message, field) for field in given} == given
    # and this release's keyword form of it reads back the same
    assert decode(name, (), message.model_dump(), VERSION) == message


def test_the_previous_release_s_positional_order_is_pinned() -> None:
    # A reordered field would silently swap the arguments of every message still queued.
    assert {name: cls.v0_order for name, cls in MESSAGES.items()} == {
        "ratchet.start": (
            "agent_file", "text", "run_id", "idempotency_key", "priority", "concurrency_key",
        ),
        "ratchet.turn": ("run_id", "expected_seq"),
        "ratchet.resume": ("run_id", "by", "seen_seq"),
        "ratchet.continue": (
            "run_id", "input", "approve", "deny", "continuation_id", "suspension_seq",
        ),
        "ratchet.cancel": ("run_id", "reason"),
        "ratchet.reconcile": ("run_id", "call_id", "decision", "result", "reason"),
        "ratchet.sweep": (),
        "ratchet.wake": ("run_id", "seq"),
        "ratchet.deliver": ("child_id",),
    }  # fmt: skip
    for cls in MESSAGES.values():
        assert set(cls.v0_order) == set(cls.model_fields), cls.task


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "problem"),
    [
        ("ratchet.turn", ("r1",), {}, "argument `expected_seq` is missing"),
        ("ratchet.turn", ("r1", "5"), {}, "argument `expected_seq` must be int | None, not str"),
        ("ratchet.turn", ("r1", True), {}, "argument `expected_seq` must be int | None, not bool"),
        ("ratchet.turn", ("r1", 1, 2), {}, "3 positional arguments, but it takes at most 2"),
        ("ratchet.turn", ("r1",), {"run_id": "r2"}, "argument `run_id` given twice"),
        ("ratchet.turn", ("../x", 1), {}, "argument `run_id`: '../x' is not a run id"),
        ("ratchet.continue", (), {"run_id": "r1", "colour": "red"}, "unexpected argument `colour`"),
        (
            "ratchet.continue",
            (),
            {"run_id": "r1", "approve": "yes"},
            "`approve` must be bool | None",
        ),
        ("ratchet.sweep", ("now",), {}, "1 positional argument, but it takes at most 0"),
        ("ratchet.deliver", (), {}, "argument `child_id` is missing"),
    ],
)
def test_a_bad_argument_is_named_with_what_it_must_be(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], problem: str
) -> None:
    with pytest.raises(MessageRefused, match=re.escape(problem)):
        decode(name, args, kwargs)


@pytest.mark.parametrize(
    ("version", "args", "problem"),
    [
        (2, (), "message format version 2 is newer than this worker reads (0 to 1)"),
        (99, ("r1", 1), "message format version 99 is newer than this worker reads"),
        ("1", (), "header `ratchet_v` must be a positive int, not '1'"),
        (True, (), "header `ratchet_v` must be a positive int, not True"),
        (0, (), "header `ratchet_v` must be a positive int, not 0"),
        (1, ("r1", 1), "a version-1 message carries its arguments by keyword, not by position"),
    ],
)
def test_a_version_this_worker_does_not_read_is_refused_naming_it(
    version: object, args: tuple[Any, ...], problem: str
) -> None:
    kwargs = {} if args else {"run_id": "r1", "expected_seq": 1, "new_in_v2": "?"}
    with pytest.raises(MessageRefused, match=re.escape(problem)):
        decode("ratchet.turn", args, kwargs, version)


def test_every_enqueue_function_refuses_a_bad_message_before_sending_it() -> None:
    # The sender checks the same model: nothing malformed reaches a queue
    with pytest.raises(MessageRefused, match="ratchet.turn message refused: argument `run_id`: "):
        enqueue_turn(run_id="../etc", expected_seq=1, app=object())
    with pytest.raises(MessageRefused, match="argument `seq` must be int, not str"):
        enqueue_wake(run_id="r1", seq="3", app=object())


def test_the_signature_a_refusal_quotes_is_the_message_s_own() -> None:
    assert call_form("ratchet.turn") == "ratchet.turn(run_id: str, expected_seq: int | None)"
    assert call_form("ratchet.resume") == (
        "ratchet.resume(run_id: str, by: str = 'operator', seen_seq: int | None = None)"
    )
    assert call_form("ratchet.start").startswith(
        "ratchet.start(agent_file: str, text: str, run_id: str | None = None,"
    )


def test_a_task_whose_parameters_drift_from_its_message_is_not_declared() -> None:
    def positional(run_id: str, expected_seq: int | None) -> str:
        return run_id

    def retyped(*, run_id: str, expected_seq: int) -> str:
        return run_id

    def renamed(*, run_id: str, seq: int | None) -> str:
        return run_id

    def other_message(message: Resume) -> str:
        return message.run_id

    def message_and_more(message: Turn, *, extra: int = 0) -> str:
        return message.run_id

    for fun in (positional, retyped, renamed, other_message, message_and_more):
        with pytest.raises(TypeError, match="are not its message's"):
            ratchet_task(name="ratchet.turn")(fun)


def test_a_task_may_take_its_validated_message_whole() -> None:
    def whole(message: Turn) -> str:
        return message.run_id

    def bound(self: Any, message: Turn) -> str:
        return message.run_id

    def by_keyword(*, run_id: str, expected_seq: int | None) -> str:
        return run_id

    assert _check_parameters("ratchet.turn", whole, bound=False)
    assert _check_parameters("ratchet.turn", bound, bound=True)
    assert not _check_parameters("ratchet.turn", by_keyword, bound=False)
    # ratchet.start and ratchet.continue take theirs whole; the others by keyword
    assert app.tasks["ratchet.continue"].takes_message
    assert app.tasks["ratchet.start"].takes_message
    assert not app.tasks["ratchet.turn"].takes_message


def test_every_ratchet_task_takes_its_message() -> None:
    assert {name for name in app.tasks if name.startswith("ratchet.")} == set(MESSAGES)


def test_a_task_of_the_app_that_is_not_ratchet_s_runs_without_a_contract() -> None:
    # Celery's own tasks on ratchet's app have RatchetTask as their base too
    task = app.tasks["celery.accumulate"]
    assert isinstance(task, RatchetTask)
    assert task(1, 2) == (1, 2)
