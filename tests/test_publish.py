"""The lean publish of a chained ``ratchet.turn`` (tasks/broker/next_turn.py) is Celery's message.

From inside a running task, on each broker ratchet runs on (Redis, RabbitMQ, the
filesystem), one turn goes out through the lean path and one through Celery's
``send_task`` with what tasks/messages.py gives it; both are read back off the real
broker and must be equal field by field but for their own ids, and the publish
signals must have seen the same. Then a real worker subprocess takes a lean
message and moves the run on.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from celery.utils.saferepr import saferepr
from hypothesis import given
from hypothesis import strategies as st

from runtime.models import RunStatus
from tasks.broker.next_turn import _kwargsrepr, lean_turns
from tasks.delivery import redis_lists
from tasks.messages import VERSION, VERSION_HEADER, enqueue_resume
from tasks.queues import TURNS_QUEUE
from tasks.settings import Settings
from tasks.start import create_run
from tests.helpers import turn, write_agent
from tests.workers import WorkerProcesses, redis_context, wait_for
from worker.app import make_app
from worker.senders import check_broker

KWARGS = {"run_id": "lean-1", "expected_seq": 3}
PER_MESSAGE = ("id", "correlation_id", "delivery_tag")
"""What two messages never share: the task id (header and property) and the broker's tag."""


def app_on(broker: str, tmp_path: Path) -> Celery:
    app = make_app(Settings(broker_url=broker or None, data_dir=tmp_path / "data"))
    app.finalize()
    return app


@pytest.fixture(params=["redis", "rabbitmq", "filesystem"])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "redis":
        yield request.getfixturevalue("redis_url")
    elif request.param == "rabbitmq":
        yield request.getfixturevalue("rabbitmq_vhost")
    else:
        yield ""  # the embedded default: filesystem:// under the data dir


def sent_in_a_task(app: Celery, send: Any) -> Any:
    """``send()``'s result, called inside a running task of ``app`` (as a turn chains)."""

    def probe() -> Any:
        return send()

    probe_task = app.task(name=f"test.probe.{uuid.uuid4().hex[:8]}", shared=False)(probe)
    result = probe_task.apply()
    assert result.successful(), result.traceback
    return result.get()


def through_celery(app: Celery, priority: int | None) -> str:
    """What tasks/messages.py ``send`` gave Celery before the lean path."""
    options: dict[str, Any] = {"queue": TURNS_QUEUE}
    if priority is not None:
        options["priority"] = priority
    result = app.send_task(
        "ratchet.turn", kwargs=dict(KWARGS), headers={VERSION_HEADER: VERSION}, **options
    )
    return str(result.id)


def through_lean(app: Celery, priority: int | None) -> str:
    sent = lean_turns(app).publish(dict(KWARGS), TURNS_QUEUE, priority, {VERSION_HEADER: VERSION})
    assert sent is not None, "the lean path handed the turn back to send_task"
    return sent


def taken(app: Celery) -> dict[str, Any]:
    """The next message on the turns queue, as the broker hands it to a consumer."""
    with app.connection_for_read() as conn:
        message = conn.default_channel.basic_get(TURNS_QUEUE, no_ack=True)
        assert message is not None, "no message on the turns queue"
        return {
            "headers": dict(message.headers),
            "properties": {k: v for k, v in message.properties.items() if k != "delivery_info"},
            "delivery_info": {
                k: message.delivery_info.get(k) for k in ("exchange", "routing_key", "priority")
            },
            "content_type": message.content_type,
            "content_encoding": message.content_encoding,
            "body": message.body,
        }


def without_ids(fields: Any) -> Any:
    if isinstance(fields, dict):
        return {k: without_ids(v) for k, v in fields.items() if k not in PER_MESSAGE}
    return fields


