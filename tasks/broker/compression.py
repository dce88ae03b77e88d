# mypy: disable-error-code="no-untyped-call"
# (kombu is untyped.)
"""kombu's compression registry with bounded decoders: no body inflates past 4 MiB.

kombu decompresses a message whose ``compression`` header names a codec as it builds
the message, in the worker's consumer loop, with the codec's plain ``decompress``:
a 2.7 MB envelope (under the 4 MiB entry cap) whose body was the zlib of 2 GiB of
zeros took a worker's main process from 90 MB to 6.4 GB and blocked its loop 28 s.

:func:`bound_decompression` registers, for each codec kombu knows, a decoder that
stops at :data:`MAX_DECOMPRESSED_BYTES` — the cap a message sent uncompressed has —
and raises :class:`BodyInflatesTooFar` past it (memory: the bound plus one read of
the input; time: milliseconds). A codec ratchet has no bounded decoder for (brotli,
zstd, one an application registered) is refused outright. kombu records the error
on the message, and the consumer sets the message aside (tasks/broker/consumer.py). The
encoders are kombu's own: what a producer compresses is unchanged.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import Callable
from typing import Any

from kombu import compression
from kombu.utils.encoding import ensure_bytes

from store.rejected import MAX_MESSAGE_BYTES

MAX_DECOMPRESSED_BYTES = MAX_MESSAGE_BYTES
"""A compressed body may inflate to at most this (4 MiB): what it could have been sent as."""


class BodyInflatesTooFar(ValueError):
    """A compressed message body that would inflate past :data:`MAX_DECOMPRESSED_BYTES`."""

    def __init__(self, content_type: str, limit: int) -> None:
        self.content_type, self.limit = content_type, limit
        super().__init__(
            f"its {content_type} body inflates past {limit} bytes, the most a worker "
            "decompresses; send it smaller, or uncompressed"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.content_type, self.limit))


class CompressionRefused(ValueError):
    """A ``compression`` header naming a codec ratchet has no bounded decoder for."""

    def __init__(self, content_type: str) -> None:
        self.content_type = content_type
        super().__init__(
            f"compression {content_type!r} is not decompressed by ratchet workers "
            f"(they take {', '.join(sorted(BOUNDED))} up to {MAX_DECOMPRESSED_BYTES} bytes); "
            "send it with one of those, or uncompressed"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.content_type,))


def _bounded(
    content_type: str, new: Callable[[], Any], streams: bool, limit: int
) -> Callable[[Any], bytes]:
    """A decoder for ``content_type`` that never produces more than ``limit`` bytes.

    ``streams``: concatenated streams are read one after the other, as ``bz2.decompress``
    and ``lzma.decompress`` do (``zlib.decompress`` reads one stream).
    """

    def decompress(body: Any) -> bytes:
        data, out = ensure_bytes(body), bytearray()
        while True:
            decompressor = new()
            out += decompressor.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise BodyInflatesTooFar(content_type, limit)
            if not decompressor.eof:
                # Under the limit, so all the input was read: the stream was cut short.
                raise EOFError(f"the {content_type} body ends before its stream does")
            data = decompressor.unused_data
            if not (streams and data):
                return bytes(out)

    return decompress


BOUNDED: dict[str, tuple[Callable[[], Any], bool]] = {
    # kombu's "gzip"/"zlib" is the zlib format, one stream (as zlib.decompress reads it)
    "application/x-gzip": (zlib.decompressobj, False),
    "application/x-bz2": (bz2.BZ2Decompressor, True),
    "application/x-lzma": (lzma.LZMADecompressor, True),
}
"""The codecs decompressed with a bound, by kombu content type: the decompressor each
inflates with, and whether it reads concatenated streams as its ``decompress`` does."""


def _refused(content_type: str) -> Callable[[Any], bytes]:
    def decompress(body: Any) -> bytes:
        raise CompressionRefused(content_type)

    return decompress


def bound_decompression(limit: int = MAX_DECOMPRESSED_BYTES) -> None:
    """Register a bounded decoder for every codec in kombu's registry (idempotent).

    The registry is kombu's and process-wide, as are the codecs: this is called by the
    app factory (worker/app.py) so that every consumer of the process decodes this way.
    """
    for content_type in compression.encoders():
        encoder, _ = compression.get_encoder(content_type)
        bounded = BOUNDED.get(content_type)
        if bounded is None:
            decoder = _refused(content_type)
        else:
            decoder = _bounded(content_type, *bounded, limit)
        compression.register(encoder, decoder, content_type)
