"""The snapshot document, format version 1.

A snapshot is a JSON document a person can read: sorted keys, two-space
indent, a trailing newline, a ``kind`` and a format ``version``, unknown
fields refused, at most 16 MiB. Every version ever written stays decodable:
a golden file of each lives in ``tests/golden/`` and is decoded on every run.

::

    {
      "kind": "ratchet.snapshot",
      "run": { ...RunState... },
      "version": 1
    }
"""

from __future__ import annotations

import json
from typing import Final, Literal

from pydantic import ValidationError

from runtime.errors import (
    SnapshotMalformed,
    SnapshotTooLarge,
    SnapshotUnsupportedVersion,
    SnapshotWrongKind,
)
from runtime.models import RunState, Strict

KIND: Final = "ratchet.snapshot"
VERSION = 1
READABLE_VERSIONS = (1,)
MAX_BYTES = 16 * 1024 * 1024


class SnapshotV1(Strict):
    kind: Literal["ratchet.snapshot"] = KIND
    version: Literal[1] = 1
    run: RunState


def encode(state: RunState, max_bytes: int = MAX_BYTES) -> bytes:
    """The document for ``state``; raises SnapshotTooLarge over ``max_bytes``."""
    document = SnapshotV1(run=state).model_dump(mode="json")
    data = (json.dumps(document, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()
    if len(data) > max_bytes:
        raise SnapshotTooLarge(state.run_id, len(data), max_bytes)
    return data


def decode(data: bytes, where: str, max_bytes: int = MAX_BYTES) -> RunState:
    """Read a snapshot document, refusing anything that is not one this build reads."""
    if len(data) > max_bytes:
        raise SnapshotMalformed(where, f"{len(data)} bytes is over the {max_bytes}-byte limit")
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotMalformed(where, f"not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise SnapshotMalformed(where, "the document is not a JSON object")
    kind = value.get("kind")
    if kind != KIND:
        raise SnapshotWrongKind(where, str(kind), KIND)
    version = value.get("version")
    if version not in READABLE_VERSIONS:
        readable = ", ".join(f"`{v}`" for v in READABLE_VERSIONS)
        raise SnapshotUnsupportedVersion(where, version, readable)
    try:
        return SnapshotV1.model_validate(value).run
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        problem = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise SnapshotMalformed(where, f"`{loc}`: {problem}") from exc
