"""The conformance suites as a third party uses them: a test file of its own, outside
this repository's tests, subclassing the contract classes of ``store.conformance`` for
its backends (tests/third_party_stores.py), run by pytest in a subprocess.

A backend that offers nothing optional passes, the capabilities it lacks skipped with
their reasons in the report; each broken backend fails, on the tests that name its
defect.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import store.conformance as conformance
from store.conformance.capabilities import (
    APPENDS_TRANSCRIPT,
    COMBINED_COMMIT,
    ONE_CALL_LOAD,
    capabilities,
)
from store.runs.redis import RedisRunStore
from store.snapshots.file import FileSnapshotStore
from tests.third_party_stores import (
    HalfClaimRunStore,
    PlainRunStore,
    PlainSnapshotStore,
    TornCommitRunStore,
)

ROOT = Path(__file__).resolve().parents[1]

THIRD_PARTY_TESTS = """
import pytest

from store.conformance import (
    FakeClock,
    LimitStoreContract,
    LivenessContract,
    RunStoreContract,
    SnapshotStoreContract,
    TransitionContract,
)
from store.limits.memory import MemoryLimitStore
from store.snapshots.file import FileSnapshotStore
from tests.third_party_stores import PlainSnapshotStore, {run_store}


class TestMyRunStore(RunStoreContract, LivenessContract, TransitionContract):
    @pytest.fixture
    def run_store(self, clock: FakeClock):
        store = {run_store}(clock=clock)
        yield store
        store.close()

    @pytest.fixture
    def snapshot_store(self, tmp_path):
        store = {snapshot_store}
        yield store
        store.close()


class TestMySnapshotStore(SnapshotStoreContract):
    @pytest.fixture
    def snapshot_store(self):
        store = PlainSnapshotStore()
        yield store
        store.close()


class TestMyLimitStore(LimitStoreContract):
    @pytest.fixture
    def limit_store(self):
        return MemoryLimitStore()
"""


def run_suite(
    tmp_path: Path,
    run_store: str,
    snapshot_store: str = "PlainSnapshotStore()",
    options: tuple[str, ...] = ("-rfEs",),
) -> subprocess.CompletedProcess[str]:
    """pytest on a third party's test file: its own directory and configuration, none of ours."""
    project = tmp_path / "their-project"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_my_stores.py").write_text(
        THIRD_PARTY_TESTS.format(run_store=run_store, snapshot_store=snapshot_store)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:celery",
            *options,
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def plain_backend_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """The suites on a backend offering nothing optional, with ``-rs`` and the plugin.

    One run for the two tests below (each run of the suites is about 7 s): ``-rs`` lists
    the skips in pytest's short summary, the plugin sums them up in a section of its own
    before it, and each test reads only its own part of the report.
    """
    return run_suite(
        tmp_path_factory.mktemp("plain"),
        "PlainRunStore",
        options=("-rfEs", "-p", "store.conformance.plugin"),
    )


def section(report: str, title: str) -> list[str]:
    """The lines of the report's section ``title``, up to the next ``=====`` line."""
    after = report.split(f" {title} ", 1)[1].splitlines()[1:]
    return list(itertools.takewhile(lambda line: not line.startswith("="), after))


@pytest.mark.timeout(300)
def test_a_backend_offering_nothing_optional_passes_with_each_missing_capability_named(
    plain_backend_run: subprocess.CompletedProcess[str],
) -> None:
    done = plain_backend_run

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and " skipped" in summary and "failed" not in summary
    # Each skip says which capability, and what the backend would have to override
    # (in pytest's own list of skips, not the plugin's sum)
    skips = "\n".join(section(done.stdout, "short test summary info"))
    assert (
        "PlainRunStore does not offer `combined_commit` (a transition's events, snapshot and "
        "lease release in one atomic call): it overrides none of RunStore.commits_with, "
        "RunStore._commit"
    ) in skips
    assert "PlainSnapshotStore does not offer `appends_transcript`" in skips
    assert "PlainRunStore does not offer `one_call_load`" in skips
    assert "the harness offers no `quarantined`" in skips


