"""Every error ratchet raises, each saying what happened and what to do next.

::

    RatchetError
    ├── AgentFileError            the agent file is malformed (names the file and the key)
    ├── ToolError                 a tool could not be declared or imported
    ├── ProviderError             the model provider failed (retryable or not)
    │   └── ProviderRateLimited   HTTP 429: the turn waits on the queue, not in the worker
    ├── BudgetError               the run's budgets stop its next step
    │   ├── BudgetExhausted       a budget or the deadline does not allow the next step
    │   └── BudgetUnenforceable   a token budget with responses that reported no usage
    ├── InvalidInput              a run's input (or its idempotency key) is refused
    ├── InvalidRequest            a command, option or call is refused before anything changes
    │   └── InvalidOption         an option or argument is malformed (exit status 2)
    ├── InvalidRunId              a run id from outside is not a valid id
    ├── RunNotFound               no run with this id
    ├── RunRefused                an operation is refused for the run's current status
    │   ├── SuspensionAlreadyAnswered  a second, different answer to one suspension
    │   ├── SuspensionMismatch    the continuation names another suspension than the current
    │   ├── SuspensionExpired     the run waited longer than its max_suspended_s
    │   └── RunBusy               the run is in another worker's hands right now: try again
    │       ├── LeaseHeld         a live worker held its lease through all this one waited
    │       ├── RunMoving         every write this tried lost its seq race to other writers
    │       └── HolderDied        its holder died mid-turn: taken over, a resume is on its way
    ├── InvalidContinuation       a continuation's answer is not acceptable (size, blank, UTF-8)
    ├── MalformedContinuation     a plain-JSON continuation message has the wrong shape
    ├── BindingChanged            the agent changed since the run started
    ├── RunStateLost              no usable snapshot, and the events cannot rebuild the state
    ├── EventsDoNotFold           an event cannot follow the run's state (also a ValueError)
    ├── NotStorable               a value cannot be stored as JSON (also a ValueError)
    ├── ToolModuleChanged         a tool module changed on disk after this worker imported it
    ├── SnapshotError             a snapshot document cannot be used
    │   ├── SnapshotMalformed
    │   ├── SnapshotWrongKind
    │   ├── SnapshotUnsupportedVersion
    │   └── SnapshotTooLarge
    ├── StoreUrlInvalid           a store URL no backend can open (also a ValueError)
    ├── StoreError                a backend failed; translated at the seam
    │   ├── StoreUnavailable      transient: the backend could not be reached
    │   │   └── StoreBusy         every pooled connection stayed busy: the pool is too small
    │   ├── StaleWrite            compare-and-set lost: someone wrote a newer seq
    │   ├── LeaseLost             this worker no longer holds the run's lease (a zombie)
    │   └── NotReplicated         fewer replicas than required acknowledged a journal entry
    ├── SnapshotFailed            a checkpoint could not be saved; the run stays where it was
    ├── RejectedEntryNotFound     no message with this id in the dead-letter store
    ├── ConfigInvalid             a setting (environment variable) is wrong: names it and the fix
    ├── ClockSkewed               this host's clock is too far from the run store's
    ├── ExtraMissing              a command needs an optional extra that is not installed
    ├── StartConflict             a start's key names a run of another agent or input
    ├── RunNotQueued              a run is recorded but its first turn could not be queued
    └── MessageRefused            a task message is not its task's (argument, type, version)

Every class with constructor arguments defines ``__reduce__`` so that it survives
Celery's serialisation of task failures.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]*):[^@\s/]*@", re.IGNORECASE)
# Also a prefixed name (`sentinel_password=` of a redis+sentinel:// URL).
_QUERY_SECRET = re.compile(r"\b(\w*(?:password|secret|token|key))=[^&\s]*", re.IGNORECASE)


def redacted(text: str) -> str:
    """``text`` with every URL's password, and every ``password=…`` query value, masked."""
    return _QUERY_SECRET.sub(r"\1=***", _URL_PASSWORD.sub(r"\1:***@", text))


