"""Mutation testing of the safety-critical modules: does the suite notice a single bug?

    python -m bench.mutants                      # every mutant, one at a time
    python -m bench.mutants --only T1 S2         # some of them
    python -m bench.mutants --tests-rev HEAD~3   # the same mutants against an older suite
    python -m bench.mutants --check              # is every snippet still in the source?
    python -m bench.mutants --only T4 -k each_step   # which test of a selection kills it

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

ROOT = Path(__file__).resolve().parents[1]

COPIED = ("runtime", "store", "tasks", "worker", "examples", "tests", "bench")
"""What a mutant's tree holds (with pyproject.toml): the code, its tests, its examples."""


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    """Test files to run (pytest paths)."""
    k: str | None = None
    """A pytest ``-k`` expression narrowing ``tests`` (dropped with --tests-rev)."""
    harmless: str | None = None
    """Why it may survive without breaking a promise; None: it must be killed."""


FSM = ("tests/test_fsm.py", "tests/test_turns.py")
CONTINUATION = ("tests/test_continuation.py", "tests/test_fsm.py")
RUNS = ("tests/contract/test_run_store_contract.py",)
SNAPSHOTS = ("tests/contract/test_snapshot_store_contract.py", "tests/test_flat_snapshots.py")
TURN = ("tests/test_turn_guarantees.py", "tests/test_turns.py", "tests/test_recovery.py")
RECOVERY = (
    "tests/test_recovery.py",
    "tests/test_turn_guarantees.py",
    "tests/test_resume_fencing.py",
)
LIVENESS = ("tests/test_liveness.py", "tests/contract/test_liveness_contract.py")
SNAPSHOT_CAS = "compare or afresh or moved or concurrent or stale or chain or remembers or prefix"
SNAPSHOT_CAS_SHORT = "afresh or moved or concurrent or stale or remembers or prefix"

