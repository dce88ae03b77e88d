"""The RunStore liveness contract (:mod:`store.conformance.liveness`) on every backend:
memory, sqlite, redis (the ``run_store`` fixture, tests/contract/conftest.py)."""

from __future__ import annotations

from store.conformance import LivenessContract
from store.runs import owner_process


class TestLiveness(LivenessContract):
    """Every test of the contract, once per backend of the ``run_store`` fixture."""


def test_an_owner_id_names_its_process_before_the_last_slash() -> None:
    assert owner_process("host:12:ab/9f3") == "host:12:ab"
    assert owner_process("worker-a") is None
    assert owner_process("/x") is None
    assert owner_process("host:1:t/") is None