_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def plain_problem(message: str) -> str:
    """Pydantic's message of a validator's error without the prefix it adds (``Value
    error, ``): the validator's own words are the message."""
    for prefix in _PYDANTIC_PREFIXES:
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


def _of_run(run_id: str | None) -> str:
    return f"run {run_id}: " if run_id else ""


class RatchetError(Exception):
    """Root of every error ratchet raises on purpose."""

    def __init__(self, message: str, *args: Any) -> None:
        """``args``: the constructor's arguments, which a pickle rebuilds the error from.

        An error that keeps each of its constructor's arguments, as given, in the
        attribute of the same name need not pass them: they are read back from there.
        """
        super().__init__(message)
        self._args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, self._args or self._kept_args())

    def _kept_args(self) -> tuple[Any, ...]:
        params = list(inspect.signature(type(self).__init__).parameters.values())[1:]
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            return (str(self),)  # built from its message alone
        return tuple(getattr(self, p.name) for p in params)


class AgentFileError(RatchetError):
    """The agent file at ``path`` is refused: ``key`` names the key at fault, or is empty
    when the file as a whole is (missing, unreadable, not TOML); ``fix`` says what to do."""

    def __init__(
        self,
        path: str,
        key: str,
        problem: str,
        fix: str = "fix the agent file, then run the command again",
    ) -> None:
        where = f"{path}: `{key}`" if key else path
        super().__init__(f"{where}: {problem} ({fix})")
        self.path, self.key, self.problem, self.fix = path, key, problem, fix


class ToolError(RatchetError):
    FIX = "fix the tool or the agent file's `tools`, then run the command again"

    def __init__(self, reference: str, problem: str) -> None:
        super().__init__(f"tool `{reference}`: {problem} ({self.FIX})")
        self.reference, self.problem = reference, problem


class CallNotSent(RatchetError):
    """A tool call never left this process: the server that runs the tool could not be
    reached (an MCP server down, runtime_io/mcp). Nothing ran, so the run stalls and a resume
    sends the call afresh; the message names the server."""


class ProviderError(RatchetError):
    """The model provider failed. ``retryable`` says whether another attempt may succeed."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message, message, retryable)
        self.retryable = retryable


class ProviderRateLimited(ProviderError):
    """The provider answered 429: not retried in-process, the turn is re-enqueued instead.

    ``retry_after_s`` is the server's ``Retry-After`` (``None`` when it sent none).
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        RatchetError.__init__(self, message, message, retry_after_s)
        self.retryable = True
        self.retry_after_s = retry_after_s


class BudgetError(RatchetError):
    """The run's budgets stop its next step: one is used up, or one cannot be checked."""

    budget: str


class BudgetExhausted(BudgetError):
    def __init__(self, run_id: str, budget: str, used: float, limit: float) -> None:
        super().__init__(
            f"budget `{budget}` exhausted: {used:g} used of {limit:g}; give run {run_id} more "
            f"with `ratchet runs budget {run_id} --{budget.replace('_', '-')} +N --reason WHY`, "
            "or raise it in the agent file for new runs",
        )
        self.run_id, self.budget, self.used, self.limit = run_id, budget, used, limit


class BudgetUnenforceable(BudgetError):
    """A token budget cannot be checked: the provider did not report usage."""

    def __init__(self, run_id: str, budget: str, responses: int) -> None:
        super().__init__(
            f"run {run_id}: budget `{budget}` cannot be enforced: {responses} model response(s) "
            "reported no token usage, and ratchet does not guess; use a provider that reports "
            "usage or remove the budget, then start a new run",
        )
        self.run_id, self.budget, self.responses = run_id, budget, responses


class InvalidInput(RatchetError):
    """A run's input, or the key that starts it once, is refused before anything is recorded."""

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"run input refused: {problem}; nothing was recorded — correct it and start the run "
            "again",
            problem,
        )


