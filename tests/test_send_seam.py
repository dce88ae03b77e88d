"""What tasks/broker/next_turn.py, the send path's seam, assumes of Celery is still so.

Read from the installed Celery itself, so an upgrade that moves what the seam relies on
fails here, naming it, before a message is sent otherwise.
"""

from __future__ import annotations

import inspect

from celery.app.amqp import AMQP

from tasks.broker.next_turn import SENT_EVENT_AT, without_sent_event


def test_create_sent_event_is_where_the_seam_puts_it_among_as_task_v2s_arguments() -> None:
    parameters = list(inspect.signature(AMQP.as_task_v2).parameters)
    # (self, task_id, name, then the arguments send_task passes by position)
    assert parameters[3 + SENT_EVENT_AT] == "create_sent_event"


def test_no_sent_event_is_asked_for_by_position_or_by_keyword() -> None:
    by_position = tuple(range(SENT_EVENT_AT + 2))
    args, kwargs = without_sent_event(by_position, {})
    assert args[SENT_EVENT_AT] is False and len(args) == len(by_position) and kwargs == {}
    args, kwargs = without_sent_event((1, 2), {"x": 1})
    assert args == (1, 2) and kwargs == {"x": 1, "create_sent_event": False}
