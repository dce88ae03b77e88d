"""Mutation testing of the safety-critical modules: does the suite notice a single bug?

    python -m bench.mutants                      # every mutant, one at a time
    python -m bench.mutants --only T1 S2         # some of them
    python -m bench.mutants --tests-rev HEAD~3   # the same mutants against an older suite
    python -m bench.mutants --check              # is every snippet still in the source?
    python -m bench.mutants --only T4 -k each_step   # which test of a selection kills it
    python -m bench.mutants --changed            # the mutants of the modules this branch changed
    python -m bench.mutants --changed --base HEAD~1  # ... of the last commit and the working tree

Each mutant is one hand-made bug: a file, a snippet that must occur exactly once
in it, its replacement, and the tests that should notice. For each, the tree is
copied to a temporary directory (the working tree is never touched), the snippet
replaced, and the tests run with ``pytest -x`` under a timeout. A mutant is
*killed* when a test fails (or the run hangs past the timeout), and *survives*
when every selected test passes. The script prints each verdict with the first
test that failed, the score, and the survivors with the reason they are judged
harmless (``harmless=``) or ``UNEXPECTED``.

``--tests-rev REV`` replaces the copy's ``tests/`` with the one at git revision
REV and runs each mutant's test *files* (not its ``-k`` selection, whose names an
older suite may not have), skipping files REV did not have: the score of the old
suite on the same mutants. It is CPU-heavy (a pytest start per mutant): not part
of ``.ci/run``; ``tests/test_mutants.py`` only checks that the list still applies.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from bench.mutant_list import MUTANTS, Mutant

__all__ = ["MUTANTS", "Mutant", "changed_files", "check", "main"]

ROOT = Path(__file__).resolve().parents[1]

COPIED = ("runtime", "runtime_io", "store", "tasks", "worker", "examples", "tests", "bench")
"""What a mutant's tree holds (with pyproject.toml): the code, its tests, its examples."""
MUTATED = ("runtime/", "store/", "tasks/")
"""Where the mutated modules live: a changed module here with no mutant is named."""
NOT_MUTATED = ("store/conformance/",)
"""Test code shipped with the stores: the mutants' judge, not their subject."""


def changed_files(base: str, root: Path = ROOT) -> set[str]:
    """Files a change touched: committed since it left ``base``, staged, in the working
    tree, or new and not ignored (paths relative to the repository)."""

    def git(*args: str) -> list[str]:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
        return [line for line in done.stdout.splitlines() if line]

    fork = git("merge-base", base, "HEAD")[0]
    return set(git("diff", "--name-only", fork)) | set(
        git("ls-files", "--others", "--exclude-standard")
    )


def _of_changed(chosen: list[Mutant], base: str) -> list[Mutant]:
    """The mutants of the modules changed since ``base``; names changed modules with none."""
    touched = changed_files(base)
    mine = [m for m in chosen if m.path in touched]
    mutated = {m.path for m in MUTANTS}
    bare = sorted(
        p for p in touched
        if p.startswith(MUTATED) and not p.startswith(NOT_MUTATED) and p not in mutated
        and p.endswith((".py", ".lua"))
    )  # fmt: skip
    print(f"changed since {base}: {len(touched)} files, {len(mine)} mutants of them")
    if bare:
        print("changed modules with no mutant (add one for each promise they keep):")
        print("  " + "\n  ".join(bare))
    return mine


def check(mutants: tuple[Mutant, ...] = MUTANTS, root: Path = ROOT) -> list[str]:
    """Problems that make a mutant inapplicable: a snippet not found exactly once, a test
    file that is gone, a duplicate id. Empty when the list still fits the source."""
    problems = []
    seen: set[str] = set()
    for m in mutants:
        if m.id in seen:
            problems.append(f"{m.id}: duplicate id")
        seen.add(m.id)
        source = (root / m.path).read_text(encoding="utf-8")
        found = source.count(m.old)
        if found != 1:
            problems.append(f"{m.id}: {m.path} holds its snippet {found} times, not once")
        if m.old == m.new:
            problems.append(f"{m.id}: the replacement is the snippet itself")
        problems += [f"{m.id}: no test file {t}" for t in m.tests if not (root / t).is_file()]
    return problems


