"""The SDK's in-memory span exporter, made to outlive the process that exported.

A worker killed at a failpoint takes its memory with it; the spans it exported
before dying are what a test must count. ``exporter()`` (named by
``RATCHET_OTEL_EXPORTER=tests.tracing_sink:exporter``) returns an
``InMemorySpanExporter`` that also appends each span, as one JSON line, to the
file ``RATCHET_TEST_SPAN_LOG`` names, before ``export`` returns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def span_json(span: ReadableSpan) -> dict[str, Any]:
    context = span.context
    assert context is not None
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "error": span.status.description if not span.status.is_ok else None,
        "pid": os.getpid(),
    }


class FileBackedExporter(InMemorySpanExporter):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.path.open("a") as out:
            for span in spans:
                out.write(json.dumps(span_json(span), sort_keys=True) + "\n")
            out.flush()
            os.fsync(out.fileno())
        return super().export(spans)


def exporter() -> InMemorySpanExporter:
    path = os.environ.get("RATCHET_TEST_SPAN_LOG")
    return FileBackedExporter(Path(path)) if path else InMemorySpanExporter()


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]
