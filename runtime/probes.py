"""Idempotency keys and outcome probes: what happens to a call whose outcome is unknown.

A tool call journaled as ``tool.requested`` with no outcome was cut short — by a
crash, or by its own timeout — and may or may not have had its effect. The rule
for such a call, per call, pure:

==================  ===========================================================
idempotent tool     run it again (``@tool(idempotent=True)``)
tool with a probe   ask the probe (``@tool(probe=...)``): ``Ran(result)`` records
                    the result as the call's outcome, ``NotRun()`` runs the call
                    now, ``Unknown(why)`` — or a probe that raises or outlives
                    the agent's ``probe_timeout_s`` — parks the run
any other tool      park the run for an operator (``ratchet runs reconcile``)
==================  ===========================================================

Every probe's answer is journaled as ``tool.probed``; ``ran`` is the call's
outcome (the fold records its result, as ``tool.completed`` would), every
other answer leaves the call requested with no outcome, so a crash after it
asks the probe again. A probe only ever *asks* (a ledger, a payment API, a
ticket search): it never runs the effect itself.

The idempotency key a tool receives (``ToolContext.idempotency_key``) is a
hash of the run id, the model turn that asked for the call and the call id:
the same on every attempt and on every worker that takes the run over, and
different for every call — also when a provider reuses call ids from one
response to the next. A tool passes it to an API that deduplicates on it (a
payment provider's ``Idempotency-Key`` header), and its probe asks that API
about it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from runtime.json_values import without_surrogates

MAX_PROGRESS_CHARS = 1000
"""The longest progress message a tool's ``progress`` keeps (the rest is cut)."""
KEY_PREFIX = "ratchet-"
"""Keys read ``ratchet-`` and 40 hex digits: under the 64 or 255 characters APIs accept."""


def idempotency_key(run_id: str, turn: int, call_id: str) -> str:
    """The stable key of call ``call_id`` that model turn ``turn`` (1-based) of ``run_id`` asked for."""
    digest = hashlib.sha256(f"ratchet.tool-call\0{run_id}\0{turn}\0{call_id}".encode()).hexdigest()
    return KEY_PREFIX + digest[:40]


@dataclass(frozen=True)
class ToolContext:
    """What a tool may ask the runtime for: declare a parameter of this type.

    ::

        @tool(probe=find_refund)
        def issue_refund(order_id: str, amount_cents: int, call: ToolContext) -> dict:
            return payments.refund(order_id, amount_cents, idempotency_key=call.idempotency_key)

    The parameter is not part of the tool's JSON schema: the model never sees or sets it.
    """

    run_id: str
    call_id: str
    idempotency_key: str
    """The same on every attempt of this call, on every worker; different for every call."""
    reporter: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    """Where :meth:`progress` goes (tasks/live.py); None where nothing carries it."""

    def progress(self, message: str) -> None:
        """Tell whoever watches the run how the call is going: ``call.progress("fetched 3
        of 10 pages")``. Shown live by ``ratchet runs watch`` and the console; never
        journaled, never part of the run's state, and dropped rather than ever slowing
        or failing the call. At most :data:`MAX_PROGRESS_CHARS` characters are kept."""
        if self.reporter is None:
            return
        text = message if isinstance(message, str) else repr(message)
        self.reporter(without_surrogates(text[:MAX_PROGRESS_CHARS]))


@dataclass(frozen=True)
class Ran:
    """The probe found the call's effect: ``result`` becomes its outcome, as if it returned it."""

    result: Any = None


@dataclass(frozen=True)
class NotRun:
    """The probe is sure the call had no effect: it is run now."""


@dataclass(frozen=True)
class Unknown:
    """The probe cannot tell: the run is parked for an operator, with ``why`` in the reason."""

    why: str = ""


ProbeResult = Ran | NotRun | Unknown
"""What a probe returns."""


class Answer(StrEnum):
    """A probe's answer as journaled in ``tool.probed``."""

    RAN = "ran"
    NOT_RUN = "not_run"
    UNKNOWN = "unknown"
    FAILED = "failed"
    """The probe raised, or returned something that is not a :data:`ProbeResult`."""
    TIMED_OUT = "timed_out"
    """The probe did not answer within the agent's ``probe_timeout_s``."""


class Rule(StrEnum):
    """What a call whose outcome is unknown gets, by its tool."""

    RERUN = "rerun"
    PROBE = "probe"
    PARK = "park"


def unknown_outcome_rule(idempotent: bool, has_probe: bool) -> Rule:
    """The rule for a call cut short; an unknown tool (``idempotent=False``, no probe) parks."""
    if idempotent:
        return Rule.RERUN
    return Rule.PROBE if has_probe else Rule.PARK


@dataclass(frozen=True)
class Probed:
    """A probe's answer, ready to journal."""

    answer: Answer
    result: Any = None
    """The call's result when ``answer`` is ``ran``."""
    detail: str = ""
    """Why, for every answer but ``ran`` and ``not_run``; for ``ran``, why its result is an
    error result instead (it could not be stored: runtime/json_values.py)."""

    @property
    def resolves(self) -> bool:
        """The answer decides the call: ``ran`` records it, ``not_run`` runs it."""
        return self.answer in (Answer.RAN, Answer.NOT_RUN)


def probed_event(call_id: str, name: str, probed: Probed) -> tuple[str, dict[str, Any]]:
    data: dict[str, Any] = {"call_id": call_id, "name": name, "answer": probed.answer.value}
    if probed.answer == Answer.RAN and probed.detail:
        data["error"] = probed.detail  # it ran, and its result could not be stored
    elif probed.answer == Answer.RAN:
        data["result"] = probed.result
    elif probed.detail:
        data["detail"] = probed.detail
    return ("tool.probed", data)


def park_cause(probed: Probed | None, timed_out_s: float | None) -> str:
    """How a parked call's reason says why its outcome is unknown and stays unknown."""
    cause = (
        f"did not return within {timed_out_s:g} s and was abandoned"
        if timed_out_s is not None
        else "was in flight when a worker stopped"
    )
    if probed is None:
        return f"{cause} and is not idempotent, so it may or may not have run"
    said = {
        # A probe said so after each earlier try, but the call is out of tries and the
        # last one, abandoned too, may yet take effect.
        Answer.NOT_RUN: "answered not run, but the call was out of tries",
        Answer.UNKNOWN: "answered unknown",
        Answer.FAILED: "failed",
        Answer.TIMED_OUT: "did not answer in time",
    }[probed.answer]
    detail = f" ({probed.detail})" if probed.detail else ""
    return f"{cause}, and its probe {said}{detail}, so it may or may not have run"
