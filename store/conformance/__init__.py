"""The store contracts as test suites a backend anyone writes can run (docs/conformance.md).

Each contract is a class of pytest tests. A test file subclasses it as ``Test…``
beside a fixture that yields a fresh store, and pytest runs every test on it::

    import pytest
    from store.conformance import FakeClock, LivenessContract, RunStoreContract

    class TestMyRunStore(RunStoreContract, LivenessContract):
        @pytest.fixture
        def run_store(self, clock: FakeClock):
            store = MyRunStore(clock=clock)
            yield store
            store.close()

=========================  ======================  =====================================
class                      fixture(s)              contract
=========================  ======================  =====================================
``RunStoreContract``       ``run_store``           records, events, journal, leases, due
                                                   runs, retention
``LivenessContract``       ``run_store``           processes alive or dead, their leases
``SnapshotStoreContract``  ``snapshot_store``      snapshots and their compare-and-set
``TransitionContract``     ``run_store`` and       ``RunStore.commit`` on the pair
                           ``snapshot_store``
``LimitStoreContract``     ``limit_store``         rate limits and concurrency caps
=========================  ======================  =====================================

What a backend offers beyond the required primitives (:mod:`.capabilities`) is read
from what it overrides; a test of a capability it does not offer is skipped saying so
(``pytest -rs`` lists the reasons, and ``-p store.conformance.plugin`` sums them up after
the run), and one it offers and breaks fails.

Needs pytest (``pip install 'ratchet[conformance]'``); nothing here runs in a worker.
"""

from __future__ import annotations

try:
    import pytest  # noqa: F401 - the suites are pytest classes
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(
        "store.conformance runs on pytest: install it with `pip install 'ratchet[conformance]'`"
    ) from exc

from store.conformance.capabilities import Capability, capabilities
from store.conformance.limits import LimitStoreContract
from store.conformance.liveness import LivenessContract
from store.conformance.runs import RunStoreContract
from store.conformance.snapshots import SnapshotStoreContract, SnapshotTransactionContract
from store.conformance.support import T0_MS, FakeClock
from store.conformance.transitions import TransitionContract

__all__ = [
    "T0_MS",
    "Capability",
    "FakeClock",
    "LimitStoreContract",
    "LivenessContract",
    "RunStoreContract",
    "SnapshotStoreContract",
    "SnapshotTransactionContract",
    "TransitionContract",
    "capabilities",
]
