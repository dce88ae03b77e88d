"""The snapshot document, format version 2.

A snapshot is a JSON document a person can read: sorted keys, two-space
indent, a trailing newline, a ``kind`` and a format ``version``, unknown
fields refused, at most 16 MiB. Every version ever written stays decodable:
a golden file of each lives in ``tests/golden/`` and is decoded on every run.

::

    {
      "kind": "ratchet.snapshot",
      "run": { ...RunState... },
      "version": 2
    }

Versions:

- **1** — the run's one open tool call as ``run.in_flight`` (a call id or null).
- **2** — parallel tool calls: ``run.running``, the list of call ids journaled
  as requested with no outcome, in request order; ``in_flight`` is gone. A
  format-1 document reads as format 2 with ``running`` holding its ``in_flight``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from runtime import json_values
from runtime.errors import (
    NotStorable,
    SnapshotMalformed,
    SnapshotTooLarge,
    SnapshotUnsupportedVersion,
    SnapshotWrongKind,
)
from runtime.memo import IdentityMemo
from runtime.models import Message, RunState, Strict

KIND: Final = "ratchet.snapshot"
READABLE_VERSIONS = (1, 2)
"""The versions this build decodes; it writes the newest (2: parallel tool calls), and
upgrades a format-1 document on load."""
MAX_BYTES = 16 * 1024 * 1024


class SnapshotV2(Strict):
    kind: Literal["ratchet.snapshot"] = KIND
    version: Literal[2] = 2
    run: RunState


class SnapshotV1(Strict):
    """Read only: ``run`` is upgraded to format 2 (:func:`_upgrade_v1`) before it is validated."""

    kind: Literal["ratchet.snapshot"] = KIND
    version: Literal[1] = 1
    run: RunState


def _upgrade_v1(value: dict[str, object], where: str) -> dict[str, object]:
    """A format-1 document's fields as format 2 names them: ``in_flight`` becomes ``running``."""
    run = value.get("run")
    if isinstance(run, dict) and "running" in run:
        raise SnapshotMalformed(where, "`run.running`: unknown field (format 2 has it)")
    if not isinstance(run, dict) or "in_flight" not in run:
        return value
    run = dict(run)
    in_flight = run.pop("in_flight")
    run["running"] = [] if in_flight is None else [in_flight]
    return {**value, "run": run}


def encode(state: RunState, max_bytes: int = MAX_BYTES) -> bytes:
    """The document for ``state``; raises SnapshotTooLarge over ``max_bytes``, NotStorable
    for a value :func:`decode` would not read back (runtime/json_values.py)."""
    data = _document(_plain(SnapshotV2(run=state)))
    if len(data) > max_bytes:
        raise SnapshotTooLarge(state.run_id, len(data), max_bytes)
    return data


def _plain(model: BaseModel, exclude: set[str] | None = None) -> dict[str, Any]:
    """``model.model_dump(mode="json")``; a lone surrogate in an object's key, which pydantic
    cannot encode there, is U+FFFD (as in a value: :func:`_document`)."""
    try:
        return model.model_dump(mode="json", exclude=exclude)
    except (PydanticSerializationError, UnicodeEncodeError):
        clean = type(model).model_validate(json_values.replaced(model.model_dump()))
        return clean.model_dump(mode="json", exclude=exclude)


def _document(value: object, end: str = "\n") -> bytes:
    """``value`` as :func:`pretty` writes it, in UTF-8, by the rules of the store's codec
    (runtime/json_values.py): a lone surrogate is written as U+FFFD and NaN or an infinity
    as null (as they are read back); an integer Python cannot write as text is NotStorable."""
    try:
        return (pretty(value, allow_nan=False) + end).encode()
    except (UnicodeEncodeError, ValueError) as exc:
        if not isinstance(exc, UnicodeEncodeError) and "Out of range float" not in str(exc):
            raise NotStorable(f"a snapshot cannot hold it ({exc})"[:200]) from None
        return (pretty(json_values.canonical(value), allow_nan=False) + end).encode()
    except (TypeError, RecursionError) as exc:
        raise NotStorable(f"a snapshot cannot hold it ({type(exc).__name__})") from None


