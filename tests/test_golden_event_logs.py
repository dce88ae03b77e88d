"""The past stays readable: every event log an earlier build wrote still folds to its run.

``tests/golden/events/`` holds logs recorded from real runs
(``python -m tests.golden.make_event_logs``), each beside the snapshot document
of the state it folded to when it was recorded. Files are only ever added: a
change that can no longer fold an old log, or folds it to another state, fails
here instead of on an operator's run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.fsm import FOLDS, INFORMATIONAL_EVENTS, rebuild
from runtime.models import Event
from store.snapshots import format as snapshot_format

EVENTS = Path(__file__).parent / "golden" / "events"
LOGS = sorted(EVENTS.glob("*.jsonl"))


def read_log(path: Path) -> list[Event]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Event.model_validate(json.loads(line)) for line in lines if line]


def test_the_golden_logs_hold_every_event_type_this_build_can_write() -> None:
    # Given every event type the fold knows (a new type needs a new golden log)
    known = set(FOLDS) | INFORMATIONAL_EVENTS | {"run.created"}
    # When the golden logs are read
    recorded = {event.type for path in LOGS for event in read_log(path)}
    # Then each type appears in at least one of them, and none is unknown
    assert known - recorded == set(), "record a golden log: python -m tests.golden.make_event_logs"
    assert recorded - known == set(), "an event type was dropped from the fold: old logs need it"


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_a_golden_log_folds_to_the_state_it_was_recorded_with(path: Path) -> None:
    # Given a log an earlier build wrote, and the state it folded to then
    events = read_log(path)
    expected = snapshot_format.decode(
        path.with_suffix(".state.json").read_bytes(), path.with_suffix(".state.json").name
    )
    # When this build folds it
    state = rebuild(events)
    # Then it is the same run, in the same state, at the same seq
    assert state is not None
    assert state == expected
    assert state.seq == events[-1].seq


def test_every_prefix_of_a_golden_log_folds() -> None:
    # A log cut short by a crash at any event is still a run the sweeper can resume.
    for path in LOGS:
        events = read_log(path)
        for end in range(1, len(events) + 1):
            state = rebuild(events[:end])
            assert state is not None and state.seq == events[end - 1].seq, (path.name, end)


def test_there_are_golden_logs_to_read() -> None:
    # A glob that found nothing would make the parametrised test above vanish silently.
    assert len(LOGS) >= 9
