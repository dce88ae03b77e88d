"""Stored payloads: compressed against a preset dictionary, and every format ever written reads."""

from __future__ import annotations

import zlib

import pytest

from store.packing import DICTIONARY_V1, pack, unpack

EVENT = b'{"seq":12,"type":"model.requested","at_ms":1795965970661,"data":{"turn":4}}'


def test_a_small_event_packs_to_a_fraction_and_back() -> None:
    packed = pack(EVENT)
    assert len(packed) < len(EVENT) // 2
    assert unpack(packed, 1 << 20) == EVENT


def test_values_written_before_compression_or_before_the_dictionary_still_read() -> None:
    plain_zlib = zlib.compress(EVENT * 4, 6)  # what packing wrote before the dictionary
    assert unpack(plain_zlib, 1 << 20) == EVENT * 4
    assert unpack(EVENT, 1 << 20) == EVENT  # stored as is


def test_a_stream_naming_a_dictionary_this_build_lacks_is_refused() -> None:
    compressor = zlib.compressobj(9, zdict=DICTIONARY_V1 + b"another")
    stream = compressor.compress(EVENT) + compressor.flush()
    with pytest.raises(ValueError, match="dictionary this build does not have"):
        unpack(stream, 1 << 20)


def test_a_value_that_would_inflate_past_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="inflates past"):
        unpack(pack(b"{" + b" " * 10_000 + b"}"), 1000)
