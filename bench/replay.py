"""Replay recorded event logs through this build's core: would it steer each run the same way?

    python -m bench.replay                      # every golden log (tests/golden/events/)
    python -m bench.replay LOG.jsonl ...        # any log, e.g. `ratchet runs events RUN --json`

Temporal replays a workflow's recorded history against new workflow code and fails on
the first command the code would no longer issue (its nondeterminism check); this is
that check for agent runs. Each log is folded event by event (runtime/fsm.py
``apply``); before each event the replayer asks what the core would do at that prefix
and holds the recorded event against it. Every event after ``run.created`` is one of:

- **predicted**: an event the core chooses. ``decide`` predicts ``model.requested``
  (``CallModel``), the first ``tool.requested`` of a batch (``RunTool``; the calls that
  follow it are its ``also``, in order), ``run.suspended`` (``Suspend`` and
  ``StartChild``, with reason, call and prompt), a refused call's ``tool.failed``
  (``RefuseCall``, with its error), ``run.failed`` on a budget (``Fail``, with the
  reason) and ``run.parked`` (``Unresolved``: the first call whose rule parks or whose
  probe could not tell). The rules beside ``decide`` predict the rest:
  ``response_events`` (``run.completed`` after an answer that asked for no tools),
  ``unknown_tool_outcome`` (the ``tool.failed`` of a call to a tool the agent lacks),
  ``model_failed`` (the reason of the ``run.failed`` or ``run.stalled`` that follows a
  provider error).
- **outside**: an event that records what came from outside the core: the model's
  answer or failure (``model.responded``, ``model.retrying``, ``model.failed``), a
  rate limit's wait (``run.throttled``), a tool's or a probe's result
  (``tool.completed``, ``tool.failed``, ``tool.probed``, ``tool.unsent``), a person's
  or a timer's or a child's answer (``run.continued``, ``run.woken``), and what an
  operator, the sweeper or the environment did (cancel, expire, reconcile, raise a
  budget, resume, dead-letter, tell a parent, stall). These cannot be predicted; each
  is checked to be one the core allowed at that point (a model answer only while a
  model call is under way, a tool result only for a call under way or one ``decide``
  refused, a probe only for a call ``decide`` gave to its probe, an answer only to a
  suspended run ...) and counted.

A reason's advice to the operator (after its first ``;``) is wording a later build may
improve and is not compared; what happened (before it) is. A check that fails is a
divergence; the replay goes on with the recorded event (the
log is the truth) and reports the first one. The agent is rebuilt from the binding
document ``run.created`` holds (checked against the binding's sha256): it has every
input ``decide`` reads but ``max_parallel_tools``, which stays out of the binding, so a
batch may be any length up to that setting's bound. ``decide`` is asked at the next
event's ``at_ms``: a deadline that fell between the decision and its record would be
reported as a divergence.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from runtime.actions import (
    CallModel,
    Fail,
    Idle,
    RefuseCall,
    RunTool,
    StartChild,
    Suspend,
    Unresolved,
    model_failed,
    park,
)
from runtime.agent import Agent, AgentSpec, canonical_json
from runtime.fsm import (
    apply,
    decide,
    requested_event,
    response_events,
    suspension_event,
    tool_events,
    unknown_tool_outcome,
)
from runtime.models import Event, RunState, RunStatus, ToolCall
from runtime.probes import Answer, Probed, Rule
from runtime.provider import ModelRequest, ModelResponse, Observer
from runtime.tools import CONTROL_TOOLS, ToolOutcome, ToolSpec

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "events"

MAX_PARALLEL_TOOLS = AgentSpec.model_fields["max_parallel_tools"].metadata[-1].le
"""The setting's upper bound: the longest batch any agent may run side by side."""

PERSON = frozenset({"run.continued", "run.woken"})
"""Answers to a suspension: a person's, a timer's, a child's."""
OPERATOR = frozenset(
    {
        "run.cancelled",
        "run.expired",
        "run.budget_raised",
        "run.resumed",
        "run.resume_refused",
        "run.dead_lettered",
        "run.parent_told",
        "run.stalled",
        "tool.reconciled",
    }
)
"""What an operator, the sweeper or the environment does to a run (a stall that no rule of
the core names: an agent file that will not load, a store that refuses a checkpoint, a
call that could not be sent, a wait past ``max_wait_s``)."""