def _copy_tree(into: Path, tests_from: Path | None) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ratchet")
    for name in COPIED:
        source = tests_from if name == "tests" and tests_from is not None else ROOT / name
        shutil.copytree(source, into / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", into / "pyproject.toml")


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        match = re.match(r"^(FAILED|ERROR) (\S+)", line)
        if match:
            return match.group(2)
    return "(no test named; see --verbose)"


@dataclass(frozen=True)
class Verdict:
    mutant: Mutant
    killed: bool
    by: str
    seconds: float
    output: str


def run_one(
    m: Mutant, timeout_s: float, tests_from: Path | None, broad: bool, keep: bool
) -> Verdict:
    """Apply ``m`` in a fresh copy of the tree, run its tests there, judge it."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"ratchet-mutant-{m.id}-"))
    try:
        _copy_tree(work, tests_from)
        target = work / m.path
        source = target.read_text(encoding="utf-8")
        if source.count(m.old) != 1:
            raise SystemExit(f"{m.id}: snippet not found exactly once in {m.path}; --check")
        target.write_text(source.replace(m.old, m.new), encoding="utf-8")
        tests = [t for t in m.tests if (work / t).is_file()]
        if not tests:
            return Verdict(m, False, "(no test files)", time.monotonic() - started, "")
        # One process: a mutant stops at its first failing test (-x), and xdist would start two.
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:randomly"]
        command += ["-n", "0"]
        command += tests
        if m.k and not broad:
            command += ["-k", m.k]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("RATCHET_FAILPOINT", None)
        try:
            done = subprocess.run(
                command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return Verdict(m, True, f"(timed out after {timeout_s:g} s)", timeout_s, "")
        output = done.stdout + done.stderr
        seconds = time.monotonic() - started
        if done.returncode == 0:
            return Verdict(m, False, "", seconds, output)
        if done.returncode == 5:
            return Verdict(m, False, "(no tests selected)", seconds, output)
        return Verdict(m, True, _first_failure(output), seconds, output)
    finally:
        if keep:
            print(f"  kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _baseline(
    chosen: list[Mutant], timeout_s: float, tests_from: Path | None, broad: bool
) -> list[Verdict]:
    """Each distinct test selection run on the unmutated tree; the ones that fail."""
    selections = {(m.tests, None if broad else m.k) for m in chosen}
    failing = []
    for tests, k in sorted(selections, key=repr):
        # A snippet replaced by itself: the tree as it is.
        identity = Mutant("base", chosen[0].path, chosen[0].old, chosen[0].old, tests, k)
        verdict = run_one(identity, timeout_s, tests_from, broad, keep=False)
        print(f"baseline {'FAILS' if verdict.killed else 'passes'}: {' '.join(tests)} -k {k!r}")
        if verdict.killed:
            failing.append(verdict)
    return failing


def _old_tests(rev: str, into: Path) -> Path:
    """The ``tests/`` directory as it was at git revision ``rev``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "tests"], capture_output=True, check=True
    )
    subprocess.run(["tar", "x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "tests"


def _report(verdicts: list[Verdict]) -> None:
    killed = sum(v.killed for v in verdicts)
    print(f"\nscore: {killed}/{len(verdicts)} killed ({100 * killed / max(1, len(verdicts)):.0f}%)")
    survivors = [v for v in verdicts if not v.killed]
    if survivors:
        print("survivors:")
    for v in survivors:
        m = v.mutant
        note = f"harmless: {m.harmless}" if m.harmless else "UNEXPECTED"
        print(f"  {m.id} {m.path}: {m.old.strip()!r} -> {m.new.strip()!r}\n      {note}")


def _chosen(args: argparse.Namespace) -> list[Mutant]:
    """The mutants the arguments name (--only, --changed), with their -k and files."""
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.changed:
        chosen = _of_changed(chosen, args.base)
    if args.k:
        chosen = [replace(m, k=args.k) for m in chosen]
    if args.files:
        chosen = [replace(m, tests=tuple(args.files), k=None) for m in chosen]
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant ids to run (default: all)")
    parser.add_argument("--check", action="store_true", help="only check the list applies")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--tests-rev", help="run against tests/ as of this git revision")
    parser.add_argument(
        "--files", nargs="*", help="run these test files instead of each mutant's (and no -k)"
    )
    parser.add_argument("-k", dest="k", help="run this -k expression instead of each mutant's")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--verbose", action="store_true", help="print pytest's output too")
    parser.add_argument("--keep", action="store_true", help="keep each mutant's tree")
    parser.add_argument(
        "--baseline", action="store_true", help="first run each selection unmutated: must pass"
    )
    parser.add_argument(
        "--changed", action="store_true", help="only the mutants of modules changed since --base"
    )
    parser.add_argument("--base", default="main", help="with --changed: compare with (main)")
    args = parser.parse_args(argv)
    started = time.monotonic()

    problems = check()
    if problems:
        print("the mutant list no longer fits the source:\n  " + "\n  ".join(problems))
        return 2
    if args.check:
        print(f"{len(MUTANTS)} mutants, each snippet found exactly once")
        return 0
    chosen = _chosen(args)
    if not chosen:
        return 0
    if args.list:
        for m in chosen:
            print(f"{m.id:4} {m.path}: {m.old.strip()!r} -> {m.new.strip()!r}")
        return 0
    with tempfile.TemporaryDirectory(prefix="ratchet-old-tests-") as old:
        tests_from = _old_tests(args.tests_rev, Path(old)) if args.tests_rev else None
        suite = f"tests/ at {args.tests_rev}" if args.tests_rev else "tests/ of the working tree"
        print(f"{len(chosen)} mutants against {suite}, {args.jobs} at a time")
        broad = tests_from is not None
        if args.baseline:
            failing = _baseline(chosen, args.timeout, tests_from, broad)
            if failing:
                print("these selections fail without any mutant; fix them first:")
                for v in failing:
                    print(f"  {' '.join(v.mutant.tests)} -k {v.mutant.k!r}: {v.by}")
                return 2

        def judge(m: Mutant) -> Verdict:
            verdict = run_one(m, args.timeout, tests_from, broad, args.keep)
            word = "killed  " if verdict.killed else "SURVIVED"
            print(f"{word} {m.id:4} {m.path:28} {verdict.seconds:6.1f} s  {verdict.by}", flush=True)
            if args.verbose:
                print(verdict.output)
            return verdict

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            verdicts = list(pool.map(judge, chosen))
    _report(verdicts)
    print(f"{len(verdicts)} mutants in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
