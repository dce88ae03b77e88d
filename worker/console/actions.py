"""The console's actions: each one is the CLI command's call into :class:`worker.api.Ratchet`.

A form's fields are the command's options; refusals are the API's own errors,
shown with the CLI's wording (one line, ``ratchet: …``), and the outcome line is
the one the CLI prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from runtime.errors import InvalidOption
from worker.api import Ratchet

Form = Mapping[str, str]


def refusal_line(exc: BaseException) -> str:
    """What ``ratchet`` prints on stderr for this refusal (worker/cli.py ``refusals``)."""
    return "ratchet: " + " ".join(str(exc).split())


def _field(form: Form, name: str) -> str | None:
    value = form.get(name)
    return value if value not in (None, "") else None


def _seq(form: Form) -> int | None:
    value = _field(form, "suspension_seq")
    if value is None:
        return None
    if not value.isdigit():
        raise InvalidOption(f"suspension_seq {value!r} is not a seq number")
    return int(value)


def _continue(run_id: str, form: Form, answer: Callable[..., str]) -> str:
    """``ratchet runs continue``, and the lines it prints: ``answer`` is the API's
    ``continue_run`` given the run and the answer; the form names the suspension."""
    cid = form.get("continuation_id") or None
    outcome = answer(continuation_id=cid, suspension_seq=_seq(form))
    if outcome == "duplicate":
        return f"run {run_id}: continuation {cid or ''} was already applied; nothing to do"
    return f"run {run_id}: continued ({cid or ''}); its next turn is queued"


def answer(api: Ratchet, run_id: str, form: Form) -> str:
    return _continue(run_id, form, partial(api.continue_run, run_id, input=form.get("input", "")))


def approve(api: Ratchet, run_id: str, form: Form) -> str:
    return _continue(run_id, form, partial(api.continue_run, run_id, approve=True))


def deny(api: Ratchet, run_id: str, form: Form) -> str:
    return _continue(run_id, form, partial(api.continue_run, run_id, deny=form.get("reason", "")))


def cancel(api: Ratchet, run_id: str, form: Form) -> str:
    record = api.cancel(run_id, _field(form, "reason"))
    return f"run {run_id}: {record.status.value}"


def resume(api: Ratchet, run_id: str, form: Form) -> str:
    status = api.resume(run_id)
    return f"run {run_id} ({status}): resume enqueued"


def reconcile_arguments(form: Form) -> tuple[str, str, Any, str | None]:
    """call id, decision, result, reason: ``ratchet runs reconcile``'s checks, in its words."""
    call_id = form.get("call_id", "")
    decision = form.get("decision", "")
    if decision not in ("result", "retry", "fail"):
        raise InvalidOption("give exactly one of --result JSON, --retry or --fail REASON")
    result: Any = None
    if decision == "result":
        try:
            result = json.loads(form.get("result", ""))
        except json.JSONDecodeError as exc:
            raise InvalidOption(f"--result is not valid JSON: {exc}") from exc
    reason = form.get("reason") if decision == "fail" else None
    return call_id, decision, result, reason


def reconcile(api: Ratchet, run_id: str, form: Form) -> str:
    call_id, decision, result, reason = reconcile_arguments(form)
    api.reconcile(run_id, call_id, decision, result=result, reason=reason)
    return f"run {run_id}: call {call_id} reconciled ({decision}); the run goes on"


@dataclass(frozen=True)
class Action:
    title: str
    """The button, and the question the confirmation asks."""
    perform: Callable[[Ratchet, str, Form], str]
    fields: tuple[str, ...]
    """The form fields carried from the run page through the confirmation."""
    danger: bool = False


ACTIONS: dict[str, Action] = {
    "answer": Action("Send this answer", answer, ("input", "suspension_seq", "continuation_id")),
    "approve": Action("Approve the tool call", approve, ("suspension_seq", "continuation_id")),
    "deny": Action(
        "Deny the tool call", deny, ("reason", "suspension_seq", "continuation_id"), True
    ),
    "cancel": Action("Cancel the run", cancel, ("reason",), True),
    "resume": Action("Resume the run", resume, ()),
    "reconcile": Action(
        "Reconcile the open call", reconcile, ("call_id", "decision", "result", "reason")
    ),
}


def perform(api: Ratchet, name: str, run_id: str, form: Form) -> str:
    """Do the action; its outcome line. Raises what the API raises (RatchetError; ratchet raises no bare ValueError)."""
    return ACTIONS[name].perform(api, run_id, form)


def carried(name: str, form: Form) -> dict[str, str]:
    """The fields of ``form`` that action ``name`` takes, for the confirmation page."""
    return {k: form.get(k, "") for k in ACTIONS[name].fields}
