"""The mutant list of ``bench/mutants.py`` still fits the source it mutates.

Running the mutants is slow and not part of the suite; this keeps the list from
rotting silently when the code it names is rewritten.
"""

from __future__ import annotations

from bench.mutants import MUTANTS, check


def test_every_mutant_snippet_occurs_exactly_once_and_its_tests_exist() -> None:
    assert check() == []


def test_every_mutant_changes_the_source_and_names_its_tests() -> None:
    assert len(MUTANTS) >= 60
    for mutant in MUTANTS:
        assert mutant.old != mutant.new and mutant.tests, mutant.id