class InvalidRequest(RatchetError, ValueError):
    """An operator's command, option or call is refused before anything changes.

    Also a ``ValueError``, as these refusals were before they had a type. ``problem``
    says what is wrong and, where it can, what would be accepted.
    """

    def __init__(self, problem: str, run_id: str | None = None) -> None:
        super().__init__(
            f"{_of_run(run_id)}{problem}; nothing was changed — correct it and try again "
            "(`--help` lists a command's options)",
        )
        self.problem, self.run_id = problem, run_id


class InvalidOption(InvalidRequest):
    """An option or argument of a command or call is malformed, whatever the run's state:
    a value that does not parse, or a combination of options that cannot go together.
    The ``ratchet`` command exits 2 on it (worker/exits.py); an InvalidRequest that
    depends on the run (nothing to raise, not stopped there) exits 1.
    """


class InvalidRunId(RatchetError):
    def __init__(self, run_id: object) -> None:
        shown = repr(run_id)[:80]
        super().__init__(
            f"{shown} is not a run id: use the id `ratchet runs start` printed "
            "(1-64 characters of letters, digits, `-` and `_`)",
            run_id,
        )


class RunNotFound(RatchetError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id} not found: check the id with `ratchet runs list`")
        self.run_id = run_id


class RunRefused(RatchetError):
    """An operation the run's current status does not allow."""

    def __init__(self, run_id: str, status: str, reason: str) -> None:
        super().__init__(f"run {run_id} is {status}: {reason}")
        self.run_id, self.status, self.reason = run_id, status, reason


class SuspensionAlreadyAnswered(RunRefused):
    def __init__(self, run_id: str, status: str, suspension_seq: int, by: str) -> None:
        RatchetError.__init__(
            self,
            f"run {run_id} is {status}: its suspension at seq {suspension_seq} was already "
            f"answered by continuation {by}, so this different answer is refused; if the run "
            f"asks again, answer that (`ratchet runs show {run_id}`)",
        )
        self.run_id, self.status, self.suspension_seq, self.by = run_id, status, suspension_seq, by
        self.reason = f"suspension at seq {suspension_seq} already answered by {by}"


class SuspensionMismatch(RunRefused):
    def __init__(self, run_id: str, status: str, answers_seq: int, current_seq: int) -> None:
        RatchetError.__init__(
            self,
            f"run {run_id} is {status}: this continuation answers the suspension at seq "
            f"{answers_seq}, but the run is waiting on the one at seq {current_seq}; read the "
            f"current question with `ratchet runs show {run_id}` and answer that",
        )
        self.run_id, self.status = run_id, status
        self.answers_seq, self.current_seq = answers_seq, current_seq
        self.reason = f"answers seq {answers_seq}, current suspension is seq {current_seq}"


class SuspensionExpired(RunRefused):
    def __init__(self, run_id: str, waited_s: float, max_suspended_s: float) -> None:
        RatchetError.__init__(
            self,
            f"run {run_id} waited {waited_s:g}s for an answer, over its agent's "
            f"max_suspended_s of {max_suspended_s:g}; the run has expired (failed) and "
            "cannot be continued — start a new run",
            run_id,
            waited_s,
            max_suspended_s,
        )
        self.run_id, self.status = run_id, "failed"
        self.reason = f"waited {waited_s:g}s, over max_suspended_s {max_suspended_s:g}"


RETRY_BUSY = "try again in a moment (a control message is retried by itself)"


class RunBusy(RunRefused):
    """Nothing was done: the run is in another worker's hands right now. Try again.

    ``status`` is the run's status as last read (None when it was not read).
    """

    def __init__(self, run_id: str, cause: str, status: str | None = None) -> None:
        RatchetError.__init__(
            self, f"run {run_id} is busy: {cause}; {RETRY_BUSY}", run_id, cause, status
        )
        self.run_id, self.status, self.reason = run_id, status or "", cause