@dataclass
class Replayed:
    """One log's replay: how many events, how many the core predicted and matched."""

    log: str
    events: int = 0
    predicted: int = 0
    """Events the core chooses, each held against what it would choose at that prefix."""
    matched: int = 0
    outside: int = 0
    """Events from outside the core, checked to be allowed there, not predicted."""
    divergences: list[str] = field(default_factory=list)
    """Each: ``seq N type: what the core would do``; the first is where the run would part."""

    @property
    def first_divergence(self) -> str | None:
        return self.divergences[0] if self.divergences else None

    def line(self) -> str:
        first = self.first_divergence or "none"
        return (
            f"{self.log}: events {self.events}, predicted {self.predicted}, matched "
            f"{self.matched}, outside {self.outside}, first divergence: {first}"
        )


class _NeverCalled:
    """The replayed agent's provider: a replay asks no model."""

    def __init__(self, identity: dict[str, Any]) -> None:
        self._identity = identity

    def identity(self) -> dict[str, Any]:
        return self._identity

    def complete(self, request: ModelRequest, *, observer: Observer | None = None) -> ModelResponse:
        raise AssertionError("a replay never calls the model")


def _probe_never_called(**_: Any) -> Any:
    raise AssertionError("a replay never asks a probe")


def replay_agent(created: Event) -> Agent:
    """The agent a run was created with, as ``decide`` reads it, from ``run.created``'s
    binding document; ValueError when the log holds none or it does not hash to the binding."""
    data = created.data
    document = data.get("binding_document")
    if not isinstance(document, dict):
        raise ValueError("run.created holds no binding document: the agent cannot be rebuilt")
    binding = "sha256:" + hashlib.sha256(canonical_json(document)).hexdigest()
    if binding != data.get("binding"):
        raise ValueError(f"the binding document hashes to {binding}, not {data.get('binding')}")
    tools = {
        declaration["name"]: ToolSpec(
            name=declaration["name"],
            reference="replay",
            description=declaration["description"],
            idempotent=declaration["idempotent"],
            control=declaration["name"] in CONTROL_TOOLS,
            parameters=declaration["parameters"],
            arguments_model=BaseModel,
            fn=None,
            probe=_probe_never_called if declaration.get("probe") else None,
            mcp=declaration.get("mcp"),
        )
        for declaration in document["tools"]
    }
    spec = AgentSpec(
        name=data["agent"],
        model=document["model"],
        system=document["system"],
        budgets=document["budgets"],
        policy=document["policy"],
        max_parallel_tools=MAX_PARALLEL_TOOLS,
        max_suspended_s=document.get("max_suspended_s"),
        wake_on_input=document.get("wake_on_input", False),
        children=document.get("children", {}),
    )
    provider = _NeverCalled(document["provider"])
    return Agent(spec, Path(data["agent_file"]), tools, provider, binding, document)