MUTANTS: tuple[Mutant, ...] = (
    # --- runtime/fsm.py: budgets, the deadline, the fold -------------------------
    Mutant(
        "F1",
        "runtime/fsm.py",
        "if u.total_tokens >= b.max_total_tokens:",
        "if u.total_tokens > b.max_total_tokens:",
        FSM,
    ),
    Mutant(
        "F2",
        "runtime/fsm.py",
        "if u.model_attempts >= b.max_turns:",
        "if u.model_attempts > b.max_turns:",
        FSM,
    ),
    Mutant(
        "F3",
        "runtime/fsm.py",
        "if state.usage.tool_calls >= state.budgets.max_tool_calls:",
        "if state.usage.tool_calls > state.budgets.max_tool_calls:",
        FSM,
    ),
    Mutant(
        "F4",
        "runtime/fsm.py",
        "state.budgets.max_tool_calls\n        )\n    _check_deadline(state, now_ms)\n",
        "state.budgets.max_tool_calls\n        )\n",
        FSM,
    ),
    Mutant(
        "F5",
        "runtime/fsm.py",
        "b.max_total_tokens\n            )\n    _check_deadline(state, now_ms)\n",
        "b.max_total_tokens\n            )\n",
        FSM,
    ),
    Mutant(
        "F6",
        "runtime/fsm.py",
        "if now_ms > state.deadline_ms:",
        "if now_ms >= state.deadline_ms:",
        FSM,
    ),
    Mutant(
        "F7",
        "runtime/fsm.py",
        "if event.seq != state.seq + 1:",
        "if event.seq <= state.seq:",
        FSM,
    ),
    Mutant(
        "F8",
        "runtime/fsm.py",
        "        if u.responses_without_usage:\n",
        "        if False:\n",
        FSM,
    ),
    Mutant(
        "F9",
        "runtime/fsm.py",
        '"tool_calls": state.usage.tool_calls + int(counts)',
        '"tool_calls": state.usage.tool_calls + 1',
        FSM,
    ),
    Mutant(
        "F10",
        "runtime/fsm.py",
        'attempt too."""\n    usage = state.usage.model_copy(update={"model_attempts": '
        "state.usage.model_attempts + 1})",
        'attempt too."""\n    usage = state.usage.model_copy(update={"model_attempts": '
        "state.usage.model_attempts})",
        FSM,
    ),
    Mutant(
        "F11",
        "runtime/fsm.py",
        "if call.name in agent.spec.policy.require_approval and call.id not in state.approved:",
        "if False:",
        FSM + ("tests/test_continuation.py",),
        k="approv",
    ),
    Mutant(
        "F12",
        "runtime/fsm.py",
        '    if d.get("approved"):\n',
        "    if True:\n",
        ("tests/test_continuation.py",),
        k="approv or denied",
    ),
    Mutant(
        "F13",
        "runtime/fsm.py",
        "    if not response.tool_calls:\n",
        "    if False:\n",
        FSM,
    ),
    Mutant(
        "F14",
        "runtime/fsm.py",
        '            "running": tuple(c for c in state.running if c != call_id),\n'
        '            "usage": usage,\n',
        '            "usage": usage,\n',
        ("tests/test_fsm.py", "tests/test_recovery.py", "tests/test_recovery_rebuild.py"),
    ),
    Mutant(
        "F15",
        "runtime/fsm.py",
        '"suspended_ms": state.suspended_ms + int(d.get("suspended_ms", 0)),',
        '"suspended_ms": state.suspended_ms,',
        CONTINUATION,
    ),
    Mutant(
        "F16",
        "runtime/fsm.py",
        'update={"running": tuple(c for c in state.running if c != d["call_id"])}',
        'update={"running": state.running}',
        ("tests/test_recovery.py",),
        k="reconcil",
    ),
    Mutant(
        "F17",
        "runtime/fsm.py",
        "    if not state.status.is_live:\n        return Idle(",
        "    if state.status.is_terminal:\n        return Idle(",
        FSM,
    ),
    # --- runtime/fsm.py and runtime/probes.py: probes and parallel calls ------------
    Mutant(
        "P1",
        "runtime/fsm.py",
        '    if d["answer"] == Answer.RAN.value:\n',
        "    if True:\n",
        ("tests/test_probes.py", "tests/test_golden_event_logs.py"),
    ),
    Mutant(
        "P2",
        "runtime/actions.py",
        "    for results in _RESULTS.finditer(roles):\n",
        '    for results in _RESULTS.finditer(""):\n',
        ("tests/test_parallel_tools.py",),
    ),
    Mutant(
        "P3",
        "runtime/fsm.py",
        "        agent.spec.max_parallel_tools,\n",
        "        99,\n",
        ("tests/test_parallel_tools.py",),
    ),
    Mutant(
        "P4",
        "runtime/probes.py",
        "    if idempotent:\n        return Rule.RERUN\n",
        "    if idempotent or has_probe:\n        return Rule.RERUN\n",
        ("tests/test_probes.py", "tests/test_golden_event_logs.py"),
    ),
    # --- runtime/continuation.py: what answers a suspension ----------------------
    Mutant(
        "C1",
        "runtime/continuation.py",
        "if approval and continuation.input is not None:",
        "if False:",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C2",
        "runtime/continuation.py",
        "if not approval and continuation.input is None:",
        "if False:",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C3",
        "runtime/continuation.py",
        "if asked is not None and asked != suspension.seq:",
        "if False:",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C4",
        "runtime/continuation.py",
        "        if recorded != continuation.answer:\n",
        "        if False:\n",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C5",
        "runtime/continuation.py",
        "    if isinstance(action, Fail):\n",
        "    if False:\n",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C6",
        "runtime/continuation.py",
        "    if agent.binding != state.binding:\n",
        "    if False:\n",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C7",
        "runtime/continuation.py",
        "    if size > MAX_INPUT_BYTES:\n",
        "    if size > MAX_INPUT_BYTES + 1:\n",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C8",
        "runtime/continuation.py",
        "    if not value.strip():\n",
        "    if False:\n",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C9",
        "runtime/continuation.py",
        "    if waited_ms <= max_suspended_s * 1000:\n",
        "    if waited_ms < max_suspended_s * 1000:\n",
        ("tests/test_continuation.py",),
    ),
    Mutant(
        "C10",
        "runtime/continuation.py",
        "    if suspension is None or not state.status.is_suspended:\n",
        "    if suspension is None:\n",
        ("tests/test_continuation.py",),
    ),
    # --- store/runs: the event log's fences, on every backend --------------------
    Mutant(
        "R1",
        "store/runs/__init__.py",
        "        if after.seq != before.seq + 1:\n",
        "        if False:\n",
        RUNS,
    ),
    Mutant(
        "R2",
        "store/runs/__init__.py",
        "    if record.last_seq != events[-1].seq:\n",
        "    if False:\n",
        RUNS,
    ),
    Mutant(
        "R3",
        "store/runs/__init__.py",
        "self._events(exc.run_id, mine[0].seq - 1, len(mine)) == mine",
        "self._events(exc.run_id, mine[0].seq, len(mine)) == mine",
        RUNS,
    ),
    Mutant(
        "R4",
        "store/runs/__init__.py",
        "return exc.found_seq == mine[-1].seq and (",
        "return (",
        RUNS,
    ),
    Mutant(
        "R5",
        "store/runs/__init__.py",
        "            if self._events(record.run_id, 0, 1) != [first]:\n",
        "            if False:\n",
        RUNS,
    ),
    Mutant(
        "R6",
        "store/runs/__init__.py",
        '"status": "completed" if done else "failed",',
        '"status": "completed",',
        RUNS,
    ),
    Mutant(
        "Q1",
        "store/runs/sqlite.py",
        'transaction(self._connection, f"run store {self.path}", "IMMEDIATE")',
        'transaction(self._connection, f"run store {self.path}", "DEFERRED")',
        RUNS,
        k="sqlite",
    ),
    Mutant(
        "Q5",
        "store/snapshots/sqlite.py",
        "    if found != expected_seq:\n        raise StaleWrite(run_id, expected_seq, found)\n",
        "",
        SNAPSHOTS + ("tests/contract/test_transition_contract.py",),
        k="sqlite",
    ),
    Mutant(
        "Q6",
        "store/runs/sqlite.py",
        "            if whole.release and owner is not None:\n                conn.execute(",
        "            if False:\n                conn.execute(",
        ("tests/contract/test_transition_contract.py",),
        k="sqlite",
    ),
    Mutant(
        "Q7",
        "store/snapshots/sqlite.py",
        "        if row[1] is None or TranscriptTip(row[1], row[2], row[3]) != base:\n",
        "        if row[1] is None:\n",
        SNAPSHOTS + ("tests/contract/test_transition_contract.py",),
        k="sqlite",
    ),
    Mutant(
        "Q2",
        "store/runs/sqlite.py",
        "        if found != events[0].seq - 1:\n",
        "        if found is None:\n",
        RUNS,
        k="sqlite",
    ),
    Mutant(
        "Q3",
        "store/runs/sqlite.py",
        "if lease is None or lease[0] != owner or lease[1] <= now_ms:",
        "if lease is None or lease[0] != owner:",
        RUNS,
        k="sqlite",
    ),
    Mutant(
        "Q4",
        "store/runs/sqlite.py",
        "if row is not None and row[0] != owner and row[1] > now_ms:",
        "if row is not None and row[0] != owner:",
        RUNS,
        k="sqlite",
    ),
    Mutant(
        "M1",
        "store/runs/memory.py",
        "if lease is None or lease.owner != owner or lease.expires_at_ms <= now_ms:",
        "if lease is None or lease.owner != owner or lease.expires_at_ms < now_ms:",
        RUNS,
        k="memory",
    ),
    Mutant(
        "X1",
        "store/runs/lua/append.lua",
        "if rec[1] ~= expected then",
        "if false then",
        RUNS,
        k="redis",
    ),
    Mutant(
        "X2",
        "store/runs/lua/append.lua",
        "if lease[1] ~= owner or tonumber(lease[2]) <= tonumber(now_ms) then",
        "if lease[1] ~= owner then",
        RUNS,
        k="redis",
    ),
    Mutant(
        "X3",
        "store/runs/lua/append.lua",
        "  if stored_seq ~= snapshot_seq then",
        "  if false then",
        ("tests/contract/test_transition_contract.py",),
    ),
    Mutant(
        "X4",
        "store/runs/lua/append.lua",
        "if release == '1' and (",
        "if release == '0' and (",
        ("tests/contract/test_transition_contract.py",),
    ),
    Mutant(
        "X5",
        "store/runs/lua/append.lua",
        "  push(KEYS[9], events_end + 1, fragments_end)",
        "  push(KEYS[9], events_end + 2, fragments_end)",
        ("tests/test_transition_snapshots.py",),
    ),
    Mutant(
        "X6",
        "store/runs/lua/append.lua",
        "  if old == nil or new < old or new > old + slack then",
        "  if old == nil or new > old + slack then",
        ("tests/contract/test_run_store_contract.py",),
        k="redis and (overdue or due)",
    ),
    Mutant(
        "X7",
        "store/runs/redis.py",
        'if due is not None and (due == b"" or int(due) > now_ms):',
        "if False:",
        ("tests/contract/test_run_store_contract.py",),
        k="redis and (overdue or due)",
    ),
    Mutant(
        "X8",
        "store/runs/lua/append.lua",
        "    redis.call('SELECT', own_db)\n",
        "\n",
        ("tests/crash/test_outbox.py",),
        k="last_checkpoint_pushes",
    ),
    # --- store/snapshots/__init__.py: the compare-and-set save --------------------
    Mutant(
        "S1",
        "store/snapshots/__init__.py",
        "if known is not None and known.seq == expected_seq:",
        "if known is not None:",
        SNAPSHOTS,
        k=SNAPSHOT_CAS_SHORT,
    ),
    Mutant(
        "S2",
        "store/snapshots/__init__.py",
        "        raise StaleWrite(run_id, expected_seq, expected_seq)\n",
        "        return\n",
        SNAPSHOTS,
        k=SNAPSHOT_CAS_SHORT,
    ),
    Mutant(
        "S3",
        "store/snapshots/__init__.py",
        "            except TranscriptMoved:\n                self._forget(run_id)\n",
        "            except TranscriptMoved:\n",
        SNAPSHOTS,
        k=SNAPSHOT_CAS_SHORT,
    ),
    Mutant(
        "S4",
        "store/snapshots/__init__.py",
        "base = stored[1] if _chains_to(messages, stored[1]) else None",
        "base = stored[1]",
        SNAPSHOTS,
        k=SNAPSHOT_CAS_SHORT,
    ),
    Mutant(
        "S5",
        "store/snapshots/__init__.py",
        "base = known.tip if _extends(messages, known.transcript) else None",
        "base = known.tip",
        SNAPSHOTS,
        k=SNAPSHOT_CAS_SHORT,
    ),
    Mutant(
        "S6",
        "store/snapshots/__init__.py",
        "if exc.found_seq != state.seq or self._get(run_id) != data:",
        "if exc.found_seq != state.seq:",
        SNAPSHOTS,
        k=SNAPSHOT_CAS,
    ),
    Mutant(
        "S7",
        "store/snapshots/__init__.py",
        "        if size > self.max_bytes:\n",
        "        if size > self.max_bytes + 1:\n",
        SNAPSHOTS,
        k="limit or MiB or size",
    ),
    Mutant(
        "S8",
        "store/snapshots/__init__.py",
        "if exc.found_seq != state.seq or self._get(run_id) != snapshot_format.encode(",
        "if exc.found_seq != state.seq or not snapshot_format.encode(",
        SNAPSHOTS,
        k=SNAPSHOT_CAS,
    ),
    # --- tasks/turn.py: a turn's life -----------------------------------------------
    Mutant(
        "T1",
        "runtime/actions.py",
        "    return TOOL_TIMEOUT_ATTEMPTS if idempotent else 1\n",
        "    return TOOL_TIMEOUT_ATTEMPTS\n",
        TURN,
        k="tool or hung or idempotent",
    ),
    Mutant(
        "T2",
        "tasks/turn.py",
        "    except (LeaseLost, StaleWrite) as exc:\n",
        "    except LeaseLost as exc:\n",
        TURN,
    ),
    Mutant(
        "T3",
        "tasks/turn.py",
        "    except (LeaseLost, StaleWrite) as exc:\n",
        "    except StaleWrite as exc:\n",
        TURN,
    ),
    Mutant(
        "T4",
        "tasks/tools_parallel.py",
        "        held.checkpointed(tool_events(call, outcome))\n",
        "        held.record(tool_events(call, outcome))\n",
        TURN,
    ),
    Mutant(
        "T5",
        "tasks/held_run.py",
        "        self.checkpointed(response_events(response), requesting=True)\n",
        "        self.record(response_events(response))\n",
        TURN,
    ),
    Mutant(
        "T6",
        "runtime/probes.py",
        "    return Rule.PROBE if has_probe else Rule.PARK\n",
        "    return Rule.PROBE if has_probe else Rule.RERUN\n",
        TURN,
    ),
    Mutant(
        "T7",
        "runtime/actions.py",
        "    if idempotent:\n        text = ",
        "    if True:\n        text = ",
        TURN,
        k="tool or hung or idempotent",
    ),
    Mutant(
        "T8",
        "tasks/held_run.py",
        "        self.snapshot_seq = self.state.seq\n",
        "        pass\n",
        TURN,
    ),
    Mutant(
        "T9",
        "tasks/turn.py",
        "        held.checkpointed([suspension_event(action)])\n",
        "        held.record([suspension_event(action)])\n",
        TURN,
    ),
    Mutant(
        "T10",
        "tasks/held_run.py",
        '            self.checkpointed([("run.parked", action.data)])\n',
        '            self.record([("run.parked", action.data)])\n',
        TURN,
    ),
    Mutant(
        "T11",
        "tasks/held_run.py",
        "        self.ctx.snapshots.delete(self.state.run_id)\n",
        "        pass\n",
        TURN,
    ),
    Mutant(
        "T12",
        "tasks/turn.py",
        "if expected_seq is not None and held.state.seq != expected_seq:",
        "if False:",
        TURN,
    ),
    Mutant(
        "T13",
        "tasks/turn.py",
        "        if held.asked_model:\n            return TurnOutcome.NEXT\n",
        "",
        TURN,
    ),
    Mutant(
        "T14",
        "runtime/fsm.py",
        "    if agent.binding != state.binding:\n",
        "    if False:\n",
        TURN,
    ),
    Mutant(
        "T15",
        "tasks/lease.py",
        "        if held.taken and not held.released:\n            ctx.runs.release_lease(run_id, held.owner)\n",
        "        pass\n",
        TURN,
    ),
    Mutant(
        "T16",
        "tasks/turn.py",
        "            held.adopt()\n",
        "",
        TURN,
        k="late_checkpoint",
    ),
    Mutant(
        "T17",
        "tasks/persistence.py",
        "        ctx.snapshots.save(state, late)\n",
        "        raise\n",
        TURN,
        k="late_checkpoint",
    ),
    Mutant(
        "T18",
        "tasks/held_run.py",
        "            release = self._ends_turn(change.state)\n",
        "            release = True\n",
        ("tests/test_transition_snapshots.py",),
    ),
    Mutant(
        "T19",
        "tasks/held_run.py",
        '{"reason": action.reason})])\n            self.checkpoint()\n            return TurnOutcome.STALLED\n',
        '{"reason": action.reason})])\n            self.checkpoint()\n            return TurnOutcome.IDLE\n',
        ("tests/test_openai_runs.py",),
        k="outage",
    ),
    Mutant(
        "T20",
        "runtime/fsm.py",
        "        if spec is None or unknown_outcome_rule(",
        "        if spec is None and unknown_outcome_rule(",
        TURN,
        k="never_started",
    ),
    # --- tasks/recovery.py: resume, dead letters, the sweep, reconcile ---------------
    Mutant(
        "V1",
        "tasks/recovery.py",
        "    if record is None or not live:\n",
        "    if record is None:\n",
        RECOVERY,
    ),
    Mutant(
        "V2",
        "tasks/recovery.py",
        "        if seen_seq is not None and seq != seen_seq and not took_over:\n",
        "        if False:\n",
        RECOVERY,
    ),
    Mutant(
        "V3",
        "runtime/recovery.py",
        "(verdict.eligible and len(history) < max_attempts)",
        "(verdict.eligible and len(history) <= max_attempts)",
        RECOVERY,
    ),
    Mutant(
        "V4",
        "runtime/recovery.py",
        "    if by != SWEEPER or (",
        "    if True or (",
        RECOVERY,
    ),
    Mutant(
        "V5",
        "tasks/recovery.py",
        "        if call_id not in state.running:\n",
        "        if False:\n",
        RECOVERY,
    ),
    Mutant(
        "V6",
        "tasks/recovery.py",
        "        if state.status != RunStatus.NEEDS_RECONCILIATION:\n",
        "        if False:\n",
        RECOVERY,
    ),
    Mutant(
        "V7",
        "tasks/recovery.py",
        "        if record is None or not record.status.is_live:\n            continue\n",
        "        if record is None:\n            continue\n",
        RECOVERY,
        harmless="the overdue index holds live runs only (a run leaves it when it suspends, "
        "parks or finishes: run store contract), and a resume of a run that is not live is "
        "refused (V1's tests); the check only saves enqueueing a no-op",
    ),
    Mutant(
        "V8",
        "tasks/recovery.py",
        "        enqueue(run_id, record.last_seq)\n",
        "        enqueue(run_id, record.last_seq - 1)\n",
        RECOVERY,
    ),
    Mutant(
        "V10",
        "tasks/recovery.py",
        "    except (LeaseLost, StaleWrite) as exc:\n        log.warning",
        "    except LeaseLost as exc:\n        log.warning",
        RECOVERY,
    ),
    Mutant(
        "V11",
        "tasks/recovery.py",
        "    except (LeaseLost, StaleWrite) as exc:\n        log.warning",
        "    except StaleWrite as exc:\n        log.warning",
        RECOVERY,
    ),
    Mutant(
        "V9",
        "tasks/recovery.py",
        'data: dict[str, Any] = {"call_id": call_id, "decision": decision, "by": OPERATOR}',
        'data: dict[str, Any] = {"call_id": call_id, "decision": "retry", "by": OPERATOR}',
        RECOVERY,
    ),
    # --- liveness: a dead worker's runs are taken at once, a live one's never -----------
    Mutant(
        "L1",
        "tasks/liveness.py",
        "            for store in stores:\n                self._beat(store, late_s)\n",
        "            for store in stores:\n                pass\n",
        LIVENESS,
        k="keeps_its_run",
    ),
    Mutant(
        "L7",
        "tasks/liveness.py",
        "            for store in stores:\n                self._beat(store, late_s)\n",
        "            for store in stores:\n                pass\n",
        ("tests/crash/test_liveness_on_real_workers.py",),
        k="busy",
    ),
    # The memory and SQLite backends share this rule (Claim.decide); Redis has it in Lua.
    Mutant(
        "L2",
        "store/runs/__init__.py",
        "if until is None or until > now_ms:",
        "if until is None:",
        LIVENESS,
        k="memory or sqlite",
    ),
    Mutant(
        "L4",
        "store/runs/lua/claim.lua",
        "if not alive or tonumber(alive) > tonumber(ARGV[2]) then",
        "if not alive then",
        LIVENESS,
        k="redis",
    ),
    Mutant(
        "L5",
        "tasks/recovery.py",
        "    for orphan in ctx.runs.orphaned(limit):\n",
        "    for orphan in ctx.runs.orphaned(limit)[:0]:\n",
        LIVENESS,
        k="sweeper",
    ),
    Mutant(
        "L6",
        "tasks/turn.py",
        "        if claim.took_from is not None:\n",
        "        if False:\n",
        LIVENESS,
        k="dead_owners_lease",
    ),
    # --- one way to hold a lease (tasks/lease.py): every path takes a dead holder's --
    Mutant(
        "H1",
        "tasks/lease.py",
        "        claim = liveness.claim(ctx, run_id, owner)\n",
        "        claim = Claim(ctx.runs.acquire_lease(run_id, owner, ctx.settings.lease_s))\n",
        ("tests/test_lease.py",),
        k="sigkilled or expiry",
    ),
    Mutant(
        "H2",
        "tasks/lease.py",
        "    if held.taken and held.took_from is not None and not recovers:\n",
        "    if False:\n",
        ("tests/test_lease.py",),
        k="mid_turn",
    ),
    Mutant(
        "H3",
        "tasks/lease.py",
        "        limit_s = patience_s + (until_dead_s if claim.holder_alive_until_ms is not None else 0.0)\n",
        "        limit_s = patience_s\n",
        ("tests/test_lease.py",),
        k="redelivered",
    ),
    # --- the fast path's lease in the index orphaned() walks (Redis) -------------
    Mutant(
        "L8",
        "store/runs/lua/hold_lease.lua",
        "    redis.call('SADD', process_set, run_id)\n",
        "",
        ("tests/contract/test_liveness_contract.py",),
        k="one_call and redis",
    ),
    Mutant(
        "L9",
        "store/runs/lua/append.lua",
        "  redis.call('SREM', KEYS[10], run_id)\n",
        "",
        ("tests/contract/test_transition_contract.py",),
        k="lease_index",
    ),
)


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
    args = parser.parse_args(argv)

    problems = check()
    if problems:
        print("the mutant list no longer fits the source:\n  " + "\n  ".join(problems))
        return 2
    if args.check:
        print(f"{len(MUTANTS)} mutants, each snippet found exactly once")
        return 0
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.k:
        chosen = [replace(m, k=args.k) for m in chosen]
    if args.files:
        chosen = [replace(m, tests=tuple(args.files), k=None) for m in chosen]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