class LeaseHeld(RunBusy):
    def __init__(
        self,
        run_id: str,
        holder: str,
        waited_s: float,
        holder_alive: bool | None,
        expires_in_s: float | None,
    ) -> None:
        if holder_alive is None:
            whose = "its process keeps no liveness record, so only the lease's expiry ends it"
        elif holder_alive:
            whose = "its process is alive, so it is advancing the run"
        else:
            whose = "its process has just stopped renewing its liveness (it may have died)"
        waited = (
            f"held its lease through the {waited_s:g}s this waited for it"
            if waited_s
            else "holds its lease (this did not wait for it)"
        )
        expiry = (
            f", and the lease expires in {expires_in_s:.1f}s" if expires_in_s is not None else ""
        )
        RatchetError.__init__(
            self,
            f"run {run_id} is busy: worker {holder} {waited} ({whose}{expiry}); {RETRY_BUSY}, "
            "or follow the run with "
            f"`ratchet runs events {run_id} --follow`",
            run_id,
            holder,
            waited_s,
            holder_alive,
            expires_in_s,
        )
        self.run_id, self.status = run_id, ""
        self.reason = f"{holder} holds its lease" + (f" (waited {waited_s:g}s)" if waited_s else "")
        self.holder, self.waited_s = holder, waited_s


class RunMoving(RunBusy):
    def __init__(self, run_id: str, races: int) -> None:
        RatchetError.__init__(
            self,
            f"run {run_id} is busy: this write lost {races} seq races in a row (each time "
            f"another writer, a turn in progress, appended first); {RETRY_BUSY}",
            run_id,
            races,
        )
        self.run_id, self.status = run_id, ""
        self.reason = f"lost {races} seq races"
        self.races = races


class HolderDied(RunBusy):
    def __init__(self, run_id: str, holder: str, status: str) -> None:
        RatchetError.__init__(
            self,
            f"run {run_id} is busy: its lease holder {holder} died mid-turn (status {status}); "
            "the lease was taken from it and a resume enqueued to recover the run first — "
            f"{RETRY_BUSY} once the run is resumed (`ratchet runs show {run_id}`)",
            run_id,
            holder,
            status,
        )
        self.run_id, self.status = run_id, status
        self.reason = f"lease holder {holder} died mid-turn; a resume is enqueued"
        self.holder = holder


class InvalidContinuation(RatchetError):
    def __init__(self, run_id: str, problem: str) -> None:
        super().__init__(
            f"continuation for run {run_id} refused: {problem}; correct the answer and send it "
            f"again (`ratchet runs show {run_id}` shows what the run asks)",
        )
        self.run_id, self.problem = run_id, problem


class MalformedContinuation(RatchetError):
    def __init__(self, problem: str) -> None:
        super().__init__(
            f"continuation message refused: {problem}; it is kept in `ratchet rejected list` — "
            "send the answer again as a JSON object like "
            '{"run_id": "…", "input": "…", "continuation_id": "…"} or '
            '{"run_id": "…", "approve": true} or {"run_id": "…", "deny": "reason"}',
        )
        self.problem = problem


class BindingChanged(RatchetError):
    def __init__(self, run_id: str, agent: str, changed: str) -> None:
        super().__init__(
            f"run {run_id}: agent `{agent}` has changed since the run started ({changed}); "
            "continuing against a modified agent gives a result that is neither "
            "version's — start the run again",
            run_id,
            agent,
            changed,
        )


class RunStateLost(RatchetError):
    def __init__(self, run_id: str, problem: str) -> None:
        super().__init__(
            f"run {run_id} has no usable snapshot and its events cannot rebuild its state "
            f"({problem}); read them with `ratchet runs events {run_id}` and start the run "
            "again with `ratchet runs start`",
        )
        self.run_id, self.problem = run_id, problem


