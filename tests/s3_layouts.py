"""What the S3 snapshot store's tests and bench/s3_loads.py share: a counter of the HTTP
requests a store's client sends, and a writer of the layout ratchet stored before heads
named their transcript objects (one object per save, found by listing).

The writer repeats, on the store's own primitives, what ``S3SnapshotStore._put_parts``
did before paths existed, so a store written by that release can be made on demand and
loaded by this one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from runtime.errors import StaleWrite
from runtime.models import RunState
from store.packing import pack
from store.snapshots import EMPTY_TIP
from store.snapshots.s3 import HASH_DIGITS, S3SnapshotStore, _frame


@contextmanager
def requests_sent(store: S3SnapshotStore) -> Iterator[Counter[str]]:
    """Counts, by operation (``GetObject``, ``ListObjectsV2``, …), the HTTP requests the
    store's client sends inside the block: botocore's ``before-send`` fires once per
    request on the wire, retries included."""
    sent: Counter[str] = Counter()

    def count(event_name: str, **_: Any) -> None:
        sent[event_name.rsplit(".", 1)[-1]] += 1

    events = store._client.meta.events
    events.register("before-send.s3", count, unique_id="ratchet-test-requests-sent")
    try:
        yield sent
    finally:
        events.unregister("before-send.s3", unique_id="ratchet-test-requests-sent")


def save_before_paths(store: S3SnapshotStore, state: RunState, expected_seq: int | None) -> None:
    """Save ``state`` as the release before paths did: one object holding the save's new
    messages, then a head naming the transcript's tip but no path."""
    run_id = state.run_id
    parts = store.plan_save(state, expected_seq)
    found = store._read_head(run_id)
    if (found.seq if found else None) != expected_seq:
        raise StaleWrite(run_id, expected_seq, found.seq if found else None)
    if parts.fragments:
        before = parts.base if parts.base is not None else EMPTY_TIP
        key = (
            f"{store._transcript_prefix(run_id)}{before.length:010d}-{parts.tip.length:010d}-"
            f"{before.chain[:HASH_DIGITS]}-{parts.tip.chain[:HASH_DIGITS]}"
        )
        store._put_object(key, pack(_frame(parts.fragments)))
    meta = {
        "form": "parts",
        "seq": parts.seq,
        "length": parts.tip.length,
        "size": parts.tip.size,
        "chain": parts.tip.chain,
    }
    store._write_head(run_id, found, meta, parts.head)
    store.planned_save_written(state, parts)
