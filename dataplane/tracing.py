"""Exporting spans over OTLP (the shell around ``schemas.trace``), for workers and
coordinators alike.

Tracing is on in a process only when the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set: ``span_sink()`` then returns the one
``SpanSink`` of the process, else None, and the callers' hot paths do nothing more
than test that None. OpenTelemetry is imported only when tracing is on.

Spans are built whole, after the fact, from marks the events carry (their ids and
times are chosen by duplexq, not by a tracer's clock), and handed to a batching
processor that exports them over OTLP/HTTP (protobuf) from its own thread, so an
export never waits on the event loop nor the loop on an export.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""The standard variables that turn tracing on (either is enough)."""

SpanAttributes = Mapping[str, str | int | float | bool]


def tracing_configured(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return any(env.get(name) for name in ENDPOINT_VARIABLES)


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One finished span: ids are the W3C bytes (16 for a trace, 8 for a span)."""

    name: str
    trace_id: bytes
    span_id: bytes
    parent_id: bytes | None
    start_ns: int
    end_ns: int
    attributes: SpanAttributes = field(default_factory=dict)
    events: Sequence[tuple[str, int]] = ()
    """(name, time_ns) points inside the span."""


class SpanSink:
    """Hands finished spans to OpenTelemetry's batching OTLP exporter."""

    def __init__(self, service: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._resource = Resource.create({"service.name": service})
        self._processor = BatchSpanProcessor(OTLPSpanExporter())
        self._closed = False

    def emit(self, record: SpanRecord) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, TraceFlags

        def context(span_id: bytes) -> SpanContext:
            return SpanContext(
                int.from_bytes(record.trace_id),
                int.from_bytes(span_id),
                is_remote=False,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )

        attributes: dict[str, Any] = dict(record.attributes)
        span = ReadableSpan(
            record.name,
            context=context(record.span_id),
            parent=None if record.parent_id is None else context(record.parent_id),
            resource=self._resource,
            attributes=attributes,
            events=[Event(name, timestamp=at) for name, at in record.events],
            start_time=record.start_ns,
            end_time=record.end_ns,
            instrumentation_scope=InstrumentationScope("duplexq"),
        )
        self._processor.on_end(span)

    def flush(self, timeout_ms: int = 5000) -> None:
        self._processor.force_flush(timeout_ms)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._processor.shutdown()  # type: ignore[no-untyped-call]


_sink: SpanSink | None = None


def span_sink(service: str) -> SpanSink | None:
    """The process's sink (made on first use, closed at exit), or None: tracing off."""
    global _sink  # noqa: PLW0603 - one exporter per process, as OpenTelemetry has it
    if _sink is None and tracing_configured():
        _sink = SpanSink(service)
        atexit.register(close_sink)
    return _sink


def close_sink() -> None:
    """Export what is pending and forget the process's sink (at exit; a test that turned
    tracing on for its own process turns it off again with this)."""
    global _sink
    sink, _sink = _sink, None
    if sink is not None:
        sink.close()