class EventsDoNotFold(RatchetError, ValueError):
    """A run's events cannot be folded: an impossible sequence, an unknown type, bad data.

    Also a ``ValueError``, as :func:`runtime.fsm.apply` raised before it had a type.
    ``where`` (``event at seq 5: …``) is the short form a wrapping message quotes.
    """

    def __init__(self, run_id: str | None, seq: int, problem: str) -> None:
        run = f"run {run_id}" if run_id else "a run"
        shown = run_id or "RUN"
        super().__init__(
            f"{run}: the event at seq {seq} cannot follow the state before it ({problem}); "
            "the log was edited or written by a build this one cannot read: read it with "
            f"`ratchet runs events {shown}`, run a worker of the build that wrote it, "
            "or start the run again",
        )
        self.run_id, self.seq, self.problem = run_id, seq, problem
        self.where = f"event at seq {seq}: {problem}"


class NotStorable(RatchetError, ValueError):
    """A value cannot be stored as JSON (runtime/json_values.py); ``problem`` says why.

    Also a ``ValueError``: what ``json`` raised for most of the same values.
    """

    def __init__(self, problem: str) -> None:
        super().__init__(problem, problem)
        self.problem = problem


class SnapshotError(RatchetError):
    """A snapshot document cannot be used."""


class SnapshotMalformed(SnapshotError):
    def __init__(self, where: str, problem: str) -> None:
        super().__init__(
            f"{where} is not a ratchet snapshot: {problem}; a worker sets it aside and "
            "rebuilds the run from its events, so there is nothing to do unless that fails "
            "too (`ratchet runs events` then shows them)",
            where,
            problem,
        )


class SnapshotWrongKind(SnapshotError):
    def __init__(self, where: str, found: str, expected: str) -> None:
        super().__init__(
            f"{where} is a `{found}` document, not a `{expected}` one: "
            "point the snapshot store at ratchet's snapshot directory, not another file",
            where,
            found,
            expected,
        )


class SnapshotUnsupportedVersion(SnapshotError):
    def __init__(self, where: str, found: object, readable: str) -> None:
        super().__init__(
            f"{where} declares snapshot format version `{found}`; this build reads {readable}: "
            "upgrade ratchet on this worker to the version that wrote it",
            where,
            found,
            readable,
        )


class SnapshotTooLarge(SnapshotError):
    def __init__(self, run_id: str, size: int, limit: int) -> None:
        super().__init__(
            f"run {run_id}: snapshot is {size} bytes, over the {limit}-byte limit; "
            "the run's transcript is too large to checkpoint — lower max_turns or "
            "make tools return less",
            run_id,
            size,
            limit,
        )


class StoreUrlInvalid(RatchetError, ValueError):
    """A store URL that no backend can open as written; its password is never shown.

    Also a ``ValueError``, as the store openers raised before it had a type.
    """

    def __init__(self, url: str, problem: str) -> None:
        url, problem = redacted(url), redacted(problem)  # the arguments a pickle carries too
        super().__init__(
            f"store URL {url} cannot be opened: {problem}; correct the "
            "setting (RATCHET_SNAPSHOT_STORE, RATCHET_RUN_STORE or RATCHET_REDIS_PREFIX) "
            "and start again",
            url,
            problem,
        )
        self.problem = problem


class StoreError(RatchetError):
    """A store backend failed. Backends translate their own errors into these.

    A message never shows a password: one in a URL, or a ``password=`` query value,
    is masked (:func:`redacted`) whatever the backend put in it.
    """

    def __init__(self, message: str, *args: Any) -> None:
        super().__init__(redacted(message), *args)


class StoreUnavailable(StoreError):
    """The backend could not be reached; ``run_id`` is the run the call was for, if one."""

    def __init__(self, store: str, problem: str, run_id: str | None = None) -> None:
        store, problem = redacted(store), redacted(problem)  # the arguments a pickle carries too
        super().__init__(
            f"{_of_run(run_id)}{store} is unavailable: {problem}; check that it is running "
            "and reachable"
            + (f", then `ratchet runs resume {run_id}` if the run stalled" if run_id else ""),
        )
        self.store, self.problem, self.run_id = store, problem, run_id

    def for_run(self, run_id: str) -> StoreUnavailable:
        """The same error, naming the run the failed call was for."""
        return StoreUnavailable(self.store, self.problem, run_id)


