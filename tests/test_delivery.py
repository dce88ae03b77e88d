"""The one table of broker and queue settings (tasks/delivery.py), as a team's app gets it."""

from __future__ import annotations

import pytest
from celery import Celery

import tasks
from tasks import messages
from tasks.delivery import delivery_refusal, redis_lists
from tasks.limits import first_turn_priority
from tasks.settings import Settings
from tests.helpers import memory_context
from tests.workers import EXAMPLE_AGENT
from worker.app import make_app


@pytest.fixture
def restored_sending_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """install makes the app the one ratchet sends through: the session's again after."""
    monkeypatch.setattr(messages, "_sending_app", messages._sending_app)


@pytest.mark.parametrize("broker", ["redis://127.0.0.1:1/0", "amqp://guest@127.0.0.1:1//"])
def test_a_teams_app_reads_messages_as_ratchets_own_app_does(
    broker: str, restored_sending_app: None
) -> None:
    # Given ratchet's own app and a team's app with ratchet installed, on one broker
    ours = make_app(Settings(broker_url=broker))
    team = Celery("proj", broker=broker, set_as_current=False)
    team.conf.worker_prefetch_multiplier = 4  # Celery's default: not a choice of the team's
    tasks.install(team)
    # Then they declare ratchet's queues alike, route alike and read the same Redis lists
    for name in ("ratchet.turns", "ratchet.control"):
        assert team.amqp.queues[name].queue_arguments == ours.amqp.queues[name].queue_arguments
    for task in ("ratchet.turn", "ratchet.continue", "ratchet.start"):
        assert team.amqp.router.route({}, task) == ours.amqp.router.route({}, task)
    steps = ours.conf.broker_transport_options.get("priority_steps")
    assert team.conf.broker_transport_options.get("priority_steps") == steps
    assert team.conf.worker_prefetch_multiplier == 1
    assert delivery_refusal(team, Settings()) is None
    ours.close()


def test_a_setting_the_team_chose_is_kept_and_refused_naming_it(
    restored_sending_app: None,
) -> None:
    team = Celery("proj", broker="redis://127.0.0.1:1/0", set_as_current=False)
    team.conf.broker_transport_options = {"visibility_timeout": 60}
    tasks.install(team)
    team.conf.worker_prefetch_multiplier = 8  # after install: the team's own
    assert team.conf.broker_transport_options["visibility_timeout"] == 60
    refusal = delivery_refusal(team, Settings())
    assert refusal is not None
    assert "worker_prefetch_multiplier is 8, ratchet needs 1" in refusal
    assert "broker_transport_options['visibility_timeout'] is 60, ratchet needs 3600" in refusal
    # A worker's --prefetch-multiplier 1 wins over the app's
    assert "prefetch" not in str(delivery_refusal(team, Settings(), prefetch_multiplier=1))


def test_turns_are_prioritised_on_the_sending_apps_broker_without_ratchet_broker_url(
    restored_sending_app: None,
) -> None:
    # Given a team's app on Redis, and no RATCHET_BROKER_URL (the app names the broker)
    team = Celery("proj", broker="redis://127.0.0.1:1/0", set_as_current=False)
    tasks.install(team)
    ctx = memory_context()
    # Then a new run's first turn gets Redis's priority (reversed: 9 - 2), not none
    priority = first_turn_priority(ctx, ctx.agent(EXAMPLE_AGENT), None)
    assert priority == 7
    assert redis_lists("ratchet.turns")[priority] == "ratchet.turns\x06\x167"


# --- RabbitMQ quorum queues (RATCHET_TASK_DEFAULT_QUEUE_TYPE) ------------------------

AMQP = "amqp://guest@127.0.0.1:1//"


def test_quorum_queues_are_declared_without_priorities_behind_topic_exchanges() -> None:
    quorum = make_app(Settings(broker_url=AMQP, task_default_queue_type="quorum"))
    classic = make_app(Settings(broker_url=AMQP))
    for name in ("ratchet.turns", "ratchet.control"):
        # RabbitMQ 3.10 refuses x-max-priority on a quorum queue; Celery's native delayed
        # delivery routes only through topic (or fanout) exchanges
        declared = quorum.amqp.queues[name]
        assert declared.queue_arguments == {"x-queue-type": "quorum"}
        assert declared.durable and not declared.auto_delete and not declared.exclusive
        assert declared.exchange.type == "topic"
        # and classic queues are declared as every release did
        assert classic.amqp.queues[name].queue_arguments == {"x-max-priority": 9}
        assert classic.amqp.queues[name].exchange.type == "direct"
    # A queue made on the fly (`-Q`, RATCHET_NOTIFY_QUEUE's) is a quorum queue too
    assert quorum.amqp.queues["team.notify"].queue_arguments == {"x-queue-type": "quorum"}
    assert classic.amqp.queues["team.notify"].queue_arguments == {"x-max-priority": 9}
    quorum.close()
    classic.close()


def test_a_countdown_to_a_quorum_queue_is_whole_seconds_rounded_up() -> None:
    from tasks.queues import whole_seconds_on_quorum

    quorum = make_app(Settings(broker_url=AMQP, task_default_queue_type="quorum"))
    classic = make_app(Settings(broker_url=AMQP))
    # Celery 5.7 refuses a countdown under 1 s to a quorum queue, and cuts others down
    assert whole_seconds_on_quorum(quorum, "ratchet.control", 0.2) == 1.0
    assert whole_seconds_on_quorum(quorum, "ratchet.turns", 2.01) == 3.0
    assert whole_seconds_on_quorum(quorum, "ratchet.turns", 4.0) == 4.0
    assert whole_seconds_on_quorum(classic, "ratchet.turns", 2.01) == 2.01
    quorum.close()
    classic.close()


def test_quorum_queues_on_another_broker_than_rabbitmq_are_refused_naming_both_settings() -> None:
    with pytest.raises(ValueError, match="RATCHET_TASK_DEFAULT_QUEUE_TYPE=quorum is a RabbitMQ"):
        Settings(broker_url="redis://127.0.0.1:1/0", task_default_queue_type="quorum")
    with pytest.raises(ValueError, match="RATCHET_BROKER_URL is a filesystem:// broker"):
        Settings(task_default_queue_type="quorum")