@pytest.mark.timeout(300)
def test_the_plugin_sums_up_what_was_not_offered_after_the_run(
    plain_backend_run: subprocess.CompletedProcess[str],
) -> None:
    done = plain_backend_run

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    lines = [
        line.split()
        for line in section(done.stdout, "ratchet store conformance: not offered, so not tested")
    ]
    assert [(words[0], words[1], words[2]) for words in lines] == [
        ("1", "skipped", "PlainRunStore"),
        ("1", "skipped", "PlainRunStore"),
        ("1", "skipped", "PlainSnapshotStore"),
        ("1", "skipped", "the"),
    ], done.stdout[-4000:]


BROKEN = {
    # Claims the combined commit and breaks it: its events land though the snapshot is refused
    "TornCommitRunStore": [
        "test_a_snapshot_behind_its_compare_and_set_refuses_the_whole_transition"
    ],
    # Half a capability: every combined transition fails, and so does the consistency test
    "HalfClaimRunStore": [
        "test_the_combined_commit_is_claimed_whole_or_not_at_all",
        "test_a_transition_writes_its_events_record_and_snapshot",
    ],
    # A required promise broken: a lease is still held at the millisecond it expires
    "LateFenceRunStore": [
        "test_an_append_by_a_worker_without_the_lease_is_refused_and_writes_nothing[expired-own-lease]"
    ],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run_store", list(BROKEN))
def test_a_broken_backend_fails_the_suite_on_the_tests_of_its_defect(
    tmp_path: Path, run_store: str
) -> None:
    # (A combined commit writes the transcript's new messages: beside an appending store.)
    combined = run_store == "TornCommitRunStore"
    done = run_suite(
        tmp_path, run_store, "FileSnapshotStore(tmp_path)" if combined else "PlainSnapshotStore()"
    )

    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    for name in BROKEN[run_store]:
        assert any(f"::{name}" in line for line in failed), (name, failed)
    # Only the run store is broken: the snapshot and limit suites still pass
    assert not any("TestMySnapshotStore" in line or "TestMyLimitStore" in line for line in failed)


def test_capabilities_are_read_from_what_a_backend_overrides() -> None:
    assert capabilities(PlainRunStore()) == {
        "combined_commit": False,
        "batch_renew": False,
        "one_call_acquire": False,
        "one_call_load": False,
    }
    assert capabilities(PlainSnapshotStore()) == {
        "appends_transcript": False,
        "incremental_load": False,
    }
    assert capabilities(TornCommitRunStore())["combined_commit"]
    assert COMBINED_COMMIT.half_claimed(TornCommitRunStore()) is None
    assert COMBINED_COMMIT.half_claimed(HalfClaimRunStore()) == (
        "HalfClaimRunStore claims `combined_commit` but does not override _commit"
    )
    assert COMBINED_COMMIT.overridden(RedisRunStore) == ("commits_with", "_commit")
    assert ONE_CALL_LOAD.overridden(RedisRunStore) == ("reads_with", "_acquire_and_read")
    assert APPENDS_TRANSCRIPT.overridden(FileSnapshotStore) == ("_put_parts", "_read_tip", "_read")


def test_the_contract_classes_share_no_test_name_so_one_class_may_inherit_several() -> None:
    # A name in two contracts would run only one of them in a class that inherits both.
    seen: dict[str, str] = {}
    for contract in (
        conformance.RunStoreContract,
        conformance.LivenessContract,
        conformance.SnapshotStoreContract,
        conformance.TransitionContract,
        conformance.LimitStoreContract,
    ):
        for name in vars(contract):
            if name.startswith("test_"):
                assert name not in seen, f"{name} in {seen[name]} and {contract.__name__}"
                seen[name] = contract.__name__