class StoreBusy(StoreUnavailable):
    """Every connection of this process's pool stayed in use for the whole wait.

    The server may be fine: more calls use the store at once than the pool allows.
    """

    def __init__(
        self, store: str, max_connections: int, waited_s: float, run_id: str | None = None
    ) -> None:
        store = redacted(store)
        StoreError.__init__(
            self,
            f"{_of_run(run_id)}{store}: all {max_connections} pooled connections stayed busy "
            f"for {waited_s:g} s; this process makes more store calls at once than its pool "
            "allows — add `?max_connections=N` to the store URL (N above the worker's "
            "concurrency) or lower the concurrency",
            store,
            max_connections,
            waited_s,
            run_id,
        )
        self.store, self.max_connections, self.waited_s = store, max_connections, waited_s
        self.problem, self.run_id = "every pooled connection stayed busy", run_id

    def for_run(self, run_id: str) -> StoreBusy:
        return StoreBusy(self.store, self.max_connections, self.waited_s, run_id)


class StaleWrite(StoreError):
    def __init__(self, run_id: str, expected_seq: int | None, found_seq: int | None) -> None:
        super().__init__(
            f"run {run_id}: write expected seq {expected_seq} but the store holds "
            f"{found_seq}; another worker advanced the run — this write is dropped, and there is "
            "nothing to do: the newer write stands",
        )
        self.run_id, self.expected_seq, self.found_seq = run_id, expected_seq, found_seq


class LeaseLost(StoreError):
    def __init__(self, run_id: str, owner: str) -> None:
        super().__init__(
            f"run {run_id}: worker {owner} no longer holds the run's lease "
            "(it expired and another worker may have taken over); stopping without writing — "
            "nothing to do: the lease holder, or the sweeper after it, carries the run on",
        )
        self.run_id, self.owner = run_id, owner


class NotReplicated(StoreError):
    """A journal entry the run store wrote on its primary, acknowledged by fewer replicas
    than its URL's ``min_replicas`` within ``replica_timeout_ms`` (``acked`` None: the
    reply was lost, so no acknowledgement is known). A failover now could lose it, so
    the call it journals must not start (store/replicas.py)."""

    def __init__(
        self, run_id: str, store: str, acked: int | None, needed: int, timeout_ms: int
    ) -> None:
        store = redacted(store)
        heard = (
            "its reply was lost, so no replica's acknowledgement is known"
            if acked is None
            else f"{acked} of the {needed} replica(s) it requires acknowledged it within "
            f"{timeout_ms} ms"
        )
        super().__init__(
            f"run {run_id}: {store} wrote the call's journal entry, but {heard} "
            f"(min_replicas={needed}); a failover now could lose the entry and run the call "
            "twice, so it was not started — bring the replicas back (`INFO replication` on "
            f"the primary lists them), then `ratchet runs resume {run_id}`",
        )
        self.run_id, self.store, self.acked = run_id, store, acked
        self.needed, self.timeout_ms = needed, timeout_ms


class SnapshotFailed(RatchetError):
    def __init__(self, run_id: str, seq: int, problem: str) -> None:
        super().__init__(
            f"run {run_id}: checkpoint at seq {seq} could not be saved ({problem}); "
            f"the run stays at its previous state — fix the store, then "
            f"`ratchet runs resume {run_id}`",
            run_id,
            seq,
            problem,
        )
        self.run_id, self.seq = run_id, seq


class RejectedEntryNotFound(RatchetError):
    def __init__(self, entry_id: str) -> None:
        super().__init__(
            f"no rejected message {entry_id!r}; `ratchet rejected list` shows the ids", entry_id
        )


