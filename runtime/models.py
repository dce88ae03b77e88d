"""The data a run is made of: messages, usage, budgets, events and the run's state.

Every model refuses unknown fields: these shapes are persisted (in snapshots
and events), and a field nobody reads is a field nobody checks.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from runtime.errors import InvalidRunId

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def validate_run_id(run_id: object) -> str:
    """Return ``run_id`` if it is a valid id; raise :class:`InvalidRunId` otherwise.

    The pattern admits no ``/``, ``.`` or NUL, so an id can never name a path
    outside a store's directory, whatever backend it reaches.
    """
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise InvalidRunId(run_id)
    return run_id


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunStatus(StrEnum):
    QUEUED = "queued"
    MODEL = "model"
    TOOLS = "tools"
    NEEDS_USER_INPUT = "needs_user_input"
    BLOCKED = "blocked"
    AWAITING_APPROVAL = "awaiting_approval"
    WAITING = "waiting"
    """Waiting for a time (the `wait` tool); no person is needed."""
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    NEEDS_RECONCILIATION = "needs_reconciliation"
    STALLED = "stalled"
    DEAD_LETTERED = "dead_lettered"

    @property
    def is_live(self) -> bool:
        """A worker is expected to advance the run without anyone's help."""
        return self in LIVE_STATUSES

    @property
    def is_suspended(self) -> bool:
        return self in SUSPENDED_STATUSES

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES

    @property
    def operator_actions(self) -> tuple[OperatorAction, ...]:
        """What an operator may ask of a run in this status (:data:`OPERATOR_ACTIONS`)."""
        return OPERATOR_ACTIONS[self]


LIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.MODEL, RunStatus.TOOLS})
SUSPENDED_STATUSES = frozenset(
    {RunStatus.NEEDS_USER_INPUT, RunStatus.BLOCKED, RunStatus.AWAITING_APPROVAL, RunStatus.WAITING}
)
TERMINAL_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
"""The run ended by its own course (or a cancel): its output or error is final."""
FINISHED_STATUSES = TERMINAL_STATUSES | {RunStatus.DEAD_LETTERED}
"""Nothing moves the run on by itself: terminal, or dead-lettered (recovery gave up on it;
only an operator's resume moves it on). A waiter stops at these; retention purges them.
Parked (needs_reconciliation, stalled) and suspended runs wait for a person and are not
among them."""


class OperatorAction(StrEnum):
    """What a person can ask of a run from the console or the CLI."""

    ANSWER = "answer"
    APPROVE = "approve"
    DENY = "deny"
    RECONCILE = "reconcile"
    RESUME = "resume"
    CANCEL = "cancel"


_ANSWERED = (OperatorAction.ANSWER, OperatorAction.CANCEL)
_RESUMED = (OperatorAction.RESUME, OperatorAction.CANCEL)
OPERATOR_ACTIONS: dict[RunStatus, tuple[OperatorAction, ...]] = {
    # A live run resumes only when its worker died; the resume refuses it otherwise, saying why.
    RunStatus.QUEUED: _RESUMED,
    RunStatus.MODEL: _RESUMED,
    RunStatus.TOOLS: _RESUMED,
    RunStatus.NEEDS_USER_INPUT: _ANSWERED,
    RunStatus.BLOCKED: _ANSWERED,
    RunStatus.AWAITING_APPROVAL: (
        OperatorAction.APPROVE,
        OperatorAction.DENY,
        OperatorAction.CANCEL,
    ),
    # A timer wakes the run by itself: nothing to answer.
    RunStatus.WAITING: (OperatorAction.CANCEL,),
    RunStatus.COMPLETED: (),
    RunStatus.FAILED: (),
    RunStatus.CANCELLED: (),
    RunStatus.NEEDS_RECONCILIATION: (OperatorAction.RECONCILE, OperatorAction.CANCEL),
    RunStatus.STALLED: _RESUMED,
    RunStatus.DEAD_LETTERED: _RESUMED,
}
"""The actions the console and ``ratchet runs show`` offer for each status, in the order
they are shown. An offer, not a permission: the action itself still checks the run and
refuses with its reason (a live run's resume while its worker lives, say)."""

INVALID_ARGUMENTS_KEY = "__invalid_json__"
"""A provider that receives tool arguments it cannot parse puts the raw text under this
key; the runtime answers the model with a tool error instead of running the tool."""
UNUSABLE_ARGUMENTS_KEY = "__unusable_arguments__"
"""Arguments that parse but cannot be stored or given to a tool (a lone surrogate, NaN, an
integer of more than 4300 digits, too large: runtime/json_values.py) are replaced by this key,
saying why; the runtime answers the model with a tool error instead of running the tool."""


class ToolCall(Strict):
    id: str
    """Stable id of this call within the run; the tool journal is keyed by it."""
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Message(Strict):
    """One transcript entry. The transcript only ever grows."""

    role: str
    """`system`, `user`, `assistant` or `tool`."""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    """Calls the assistant asked for (assistant messages only)."""
    tool_call_id: str | None = None
    """The call this message answers (tool messages only)."""
    name: str | None = None
    """The tool that produced this result (tool messages only)."""
    is_error: bool = False
    """The tool failed or was refused; the content says why."""


class TokenUsage(Strict):
    input_tokens: int = 0
    output_tokens: int = 0