@pytest.mark.timeout(120)
@pytest.mark.parametrize("priority", [7, None])
def test_a_lean_turn_is_the_message_send_task_publishes(
    broker: str, tmp_path: Path, priority: int | None
) -> None:
    app = app_on(broker, tmp_path)
    signalled: list[tuple[str, dict[str, Any]]] = []

    def before(**kwargs: Any) -> None:
        signalled.append(("before", {k: v for k, v in kwargs.items() if k != "signal"}))

    def after(**kwargs: Any) -> None:
        signalled.append(("after", {k: v for k, v in kwargs.items() if k != "signal"}))

    before_task_publish.connect(before, weak=False)
    after_task_publish.connect(after, weak=False)
    try:
        # Given one turn sent each way from the same running task
        ids = sent_in_a_task(
            app, lambda: (through_celery(app, priority), through_lean(app, priority))
        )
        # When both are read back off the broker (the filesystem broker may hand two
        # messages of one millisecond over in either order: each is told by its id)
        read = {message["headers"]["id"]: message for message in (taken(app), taken(app))}
    finally:
        before_task_publish.disconnect(before)
        after_task_publish.disconnect(after)
    # Then they differ in their ids only
    assert sorted(read) == sorted(ids)
    first, second = read[ids[0]], read[ids[1]]
    assert first["properties"]["correlation_id"] == ids[0]
    assert second["properties"]["correlation_id"] == ids[1]
    assert without_ids(second) == without_ids(first)
    assert list(second["headers"]) == list(first["headers"])  # and the order of the headers
    assert first["headers"]["argsrepr"] == "run_id='lean-1', seq=3"  # worker/observe.py's
    assert first["headers"]["parent_id"] == first["headers"]["root_id"] is not None
    # And the publish signals saw the same, in the same order
    assert [name for name, _ in signalled] == ["before", "after", "before", "after"]
    celery_said, lean_said = signalled[:2], signalled[2:]
    for (_, by_celery), (_, by_lean) in zip(celery_said, lean_said, strict=True):
        declare_celery, declare_lean = by_celery.pop("declare", None), by_lean.pop("declare", None)
        assert [q.name for q in declare_lean or []] == [q.name for q in declare_celery or []]
        assert without_ids(by_lean) == without_ids(by_celery)


@pytest.mark.timeout(60)
def test_on_redis_the_lean_entry_is_the_one_kombu_pushes(redis_url: str, tmp_path: Path) -> None:
    app = app_on(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url)
    try:
        sent_in_a_task(app, lambda: (through_celery(app, 7), through_lean(app, 7)))
        entries = [
            json.loads(raw) for q in redis_lists(TURNS_QUEUE) for raw in client.lrange(q, 0, -1)
        ]
        listed = [q for q in redis_lists(TURNS_QUEUE) if client.llen(q)]
    finally:
        client.close()
    # Both on the list of priority 7, LPUSHed: the lean one first.
    assert listed == [redis_lists(TURNS_QUEUE)[7]]
    lean, celery = entries
    assert list(lean) == list(celery)
    assert list(lean["properties"]) == list(celery["properties"])
    assert without_ids(lean) == without_ids(celery)


@pytest.mark.timeout(60)
def test_outside_a_task_or_with_a_countdown_the_turn_goes_through_send_task(
    redis_url: str, tmp_path: Path
) -> None:
    app = app_on(redis_url, tmp_path)
    assert lean_turns(app).publish(dict(KWARGS), TURNS_QUEUE, None, {}) is None


