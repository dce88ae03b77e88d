"""What a backend offers beyond the contract's required primitives, read from its class.

A capability is offered when the backend overrides the contract's default for it
(langgraph's checkpoint conformance detects a checkpointer's the same way). A test of
a capability the backend does not offer is skipped, saying which and why; a test of
one it offers runs, and fails if the backend breaks it. A backend that half-claims a
capability (overrides one of its methods and not the other) fails the consistency test
of its contract class.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from store.runs import RunStore
from store.snapshots import SnapshotStore


@dataclass(frozen=True)
class Capability:
    name: str
    contract: type
    methods: tuple[str, ...]
    """The contract's defaults a backend overrides to offer it."""
    what: str
    """What a backend that offers it promises, for the report."""
    flag: str | None = None
    """A class attribute that switches the contract onto the overrides (True: offered)."""

    def overridden(self, backend: type) -> tuple[str, ...]:
        """Which of ``methods`` ``backend`` overrides."""
        return tuple(
            m for m in self.methods if getattr(backend, m) is not getattr(self.contract, m)
        )

    def offered_by(self, store: object) -> bool:
        """Claimed by ``store``: its flag is set, or it overrides any of the methods (a
        backend that overrides only some claims it too, and fails its tests)."""
        if self.flag is not None and getattr(store, self.flag):
            return True
        return bool(self.overridden(type(store)))

    def half_claimed(self, store: object) -> str | None:
        """What is inconsistent in ``store``'s claim (None: offered whole, or not at all)."""
        overridden = self.overridden(type(store))
        flagged = self.flag is not None and bool(getattr(store, self.flag))
        claimed = bool(overridden) or flagged
        if not claimed:
            return None
        if len(overridden) < len(self.methods):
            left = ", ".join(m for m in self.methods if m not in overridden)
            return f"{type(store).__name__} claims `{self.name}` but does not override {left}"
        if self.flag is not None and not flagged:
            return (
                f"{type(store).__name__} overrides {', '.join(self.methods)} but leaves "
                f"`{self.flag}` False: the contract never calls them"
            )
        return None

    def missing(self, store: object) -> str:
        """Why a test of this capability is skipped for ``store``."""
        methods = ", ".join(f"{self.contract.__name__}.{m}" for m in self.methods)
        return (
            f"{type(store).__name__} does not offer `{self.name}` ({self.what}): it overrides "
            f"none of {methods}"
        )


COMBINED_COMMIT = Capability(
    "combined_commit",
    RunStore,
    ("commits_with", "_commit"),
    "a transition's events, snapshot and lease release in one atomic call",
)
BATCH_RENEW = Capability(
    "batch_renew", RunStore, ("_renew",), "a heartbeat's lease renewals in one round trip"
)
ONE_CALL_ACQUIRE = Capability(
    "one_call_acquire",
    RunStore,
    ("_acquire_and_get",),
    "a turn's lease and record in one call",
)
ONE_CALL_LOAD = Capability(
    "one_call_load",
    RunStore,
    ("reads_with", "_acquire_and_read"),
    "a turn's lease, record and snapshot in one call",
)
APPENDS_TRANSCRIPT = Capability(
    "appends_transcript",
    SnapshotStore,
    ("_put_parts", "_read_tip", "_read"),
    "a save writes only the transcript's new messages",
    flag="appends_transcript",
)
INCREMENTAL_LOAD = Capability(
    "incremental_load",
    SnapshotStore,
    ("_read_after",),
    "a load decodes only the messages after the ones this store last saw",
)

RUN_STORE_CAPABILITIES = (COMBINED_COMMIT, BATCH_RENEW, ONE_CALL_ACQUIRE, ONE_CALL_LOAD)
SNAPSHOT_STORE_CAPABILITIES = (APPENDS_TRANSCRIPT, INCREMENTAL_LOAD)


def capabilities(store: RunStore | SnapshotStore) -> dict[str, bool]:
    """Each capability of ``store``'s contract, and whether ``store`` offers it."""
    known = RUN_STORE_CAPABILITIES if isinstance(store, RunStore) else SNAPSHOT_STORE_CAPABILITIES
    return {c.name: c.offered_by(store) for c in known}


def require(capability: Capability, store: object) -> None:
    """Skip the calling test, saying why, unless ``store`` offers ``capability``."""
    if not capability.offered_by(store):
        pytest.skip(capability.missing(store))
