"""An ending has one rule: the record a run ended without its state gets is the record of
the state the same events fold to (runtime/endings.py). Pure: no store, no clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.continuation import cancelled_event_data
from runtime.endings import ENDINGS, ending
from runtime.fsm import apply, rebuild
from runtime.models import RunState
from runtime.recovery import due_after_ms
from store.runs import RunRecord
from tests.conftest import examples
from tests.test_golden_event_logs import LOGS, read_log

LEASE_MS, LEAD_MS = 60_000, 2_000


def unended_states() -> list[RunState]:
    """Every state a golden log passes through that an ending may still end: live,
    suspended (on a person, a timer or a child) or parked; a child among them."""
    found = []
    for path in LOGS:
        events = read_log(path)
        for end in range(1, len(events) + 1):
            state = rebuild(events[:end])
            assert state is not None
            if not state.status.is_terminal:
                found.append(state)
    return found


STATES = unended_states()


def test_the_states_cover_children_and_suspensions() -> None:
    assert any(s.parent is not None for s in STATES)
    assert any(s.status.is_suspended for s in STATES)
    assert any(s.status.is_live for s in STATES)


@settings(max_examples=examples(150))
@given(
    state=st.sampled_from(STATES),
    kind=st.sampled_from(sorted(ENDINGS)),
    reason=st.none() | st.text(min_size=1, max_size=20),
    later_ms=st.integers(0, 10**9),
    a_child=st.booleans(),
    tells_parent=st.booleans(),
)
def test_the_record_an_ending_writes_is_the_record_of_the_state_its_events_fold_to(
    state: RunState,
    kind: str,
    reason: str | None,
    later_ms: int,
    a_child: bool,
    tells_parent: bool,
) -> None:
    if a_child and state.parent is None:
        state = state.model_copy(update={"parent": "parent-run"})
    # Given a run's record, as the last write before the ending left it
    record = RunRecord.from_state(state, state.created_at_ms, None)
    now = state.created_at_ms + later_ms
    # When it is ended from that record alone, as a cancel or a lost state's dead letter is
    if kind == "run.cancelled":
        data = cancelled_event_data(record.status, record.suspension, reason or "", now)
    else:
        data = {} if reason is None else {"reason": reason, "output": reason}
    is_child = state.parent is not None
    parent_ended = state.parent if is_child and tells_parent else None
    end = ending(
        kind,
        data,
        last_seq=record.last_seq,
        now_ms=now,
        suspended_ms=record.suspended_ms,
        suspension=record.suspension,
        is_child=is_child,
        parent_ended=parent_ended,
    )
    written = record.model_copy(update=end.record_changes)
    # Then folding the same events onto the state gives the record that was written
    folded = state
    for event in end.events:
        folded = apply(folded, event)
    due = due_after_ms(folded, end.events[-1], now, LEASE_MS, LEAD_MS)
    assert written == RunRecord.from_state(folded, now, due)
    assert folded.status == ENDINGS[kind] == written.status
    assert folded.parent_told == (parent_ended is not None or state.parent_told)
