"""Compression of stored payloads (snapshot heads, transcript fragments, large events).

A packed value is either the bytes as they were (JSON, which never starts with
``x``) or a zlib stream (which always does: 0x78 is the header of every
default-window stream). Values written before packing existed therefore stay
readable, and a value too small to gain from compression is stored as is.

Streams are compressed against a preset dictionary of the JSON every event and
transcript message repeats (keys, event types, the fragment layout), so a
100-byte event costs about 40. The stream names its dictionary by Adler-32
(RFC 1950), and every dictionary ever used stays in :data:`DICTIONARIES`: a
new one is added, never edited.
"""

from __future__ import annotations

import zlib
from typing import Final

MIN_BYTES: Final = 24
"""Values shorter than this are stored as they are: zlib's header would eat the gain."""
LEVEL: Final = 6
"""zlib's default. On a turn's payloads level 9 gave the same bytes (within 0.3%) for 1.25×
the time, twice the time on a 120 KB tool result; any level reads back the same."""

# zlib matches the end of a dictionary best: the most frequent strings come last.
DICTIONARY_V1: Final = (
    b'"tool_calls": [\n          {\n            "arguments": {\n              "'
    b'            },\n            "id": "call_1_1",\n            "name": "'
    b'"status": "completed", "run.suspended", "run.continued", "run_continuation", '
    b'"prompt": "request_user_input", "error": "`", "reason": "'
    b'      {\n        "content": "",\n        "is_error": false,\n        "name": null,\n'
    b'        "role": "assistant",\n        "tool_call_id": null,\n        "tool_calls": []\n      }'
    b'        "role": "tool",\n        "tool_call_id": "call_1_1",\n        "tool_calls": []\n'
    b'{"seq":1,"type":"run.created","at_ms":1795965970661,"data":{"agent":"","agent_file":"",'
    b'"binding":"sha256:","budgets":{"max_tool_calls":50,"max_total_tokens":null,"max_turns":20,'
    b'"timeout_seconds":3600},"input":"","system":"","created_at_ms":1795965970661}}'
    b'{"seq":3,"type":"model.responded","at_ms":1795965970661,"data":{"content":"",'
    b'"tool_calls":[{"id":"call_1_1","name":"","arguments":{"'
    b'}}],"usage":{"input_tokens":100,"output_tokens":20}}}'
    b'{"seq":4,"type":"tool.requested","at_ms":1795965970661,"data":{"call_id":"call_1_1",'
    b'"name":"","arguments":{"'
    b'{"seq":5,"type":"tool.completed","at_ms":1795965970661,"data":{"call_id":"call_1_1",'
    b'"name":"","result":'
    b'{"seq":2,"type":"model.requested","at_ms":1795965970661,"data":{"turn":1}}'
)

DICTIONARIES: Final = {zlib.adler32(DICTIONARY_V1): DICTIONARY_V1}
"""Every preset dictionary a stored stream may name, by its Adler-32."""
_CURRENT: Final = DICTIONARY_V1


def pack(data: bytes) -> bytes:
    """``data`` compressed if that makes it shorter, else unchanged."""
    if len(data) < MIN_BYTES:
        return data
    compressor = zlib.compressobj(LEVEL, zdict=_CURRENT)
    packed = compressor.compress(data) + compressor.flush()
    return packed if len(packed) < len(data) else data


def is_packed(value: bytes) -> bool:
    return len(value) >= 2 and value[0] == 0x78 and (value[0] * 256 + value[1]) % 31 == 0


def unpack(value: bytes, max_bytes: int) -> bytes:
    """The bytes ``pack`` was given; ValueError if they would exceed ``max_bytes`` or are corrupt."""
    if not is_packed(value):
        return value
    inflater = zlib.decompressobj()
    if value[1] & 0x20:  # FDICT: the stream names the preset dictionary it was made with
        dictionary = DICTIONARIES.get(int.from_bytes(value[2:6], "big"))
        if dictionary is None:
            raise ValueError("a compressed value names a dictionary this build does not have")
        inflater = zlib.decompressobj(zdict=dictionary)
    try:
        data = inflater.decompress(value, max_bytes + 1)
    except zlib.error as exc:
        raise ValueError(f"a compressed value is corrupt ({exc})") from exc
    if len(data) > max_bytes or inflater.unconsumed_tail:
        raise ValueError(f"a compressed value inflates past {max_bytes} bytes")
    if not inflater.eof:
        raise ValueError("a compressed value is truncated")
    return data