@pytest.mark.timeout(180)
def test_a_real_worker_takes_a_lean_turn_and_moves_the_run_on(
    redis_url: str, tmp_path: Path, ledger: Path, worker_processes: WorkerProcesses
) -> None:
    ctx = redis_context(redis_url)
    try:
        run_id = f"lean-{uuid.uuid4().hex[:10]}"
        agent = write_agent(tmp_path, [turn("Done.")])
        state = create_run(ctx, agent, "hello", run_id)
        app = app_on(redis_url, tmp_path)
        # Given a lean turn on the queue, for the run at its seq
        sent_in_a_task(
            app,
            lambda: lean_turns(app).publish(
                {"run_id": run_id, "expected_seq": state.seq}, TURNS_QUEUE, None,
                {VERSION_HEADER: VERSION},
            ),
        )  # fmt: skip
        # When a worker starts, Then it takes the turn and the run completes
        worker_processes.start("--pool", "prefork", "-c", "1")

        def completed() -> bool:
            record = ctx.runs.get(run_id)
            return record is not None and record.status == RunStatus.COMPLETED

        wait_for("the run completes", completed, timeout_s=120)
    finally:
        ctx.close()


@pytest.mark.timeout(120)
def test_lean_publishes_from_more_threads_than_the_producer_pool_holds(
    redis_url: str, tmp_path: Path
) -> None:
    """A threads worker runs more turns at once than ``broker_pool_limit``: no thread
    keeps a producer between its publishes, so every one of them gets one."""
    app = app_on(redis_url, tmp_path)
    app.conf.broker_pool_limit = 1
    sent: list[str] = []

    def publish_from_a_task() -> None:
        sent.append(sent_in_a_task(app, lambda: through_lean(app, None)))

    for _ in range(3):  # one after the other, each on a thread of its own
        thread = threading.Thread(target=publish_from_a_task, daemon=True)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), "a publish waited for a producer another thread kept"
    assert len(set(sent)) == 3
    client = redis.Redis.from_url(redis_url)
    assert sum(client.llen(q) for q in redis_lists(TURNS_QUEUE)) == 3


def test_threads_sending_through_a_new_app_at_once_leave_no_connection_to_the_collector(
    broker: str, tmp_path: Path
) -> None:
    """Celery makes an app's connection pool on first use without a lock, and kombu its
    registry's pool for a broker the same way: threads that sent through a new app at
    once each made a pool, and dropped the ones the app did not keep with the
    connections they had opened (RabbitMQ's sockets left to the garbage collector)."""
    settings = Settings(broker_url=broker or None, data_dir=tmp_path / "data")
    apps = []
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as Python lets them
    try:
        for round_ in range(40):
            app = app_on(broker, tmp_path)
            # A broker kombu's registry has no pool for yet (the options are in its key).
            app.conf.broker_transport_options = {
                **(app.conf.broker_transport_options or {}),
                "test_round": f"{uuid.uuid4().hex}-{round_}",
            }
            apps.append(app)
            start = threading.Barrier(6)

            def send(
                app: Celery = app, start: threading.Barrier = start, checked: bool = False
            ) -> None:
                start.wait(timeout=30)
                if checked:  # what the API and the CLI do before they send
                    check_broker(settings, app)
                enqueue_resume(run_id=f"pools-{uuid.uuid4().hex[:8]}", app=app)

            threads = [
                threading.Thread(target=send, kwargs={"checked": i % 2 == 0}) for i in range(6)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
                assert not thread.is_alive()
    finally:
        sys.setswitchinterval(switching)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    for app in apps:  # what each app kept, closed
        app.pool.force_close_all()
    dropped = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not dropped, dropped


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300)
    | st.text(alphabet="abcXYZ019_-", max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=8,
)  # fmt: skip


@given(
    kwargs=st.dictionaries(
        st.text(alphabet="abc_-XY09", max_size=12) | st.text(max_size=4), _values
    ),
    maxsize=st.sampled_from([8, 64, 1024, 4096]),
    maxlevels=st.integers(0, 4),
)
def test_the_kwargsrepr_of_a_lean_turn_is_what_saferepr_writes(
    kwargs: dict[str, Any], maxsize: int, maxlevels: int
) -> None:
    assert _kwargsrepr(kwargs, maxsize, maxlevels) == saferepr(kwargs, maxsize, maxlevels=maxlevels)