def pretty(value: object, *, allow_nan: bool = True) -> str:
    """``json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False)``, the same text, faster.

    Python's indenting encoder is pure Python (only the compact one is in C), and a
    checkpoint encodes the snapshot's head every time: this walks the value once,
    joining strings, and leaves each string's escaping to the C function json uses.
    Anything but the JSON types (``model_dump(mode="json")`` gives no other) goes to
    json.dumps itself. The exact types are tried first and the commonest leaves (strings,
    integers, null) written inline: a call per scalar was most of a walk's cost.
    tests/test_pretty_encoding.py checks the two agree.
    """
    out: list[str] = []
    try:
        _pretty(value, "\n", out)
    except _NotPlain:
        return json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=allow_nan)
    return "".join(out)


class _NotPlain(Exception):
    """A value :func:`pretty` leaves to json.dumps."""


_quoted = json.encoder.encode_basestring  # the C function when the _json module is there


def _pretty(value: Any, newline: str, out: list[str]) -> None:
    kind = type(value)
    if kind is dict:
        _pretty_dict(value, newline, out)
    elif kind is str:
        out.append(_quoted(value))
    elif kind is list:
        _pretty_list(value, newline, out)
    elif kind is int:
        out.append(int.__repr__(value))
    else:
        _pretty_other(value, newline, out)


def _pretty_dict(value: dict[Any, Any], newline: str, out: list[str]) -> None:
    if not value:
        out.append("{}")
        return
    try:
        keys = sorted(value)
    except TypeError:
        raise _NotPlain from None  # json.dumps says what it makes of keys of mixed types
    inner = newline + "  "
    separator = "{" + inner
    for key in keys:
        if type(key) is not str and not isinstance(key, str):
            raise _NotPlain  # json.dumps turns numbers and booleans into keys its own way
        entry = value[key]
        kind = type(entry)
        # The commonest leaves inline: a call per scalar is most of the cost of a walk.
        if kind is str:
            out.append(separator + _quoted(key) + ": " + _quoted(entry))
        elif kind is int:
            out.append(separator + _quoted(key) + ": " + int.__repr__(entry))
        elif entry is None:
            out.append(separator + _quoted(key) + ": null")
        else:
            out.append(separator + _quoted(key) + ": ")
            _pretty(entry, inner, out)
        separator = "," + inner
    out.append(newline + "}")


def _pretty_list(value: list[Any] | tuple[Any, ...], newline: str, out: list[str]) -> None:
    if not value:
        out.append("[]")
        return
    inner = newline + "  "
    separator = "[" + inner
    for entry in value:
        if type(entry) is str:
            out.append(separator + _quoted(entry))
        else:
            out.append(separator)
            _pretty(entry, inner, out)
        separator = "," + inner
    out.append(newline + "]")