@dataclass
class _Replayer:
    agent: Agent
    state: RunState
    last: Event
    model_under_way: bool = False
    batch: list[str] = field(default_factory=list)
    """The calls of the last ``RunTool`` still to be journaled as requested, in order."""
    probed: dict[str, Answer] = field(default_factory=dict)

    def judge(self, event: Event) -> tuple[bool, str | None]:
        """(predicted, problem): whether the core chooses ``event``, and what is wrong with
        it at this prefix (None: it is what the core would do, or allows)."""
        kind = event.type
        if kind in _PREDICTED:
            return True, _PREDICTED[kind](self, event)
        if kind in _OUTSIDE:
            return False, _OUTSIDE[kind](self, event)
        if kind in ("tool.completed", "tool.failed"):
            return self._tool_outcome(event)
        if kind in ("run.failed", "run.stalled"):
            return self._failed_or_stalled(event)
        return False, f"an event type this build does not know: {kind}"

    def decide(self, event: Event) -> Any:
        return decide(self.state, self.agent, event.at_ms)

    def pending(self, call_id: str) -> ToolCall | None:
        return next((c for c in self.state.pending if c.id == call_id), None)

    # --- what the core chooses ------------------------------------------------

    def model_requested(self, event: Event) -> str | None:
        action = self.decide(event)
        self.model_under_way, self.batch = True, []
        return None if isinstance(action, CallModel) else _would(action)

    def tool_requested(self, event: Event) -> str | None:
        call_id = event.data.get("call_id")
        if self.batch and self.batch[0] == call_id:
            self.batch.pop(0)
            call = self.pending(call_id)
            return _differs(event, requested_event(call)) if call else "no such pending call"
        action = self.decide(event)
        if not isinstance(action, RunTool) or action.call.id != call_id:
            return _would(action)
        self.batch = [c.id for c in action.also if c.id not in self.state.running]
        return _differs(event, requested_event(action.call))

    def completed(self, event: Event) -> str | None:
        if self.last.type == "model.responded":
            response = ModelResponse.model_validate(self.last.data)
            expected = dict(response_events(response))
            if "run.completed" in expected:
                return _differs(event, ("run.completed", expected["run.completed"]))
        return "a run completes only with an answer that asks for no tools"

    def suspended(self, event: Event) -> str | None:
        action = self.decide(event)
        if isinstance(action, Suspend):
            return _differs(event, suspension_event(action))
        if isinstance(action, StartChild):
            # The prompt is the shell's (tasks/turn.py); the call and reason are the core's.
            wait = Suspend(RunStatus.WAITING, action.call, event.data.get("prompt", ""))
            problem = _differs(event, suspension_event(wait))
            if problem is None and action.child_id not in wait.prompt:
                problem = f"the prompt does not name child run {action.child_id}"
            return problem
        return _would(action)

    def parked(self, event: Event) -> str | None:
        action = self.decide(event)
        if not isinstance(action, Unresolved):
            return _would(action)
        stuck = [
            (call, Probed(self.probed[call.id]) if call.id in self.probed else None)
            for call, rule in action.calls
            if rule == Rule.PARK or (rule == Rule.PROBE and self.probed.get(call.id) != "not_run")
        ]
        if not stuck:
            return "no call is left unknown: " + _would(action)
        call = self.pending(stuck[0][0].id)
        spec = self.agent.tools.get(call.name) if call else None
        server = spec.mcp.get("server") if spec is not None and spec.mcp else None
        expected = park(self.state.run_id, stuck, None, server).data
        # The reason names a tool timeout the log does not hold; the rest is the rule's.
        return _differs(
            event,
            ("run.parked", {k: v for k, v in expected.items() if k != "reason"}),
            ignore=("reason",),
        )

    # --- what comes from outside, and whether the core allowed it --------------

    def model_answered(self, event: Event) -> str | None:
        if not self.model_under_way:
            return "a model answer with no model call under way"
        if event.type != "model.retrying":
            self.model_under_way = False
        return None

    def throttled(self, event: Event) -> str | None:
        if event.data.get("refused"):
            return self.model_answered(event)
        action = self.decide(event)
        return None if isinstance(action, CallModel) else _would(action)

    def probed_answer(self, event: Event) -> str | None:
        action = self.decide(event)
        call_id = event.data.get("call_id")
        if not isinstance(action, Unresolved) or all(
            call.id != call_id or rule != Rule.PROBE for call, rule in action.calls
        ):
            return "a probe's answer for a call no probe was asked about: " + _would(action)
        self.probed[str(call_id)] = Answer(event.data["answer"])
        return None

    def unsent(self, event: Event) -> str | None:
        if event.data.get("call_id") in self.state.running:
            return None
        return "a call not under way was not sent"

    def answered(self, event: Event) -> str | None:
        action = self.decide(event)
        if self.state.suspension is None or not isinstance(action, Idle):
            return "an answer to a run that is not suspended"
        return None

    def operator(self, event: Event) -> str | None:
        if event.type == "tool.reconciled" and self.pending(event.data["call_id"]) is None:
            return "a reconciliation of a call that is not pending"
        if event.type == "run.parent_told" and not self.state.status.is_terminal:
            return "a parent told of a run that has not finished"
        return None

    def _tool_outcome(self, event: Event) -> tuple[bool, str | None]:
        call_id = event.data.get("call_id")
        call = self.pending(call_id) if isinstance(call_id, str) else None
        if call is not None and call_id in self.state.running:
            if call.name in self.agent.tools:
                return False, None  # the tool's own result
            return True, _differs(
                event, tool_events(call, unknown_tool_outcome(call, self.agent))[0]
            )
        action = self.decide(event)
        if isinstance(action, RefuseCall) and action.call.id == call_id:
            refused = ToolOutcome(False, action.error)
            return True, _differs(event, tool_events(action.call, refused)[0])
        if (
            isinstance(action, StartChild)
            and action.call.id == call_id
            and event.type == "tool.failed"
        ):
            return False, None  # a child that could not be started (tasks/children.py)
        return True, "an outcome for a call not under way: " + _would(action)

    def _failed_or_stalled(self, event: Event) -> tuple[bool, str | None]:
        if self.last.type == "model.failed" and not self.last.data.get("timeout"):
            # A provider error: whether it was retryable came from outside, the reason is the rule's.
            d = self.last.data
            rule = model_failed(
                self.state.run_id, d["turn"], d["error"], event.type == "run.stalled"
            )
            return True, _differs(event, (event.type, {"reason": rule.reason}))
        if event.type == "run.stalled":
            return False, self.operator(event)
        action = self.decide(event)
        if not isinstance(action, Fail):
            return True, _would(action)
        budget = {"budget": action.budget} if action.budget else {}
        return True, _differs(event, ("run.failed", {"reason": action.reason, **budget}))