class Usage(Strict):
    """What the run has consumed so far. Every counter only increases."""

    model_attempts: int = 0
    """Model calls started, including ones whose turn crashed: each counts."""
    model_turns: int = 0
    """Model calls that returned a response."""
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    responses_without_usage: int = 0
    """Responses that reported no token usage; a token budget cannot be enforced on them."""
    tool_calls: int = 0
    """Tool calls that finished (successfully or with an error result)."""


class Budgets(Strict):
    max_turns: int = Field(default=20, ge=1)
    """Model calls the run may make, counting attempts whose turn crashed."""
    max_total_tokens: int | None = Field(default=None, ge=1)
    """Input plus output tokens; ``None`` for no limit."""
    max_tool_calls: int = Field(default=50, ge=0)
    timeout_seconds: int = Field(default=3600, ge=1)
    """Wall time from creation, not counting time suspended."""


class Policy(Strict):
    require_approval: tuple[str, ...] = ()
    """Tools that suspend the run for a person's approval before they run."""


class Suspension(Strict):
    reason: RunStatus
    """`needs_user_input`, `blocked` or `awaiting_approval`."""
    call_id: str
    """The tool call that suspended the run; the continuation answers it."""
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    prompt: str = ""
    """What the person is asked, in the model's words."""
    seq: int
    """Seq of the `run.suspended` event."""
    since_ms: int


class Tree(Strict):
    """Where a run stands in its run tree (runtime/children.py): fixed when it is created,
    but for ``runs``, which grows as its children are told back."""

    depth: int = Field(default=0, ge=0)
    """0 for the root; a child is one deeper than its parent."""
    max_depth: int = Field(ge=0)
    """The deepest a run of this tree may be (the root's ``max_child_depth``)."""
    max_runs: int = Field(ge=1)
    """The most runs the whole tree may hold (the root's ``max_tree_runs``)."""
    share: int = Field(ge=1)
    """The most runs this run's own subtree may hold, itself included."""
    runs: int = Field(default=1, ge=1)
    """Runs counted in this run's subtree so far: itself and each child told back."""


class Event(Strict):
    """One entry in a run's append-only event log."""

    seq: int = Field(ge=1)
    """Position in the run's log: 1, 2, 3, … with no gaps."""
    type: str
    at_ms: int
    data: dict[str, Any] = Field(default_factory=dict)


class RunState(Strict):
    """Everything a worker needs to take the run's next step.

    It is exactly the fold of the run's events (:func:`runtime.fsm.apply`), so a
    snapshot that is lost or stale can always be rebuilt from the event log.
    """

    run_id: str
    seq: int
    """Seq of the last event folded into this state."""
    agent: str
    agent_file: str
    binding: str
    input: str
    status: RunStatus
    budgets: Budgets
    created_at_ms: int
    transcript: tuple[Message, ...]
    pending: tuple[ToolCall, ...] = ()
    """Tool calls the last model response asked for that have no outcome yet, in order."""
    running: tuple[str, ...] = ()
    """Call ids journaled as requested whose outcome is not recorded, in the order they were
    requested: being run now, or cut short by a crash or a timeout (their outcome unknown).
    Parallel tool calls put several here; snapshot format 1 held one (``in_flight``)."""
    approved: tuple[str, ...] = ()
    """Call ids a person approved; they may now run."""
    usage: Usage = Usage()
    suspended_ms: int = 0
    """Total time spent suspended; it extends the deadline."""
    suspension: Suspension | None = None
    recovery_attempts: int = 0
    output: str | None = None
    error: str | None = None
    parent: str | None = None
    """The run that started this one as a child (runtime/children.py); told when it ends."""
    parent_told: bool = False
    """The parent has been told how this child ended (or no longer waits for it)."""
    throttled_since_ms: int | None = None
    """Waiting on a model rate limit (or a 429) since then, without a call in between."""
    priority: int | None = None
    """The priority its start gave the run (0-4, higher first); else the agent's."""
    concurrency_key: str | None = None
    """The key its start named (a tenant): at most the agent's max_runs_per_key at once."""
    tree: Tree | None = None
    """A run that may start children, or is one: its place in its run tree."""
    max_suspended_s: int | None = None
    """The longest the run may wait for a person, fixed by its binding when it was created.
    None: no limit, or a run whose ``run.created`` did not record it (an earlier release
    started it; its binding document still says: ``tasks.persistence.max_suspended_s``)."""

    @model_serializer(mode="wrap")
    def _omit_unset_lineage(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Absent unless set: a run that is nobody's child encodes exactly as format 1
        # always has, byte for byte (the golden snapshot holds this build to it).
        data: dict[str, Any] = handler(self)
        if data.get("parent") is None:
            data.pop("parent", None)
            if not data.get("parent_told"):
                data.pop("parent_told", None)
        for name in (
            "throttled_since_ms",
            "priority",
            "concurrency_key",
            "tree",
            "max_suspended_s",
        ):
            if data.get(name) is None:
                data.pop(name, None)
        return data

    @property
    def in_flight(self) -> str | None:
        """The first call journaled as requested with no outcome, if any."""
        return self.running[0] if self.running else None

    @property
    def deadline_ms(self) -> int:
        return self.created_at_ms + self.budgets.timeout_seconds * 1000 + self.suspended_ms