def _pretty_other(value: Any, newline: str, out: list[str]) -> None:
    # The order of json.encoder's own checks, so subclasses come out as json.dumps puts them.
    if isinstance(value, str):
        out.append(_quoted(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(int.__repr__(value))
    elif isinstance(value, float):
        if value != value or value in (_INFINITY, -_INFINITY):
            raise _NotPlain
        out.append(float.__repr__(value))
    elif isinstance(value, list | tuple):
        _pretty_list(value, newline, out)
    elif isinstance(value, dict):
        _pretty_dict(value, newline, out)
    else:
        raise _NotPlain


_INFINITY = float("inf")


# --- the document in parts: what the appending backends (redis, s3) store ---------
#
# The transcript only grows, so a backend may store the document as a *head*
# (the document with an empty transcript) plus one *fragment* per message: the
# message exactly as it is laid out inside the document. Joining them back is
# byte concatenation, so the reassembled document is byte-identical to
# :func:`encode`, and its size is known without encoding the whole of it.

_SLOT: Final = b'\n    "transcript": []'
"""Where the run's transcript sits in the head. Keys of deeper objects are indented further,
and a key inside a JSON string has its quotes escaped, so this occurs once."""
_INDENT: Final = b"      "
_NEWLINE_INDENTED: Final = "\n" + _INDENT.decode()
GENESIS: Final = "0" * 64
"""The chain hash of an empty transcript."""


def encode_head(state: RunState) -> bytes:
    """The document of ``state`` with an empty transcript (not size-checked)."""
    # What SnapshotV2(run=<state without transcript>) dumps, without copying the state and
    # wrapping it at every checkpoint (tests/test_pretty_encoding.py holds the two equal).
    run = _plain(state, exclude={"transcript"})
    run["transcript"] = []
    return _document({"kind": KIND, "run": run, "version": 2})


def encode_fragment(message: Message) -> bytes:
    """``message`` exactly as :func:`encode` lays it out inside the transcript array.

    A turn measures a new message (the room it leaves in the snapshot), then plans its
    save: the encoding of the last few messages this process made is remembered, by the
    message object (frozen, so its encoding cannot change), and not made again.
    """
    found = _fragments.get(message)
    if found is not None:
        return found
    text = _document(_plain(message), end="")
    fragment = _INDENT + text.replace(b"\n", _NEWLINE_INDENTED.encode())
    _fragments.put(message, fragment)
    return fragment


def remember_fragments(messages: Sequence[Message], fragments: Sequence[bytes]) -> None:
    """Note that each of ``messages`` encodes as the fragment beside it: read from a store
    that keeps the transcript as fragments (and checked there against the stored hash
    chain), so a turn that measures or saves them does not encode them again."""
    for message, fragment in zip(messages, fragments, strict=True):
        _fragments.put(message, fragment)


_fragments: IdentityMemo[Message, bytes] = IdentityMemo(512, 4 * 1024 * 1024, len, threading.Lock())
"""The newest messages' fragments (at most 4 MiB of them; a fragment over a sixteenth of
that is not remembered)."""
os.register_at_fork(after_in_child=lambda: _fragments.renew_lock(threading.Lock()))


def chain(before: str, fragments: Iterable[bytes]) -> str:
    """Fold fragments into a hash chain: equal chains mean equal transcripts (prefix included)."""
    digest = before
    for fragment in fragments:
        digest = hashlib.sha256(digest.encode() + fragment).hexdigest()
    return digest


def document_size(head: bytes, length: int, fragment_bytes: int) -> int:
    """Bytes of the assembled document: ``length`` fragments of ``fragment_bytes`` in all."""
    if length == 0:
        return len(head)
    # `[]` becomes `[\n` + fragments joined by `,\n` + `\n    ]`.
    return len(head) - 2 + 2 + fragment_bytes + 2 * (length - 1) + 6


def assemble(head: bytes, fragments: Sequence[bytes]) -> bytes:
    """The whole document from its head and its transcript's fragments, in order."""
    if not fragments:
        return head
    at = head.find(_SLOT)
    if at < 0 or head.find(_SLOT, at + 1) >= 0:
        raise ValueError("not a snapshot head: no single run-level empty transcript")
    cut = at + len(_SLOT) - 2
    return b"".join((head[:cut], b"[\n", b",\n".join(fragments), b"\n    ]", head[cut + 2 :]))


def decode(data: bytes, where: str, max_bytes: int = MAX_BYTES) -> RunState:
    """Read a snapshot document, refusing anything that is not one this build reads.

    Every refusal is a :class:`~runtime.errors.SnapshotError` whose message names
    ``where`` and what is wrong (never the document's contents): nothing else
    escapes, whatever the bytes (fuzzed in ``tests/test_snapshot_format.py``).
    """
    if len(data) > max_bytes:
        raise SnapshotMalformed(where, f"{len(data)} bytes is over the {max_bytes}-byte limit")
    if not data.strip():
        raise SnapshotMalformed(where, "the file is empty")
    try:
        value = json_values.loads(data)
    except NotStorable as exc:
        # What the encoder would not write: not UTF-8, not JSON, NaN, an integer of more
        # than MAX_INT_DIGITS digits (Python refuses them), nested too deeply.
        problem = exc.problem
        if not problem.startswith("not "):
            problem = f"not JSON this build reads ({problem})"
        raise SnapshotMalformed(where, problem) from exc
    if not isinstance(value, dict):
        raise SnapshotMalformed(where, "the document is not a JSON object")
    kind = value.get("kind")
    if kind != KIND:
        raise SnapshotWrongKind(where, _shown(kind), KIND)
    version = value.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        readable = ", ".join(f"`{v}`" for v in READABLE_VERSIONS)
        raise SnapshotUnsupportedVersion(where, _shown(version), readable)
    try:
        if version == 1:
            return SnapshotV1.model_validate(_upgrade_v1(value, where)).run
        return SnapshotV2.model_validate(value).run
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        loc = ".".join(str(p) for p in err["loc"])
        problem = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise SnapshotMalformed(where, f"`{loc}`: {problem}") from exc
    except (RecursionError, ValueError, TypeError) as exc:
        # pydantic reports what it can as ValidationError; a value it cannot even
        # walk (nested deeper than the interpreter allows) is refused the same way.
        raise SnapshotMalformed(where, f"cannot be validated ({type(exc).__name__})") from exc


def _shown(value: object) -> str:
    """A found kind or version for a message: short, and never a whole document."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)[:40]
    return text if len(text) <= 40 else text[:39] + "…"