class ConfigInvalid(RatchetError):
    """A setting is wrong; the message is one line naming the variable, the problem, the fix."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(message, variable, message)
        self.variable = variable


class ClockSkewed(RatchetError):
    """This host's clock is further from the run store's than ``RATCHET_MAX_CLOCK_SKEW_S``."""

    def __init__(self, offset_ms: int, max_s: float, source: str) -> None:
        way = "ahead of" if offset_ms < 0 else "behind"
        super().__init__(
            f"this host's clock is {abs(offset_ms) / 1000:.1f} s {way} the run store's "
            f"({source}), past RATCHET_MAX_CLOCK_SKEW_S={max_s:g}; sync this host's clock "
            "(chrony, systemd-timesyncd), or raise the bound (docs/recovery.md)",
            offset_ms,
            max_s,
            source,
        )
        self.offset_ms, self.max_s, self.source = offset_ms, max_s, source


class ExtraMissing(RatchetError):
    """A command needs an optional extra: names the missing module and the install line."""

    def __init__(self, extra: str, module: str | None) -> None:
        super().__init__(
            f"this needs the `{extra}` extra ({module or 'a module'} is missing): "
            f"pip install 'ratchet[{extra}]'",
        )
        self.extra, self.module = extra, module


class StartConflict(RatchetError):
    def __init__(self, run_id: str, differs: str) -> None:
        super().__init__(
            f"run {run_id} already exists with another {differs}: a start with the same run id "
            "or idempotency key must repeat the same agent and input; use a new key for a new "
            f"run (`ratchet runs show {run_id}` shows the existing one)",
        )
        self.run_id, self.differs = run_id, differs


class RunNotQueued(RatchetError):
    def __init__(self, run_id: str, problem: str) -> None:
        super().__init__(
            f"run {run_id} is recorded but its first turn could not be queued ({problem}); "
            "it starts by itself once the broker is back (the crash sweeper, "
            "`celery -A worker beat`, queues it), "
            f"or stop it with `ratchet runs cancel {run_id}`",
        )
        self.run_id, self.problem = run_id, problem


class AnswerNotQueued(RatchetError):
    def __init__(self, run_id: str, seq: int, problem: str) -> None:
        super().__init__(
            f"run {run_id}: the answer is recorded (seq {seq}) but its next turn could not be "
            f"queued ({problem}); the run goes on by itself once the broker is back (the crash "
            f"sweeper, `celery -A worker beat`, queues it), or `ratchet runs resume {run_id}` then",
        )
        self.run_id, self.seq, self.problem = run_id, seq, problem


class ToolModuleChanged(RatchetError):
    def __init__(self, module: str, path: str, worker: str) -> None:
        super().__init__(self.naming("RUN", module, path, worker))
        self.module, self.path, self.worker = module, path, worker

    @staticmethod
    def naming(run_id: str, module: str, path: str, worker: str) -> str:
        """The message, with the resume command for ``run_id`` (the loader knows no run)."""
        return (
            f"tool module `{module}` ({path}) changed on disk after worker {worker} "
            "imported it, and a module cannot be re-imported safely: "
            "restart that worker so it loads the module as it is now, "
            f"then resume the run (`ratchet runs resume {run_id}`)"
        )

    def for_run(self, run_id: str) -> str:
        return self.naming(run_id, self.module, self.path, self.worker)


class MessageRefused(RatchetError):
    """A task message that is not its task's: an argument missing, unknown or of the wrong
    type, a run id that is not one, a format version this release does not read.

    A worker sets such a message aside with ``problem`` as its reason; a sender gets it
    before anything is sent.
    """

    def __init__(self, task: str, problem: str) -> None:
        super().__init__(
            f"{task} message refused: {problem}; nothing was sent or run: correct the message "
            "(docs/celery.md lists each task's fields)",
        )
        self.task, self.problem = task, problem
