"""A turn's first write, sent with its lease: the model call journaled in the round trip
that takes the run.

Most turns begin where this process left the run: its last checkpoint released the
lease and chained this very turn (tasks/held_run.py), and it remembers the state and
the record it wrote then (:meth:`~tasks.context.Context.last_checkpoint`). From that
state the turn's first step is known before the lease is taken: :func:`runtime.fsm.decide`
says call the model, and when no cap or rate needs the limit store the call may go. So
is the turn's first write, the ``model.requested`` that counts the attempt before the
call is made. :func:`journal_ahead` prepares that write; :func:`tasks.lease.holding`
sends it with the lease (:meth:`~store.runs.RunStore.acquire_and_append`), fenced by the
lease just taken, the seq the message expects and the record remembered (no other run
has had the id since). Refused by any fence, nothing is written and the turn goes on as
any other: lease, load, decide, journal.

Nothing is decided on anything but the run's state at the seq the message expects,
which the fences prove is the stored one: the same decision, the same event, one round
trip fewer.
"""

from __future__ import annotations

from runtime.actions import CallModel
from runtime.errors import RatchetError
from runtime.fsm import decide, ends_turn, model_requested
from tasks import limits
from tasks.context import Context
from tasks.held_run import Ahead, stopping
from tasks.persistence import transition


def journal_ahead(ctx: Context, run_id: str, expected_seq: int | None) -> Ahead | None:
    """The turn's first write, when it is known before the lease is taken (see the module
    docstring); None when the turn must load and decide under its lease first."""
    if expected_seq is None or stopping():
        return None
    kept = ctx.last_checkpoint(run_id)
    if kept is None:
        return None
    state, was = kept
    if state.seq != expected_seq or was.last_seq != expected_seq or not state.status.is_live:
        return None
    try:
        agent = ctx.agent(state.agent_file)
    except (RatchetError, OSError):
        return None  # the turn meets it under its lease, and stalls saying why
    action = decide(state, agent, ctx.runs.clock())
    if not isinstance(action, CallModel) or ends_turn(action, False):
        return None
    gate = limits.unlimited(ctx, agent, state)
    if gate is None:
        return None
    request = action.request(ctx.request_order(run_id))
    prepare = getattr(agent.provider, "prepare", None)
    if callable(prepare):
        prepare()  # as the turn would before admitting the call
    change = transition(ctx, state, [model_requested(request.model_call + 1)])
    return Ahead(state, was, agent, action, request, gate, change)