_PREDICTED = {
    "model.requested": _Replayer.model_requested,
    "tool.requested": _Replayer.tool_requested,
    "run.completed": _Replayer.completed,
    "run.suspended": _Replayer.suspended,
    "run.parked": _Replayer.parked,
}
_OUTSIDE = {
    "model.responded": _Replayer.model_answered,
    "model.retrying": _Replayer.model_answered,
    "model.failed": _Replayer.model_answered,
    "run.throttled": _Replayer.throttled,
    "tool.probed": _Replayer.probed_answer,
    "tool.unsent": _Replayer.unsent,
    **dict.fromkeys(PERSON, _Replayer.answered),
    **dict.fromkeys(OPERATOR - {"run.stalled"}, _Replayer.operator),
}


def _would(action: Any) -> str:
    return f"the core would {type(action).__name__}"


def _differs(
    event: Event, expected: tuple[str, dict[str, Any]], ignore: tuple[str, ...] = ()
) -> str | None:
    kind, data = expected
    recorded = {k: v for k, v in event.data.items() if k not in ignore}
    if kind in ("run.failed", "run.stalled"):
        recorded["reason"] = _what_happened(recorded.get("reason"))
        data = {**data, "reason": _what_happened(data.get("reason"))}
        if "budget" not in recorded:  # recorded before run.failed named its budget
            data.pop("budget", None)
    if (event.type, recorded) == (kind, data):
        return None
    return f"the core would record {kind} {json.dumps(data, sort_keys=True)[:300]}"


def _what_happened(reason: Any) -> Any:
    """A reason without its advice: what comes after its first ``;`` tells the operator what
    to do, wording a later build may improve; what happened comes before it."""
    return reason.split(";", 1)[0] if isinstance(reason, str) else reason


def replay(events: list[Event], name: str = "log") -> Replayed:
    """Replay one run's events (its whole log, from ``run.created``) through the core."""
    done = Replayed(name, events=len(events))
    if not events or events[0].type != "run.created":
        done.divergences.append("a run's log starts with run.created")
        return done
    try:
        replayer = _Replayer(replay_agent(events[0]), apply(None, events[0]), events[0])
    except ValueError as exc:
        done.divergences.append(f"seq 1 run.created: {exc}")
        return done
    for event in events[1:]:
        predicted, problem = replayer.judge(event)
        done.predicted += predicted
        done.matched += predicted and problem is None
        done.outside += not predicted
        if problem is not None:
            done.divergences.append(f"seq {event.seq} {event.type}: {problem}")
        try:
            replayer.state = apply(replayer.state, event)
        except ValueError as exc:
            done.divergences.append(f"seq {event.seq} {event.type}: does not fold: {exc}")
            return done
        replayer.last = event
    return done


def read_log(path: Path) -> list[Event]:
    """A log file: one event a line as JSON (golden logs, `ratchet runs events RUN --json`)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Event.model_validate(json.loads(line)) for line in lines if line.strip()]


def golden_logs() -> list[Path]:
    return sorted(GOLDEN.glob("*.jsonl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__)
    parser.add_argument("logs", nargs="*", type=Path, help="default: every golden event log")
    args = parser.parse_args(argv)
    totals = Replayed("all")
    for path in args.logs or golden_logs():
        done = replay(read_log(path), path.name)
        print(done.line())
        for name in ("events", "predicted", "matched", "outside"):
            setattr(totals, name, getattr(totals, name) + getattr(done, name))
        totals.divergences += [f"{path.name} {d}" for d in done.divergences[:1]]
    print(totals.line())
    return 1 if totals.divergences else 0


if __name__ == "__main__":
    sys.exit(main())
