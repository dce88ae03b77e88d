"""Backends as a third party might write them, for tests/test_conformance.py to run the
conformance suites (store/conformance/) on: one that offers nothing optional, and
three that are broken in ways the suites must catch."""

from __future__ import annotations

import builtins

from runtime.models import Event
from store.runs import RunRecord, Transition
from store.runs.memory import MemoryRunStore
from store.snapshots import SnapshotStore
from store.snapshots.file import FileSnapshotStore
from store.snapshots.memory import MemorySnapshotStore


class PlainRunStore(MemoryRunStore):
    """The contract's required primitives only: no combined commit, no batch renewal."""

    name = "plain run store"


class PlainSnapshotStore(MemorySnapshotStore):
    """Whole documents only: no appended transcripts."""

    name = "plain snapshot store"


class LateFenceRunStore(PlainRunStore):
    """Broken: lets the holder of a lease write at the very millisecond it expires."""

    def _append(
        self, record: RunRecord, events: builtins.list[Event], owner: str | None, now_ms: int
    ) -> None:
        # Compares the lease's expiry with a clock read a millisecond early.
        super()._append(record, events, owner, now_ms - 1)


class TornCommitRunStore(PlainRunStore):
    """Broken: claims the combined commit, but writes the events before the snapshot's
    compare-and-set can refuse the transition."""

    def commits_with(self, snapshots: SnapshotStore) -> bool:
        return isinstance(snapshots, FileSnapshotStore)

    def _commit(self, whole: Transition, now_ms: int) -> None:
        self._append(whole.record, whole.events, whole.owner, now_ms)
        if whole.parts is None:  # a finishing transition: the snapshot goes
            whole.snapshots._delete(whole.record.run_id)
        else:
            whole.snapshots._put_parts(whole.record.run_id, whole.parts, whole.expected_seq)
        if whole.release and whole.owner is not None:
            self._release(whole.record.run_id, whole.owner)


class HalfClaimRunStore(PlainRunStore):
    """Broken: says it commits with any snapshot store, and never implemented how."""

    def commits_with(self, snapshots: SnapshotStore) -> bool:
        return True
