"""Compressed message bodies are inflated with a bound (tasks/broker/compression.py)."""

from __future__ import annotations

import bz2
import lzma
import pickle
import zlib
from collections.abc import Callable

import pytest
from kombu import compression

from tasks.broker.compression import (
    MAX_DECOMPRESSED_BYTES,
    BodyInflatesTooFar,
    CompressionRefused,
    bound_decompression,
)

CODECS: list[tuple[str, Callable[[bytes], bytes]]] = [
    ("zlib", zlib.compress),
    ("bzip2", bz2.compress),
    ("xz", lzma.compress),
]


@pytest.fixture(autouse=True)
def bounded() -> None:
    bound_decompression()


@pytest.mark.parametrize(("alias", "compress"), CODECS, ids=[c[0] for c in CODECS])
def test_a_body_up_to_the_bound_inflates_as_kombu_would_and_one_past_it_is_refused(
    alias: str, compress: Callable[[bytes], bytes]
) -> None:
    assert compression.decompress(compress(b"turn " * 100), alias) == b"turn " * 100
    whole = bytes(MAX_DECOMPRESSED_BYTES)
    assert compression.decompress(compress(whole), alias) == whole
    with pytest.raises(BodyInflatesTooFar, match="inflates past 4194304 bytes"):
        compression.decompress(compress(whole + b"\0"), alias)
    with pytest.raises(EOFError, match="ends before its stream does"):
        compression.decompress(compress(b"turn " * 100)[:-6], alias)


def test_concatenated_streams_count_together_towards_the_bound() -> None:
    half = bytes(MAX_DECOMPRESSED_BYTES // 2 + 1)
    assert compression.decompress(bz2.compress(b"a") + bz2.compress(b"b"), "bzip2") == b"ab"
    with pytest.raises(BodyInflatesTooFar):
        compression.decompress(lzma.compress(half) + lzma.compress(half), "xz")


def test_a_codec_with_no_bounded_decoder_is_refused_and_the_errors_survive_pickling() -> None:
    compression.register(lambda body: body, lambda body: body, "application/x-plain-test")
    bound_decompression()
    with pytest.raises(CompressionRefused, match="not decompressed by ratchet workers"):
        compression.decompress(b"x", "application/x-plain-test")
    for error in (BodyInflatesTooFar("application/x-gzip", 4), CompressionRefused("x")):
        assert str(pickle.loads(pickle.dumps(error))) == str(error)
