"""Non-idempotent tools with probes that answer each way, for the probe and parallel tests.

Every effect appends ``KEY LABEL`` to ``RATCHET_TEST_EFFECTS`` (default: the
example ledger's path plus ``.effects``), so a test can
count each call's effects by its idempotency key. ``RATCHET_TEST_HANG_LABEL``
makes the call with that label hang before its effect (in the worker that is
about to be killed only); ``RATCHET_TEST_SLOW_LABEL`` makes it slow to return
*after* its effect (``RATCHET_TEST_SLOW_S``, default 1). ``RATCHET_TEST_TIMES`` gets ``LABEL START END``
(``time.time()``) for every ``timed_effect``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from runtime import NotRun, Ran, ToolContext, Unknown, tool
from runtime.probes import ProbeResult


def _effects() -> Path:
    """``RATCHET_TEST_EFFECTS``, else beside the example ledger (what the crash rig sets)."""
    path = os.environ.get("RATCHET_TEST_EFFECTS")
    if path:
        return Path(path)
    return Path(os.environ.get("RATCHET_EXAMPLE_LEDGER", ".ratchet/refunds.ledger") + ".effects")


def invocations(path: Path) -> list[tuple[str, str]]:
    """The effect log at ``path`` as (idempotency key, label), a line per invocation."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [(key, label) for key, _, label in (line.partition(" ") for line in lines)]


def assert_invoked_once_each(path: Path, labels: list[str], why: object) -> None:
    """The effect log at ``path`` holds each invocation once (no key twice: ``why`` said if
    one is), and they are of ``labels``: none lost."""
    keys = [key for key, _ in invocations(path)]
    assert len(keys) == len(set(keys)), (why, invocations(path))
    assert sorted(label for _, label in invocations(path)) == sorted(labels)


def _do(label: str, call: ToolContext) -> dict[str, object]:
    if os.environ.get("RATCHET_TEST_HANG_LABEL") == label:
        time.sleep(120)
    with _effects().open("a", encoding="utf-8") as handle:
        handle.write(f"{call.idempotency_key} {label}\n")
        handle.flush()
        os.fsync(handle.fileno())
    if os.environ.get("RATCHET_TEST_SLOW_LABEL") == label:
        time.sleep(float(os.environ.get("RATCHET_TEST_SLOW_S", "1")))  # done, but slow to say so
    return {"done": label}


def look_up_effect(call: ToolContext) -> ProbeResult:
    """The truthful probe: the effect log either has the call's key or it does not."""
    path = _effects()
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        key, label = line.split(" ", 1)
        if key == call.idempotency_key:
            return Ran({"done": label, "found_by": "probe"})
    return NotRun()


def cannot_tell(label: str) -> ProbeResult:
    return Unknown(f"the ledger for {label} is offline")


def breaks(label: str) -> ProbeResult:
    raise RuntimeError("the ledger API answered 500")


def hangs(label: str) -> ProbeResult:
    time.sleep(120)
    return NotRun()


@tool(probe=look_up_effect)
def effect(label: str, call: ToolContext) -> dict[str, object]:
    """An effect whose probe can always tell whether it happened."""
    return _do(label, call)


@tool(probe=cannot_tell)
def effect_unknown(label: str, call: ToolContext) -> dict[str, object]:
    """An effect whose probe answers unknown."""
    return _do(label, call)


@tool(probe=breaks)
def effect_probe_raises(label: str, call: ToolContext) -> dict[str, object]:
    """An effect whose probe raises."""
    return _do(label, call)


@tool(probe=hangs)
def effect_probe_hangs(label: str, call: ToolContext) -> dict[str, object]:
    """An effect whose probe never answers in time."""
    return _do(label, call)


@tool
def effect_unprobed(label: str, call: ToolContext) -> dict[str, object]:
    """The same effect with no probe: an unknown outcome parks the run."""
    return _do(label, call)


@tool(idempotent=True)
def timed_effect(label: str, sleep_s: float) -> dict[str, object]:
    """Sleep, and note when it started and finished."""
    started = time.time()
    time.sleep(sleep_s)
    finished = time.time()
    with Path(os.environ["RATCHET_TEST_TIMES"]).open("a", encoding="utf-8") as handle:
        handle.write(f"{label} {started} {finished}\n")
    return {"label": label, "slept_s": sleep_s}


JOURNALED: list[Callable[[str], bool]] = []
"""Set by a test that runs in this process: whether the call labelled so has its outcome
journaled. :func:`finishes_after` waits for that: a call that returned is journaled a moment
later, by the turn, so waiting for the call's own return would leave the order to the
scheduler."""


@tool(idempotent=True)
def finishes_after(label: str, after: str = "") -> dict[str, object]:
    """Return once the call labelled ``after`` has its outcome journaled (``JOURNALED``): the
    calls of one response are journaled in the order a test chooses, however loaded the
    machine."""
    deadline = time.monotonic() + 20
    while after and not JOURNALED[-1](after):
        if time.monotonic() > deadline:
            raise RuntimeError(f"call {after!r} was never journaled")
        time.sleep(0.01)
    return {"label": label}


@tool
def send_refund_unprobed(order_id: str, amount_cents: int, call: ToolContext) -> dict[str, object]:
    """The example's keyed refund without its probe: an unknown outcome parks the run."""
    from examples.refunds import send_refund

    return send_refund(order_id, amount_cents, call)
