"""A turn's trace, ended where its answer reaches the client: the root span and the
waterfall (``duplexq.turn.trace``).

A connection has a ``TurnTrace`` only while tracing is on (``docs/tracing.md``). The
coordinator begins a turn's trace itself when it takes a client's commit
(``CommitPayload.trace``); with server VAD the VAD stage begins it at the end of
speech (``workers.stage_trace``). Either way every output on the way to the client
carries the trace and the marks of its path (``schemas.trace``).

When the first audio of the turn's answer is sent to the client (or, for an answer
with no audio, its first text once the answer is done), ``sent`` ends the turn: it
exports the root span ``duplexq.turn`` and returns the waterfall the client is sent,
from the marks of that output. Along that path every stretch is either a stage's own
work (from taking its input to making its output: the model) or duplexq's (from an
input being made to the next stage taking it, and from the last stage's output to
the client: queues, Redis, fencing, coalescing), and the stretches add up to the
turn's whole time. ``waterfall`` is pure.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from dataplane.tracing import SpanRecord, SpanSink
from schemas.events import OutputEvent, OutputKind
from schemas.trace import TraceContext

EVENT_TYPE = "duplexq.turn.trace"


def _ms(ns: int) -> float:
    return round(max(0, ns) / 1e6, 3)


def waterfall(trace: TraceContext, delivered_ns: int) -> dict[str, Any]:
    """The ``duplexq.turn.trace`` event for a turn whose answer reached the client at
    ``delivered_ns``: per stage its wait (``queued_ms``: duplexq's) and its work
    (``start_ms`` to ``end_ms`` from the turn's start: the stage's model, including
    any wait while the stage was still busy with earlier input, ``busy_ms``)."""
    start = trace.start_ns
    stages = []
    own = 0
    for mark in trace.marks:
        busy = min(mark.busy_ns, max(0, mark.took_ns - mark.sent_ns))
        began = mark.took_ns - busy
        queued = max(0, began - mark.sent_ns)
        own += queued
        stages.append({
            "stage": mark.stage,
            "queued_ms": _ms(queued),
            "start_ms": _ms(began - start),
            "end_ms": _ms(mark.made_ns - start),
            "work_ms": _ms(mark.made_ns - began),
            "busy_ms": _ms(busy),
        })  # fmt: skip
    last = trace.marks[-1].made_ns if trace.marks else start
    delivery = max(0, delivered_ns - last)
    own += delivery
    total = max(0, delivered_ns - start)
    return {
        "type": EVENT_TYPE,
        "trace_id": trace.trace_id.hex(),
        "total_ms": _ms(total),
        "own_ms": _ms(own),
        "own_share": round(own / total, 4) if total else 0.0,
        "delivery_ms": _ms(delivery),
        "stages": stages,
    }


class TurnTrace:
    """One connection's turns: which trace ended, and the answer's first text so far."""

    def __init__(self, sink: SpanSink, session_id: str, terminal: Collection[str]) -> None:
        self.sink = sink
        self.session_id = session_id
        self.terminal = terminal
        """The client-facing stages whose ``done`` ends a response."""
        self._ended = b""
        self._text: tuple[TraceContext, int] | None = None
        """A text-only answer's first text delta and when it was sent."""

    def sent(self, event: OutputEvent, now_ns: int) -> dict[str, Any] | None:
        """Note an output just sent to the client; the waterfall when it ends its turn."""
        trace = event.trace
        if trace is None or trace.trace_id == self._ended:
            return None
        if event.kind is OutputKind.AUDIO_DELTA:
            return self._end(trace, now_ns)
        text = self._text
        if event.kind is OutputKind.TEXT_DELTA and (
            text is None or text[0].trace_id != trace.trace_id
        ):
            self._text = (trace, now_ns)
        elif (
            event.kind is OutputKind.DONE
            and event.stage in self.terminal
            and text is not None
            and text[0].trace_id == trace.trace_id
        ):
            return self._end(*text)
        return None

    def _end(self, trace: TraceContext, delivered_ns: int) -> dict[str, Any]:
        self._ended, self._text = trace.trace_id, None
        shown = waterfall(trace, delivered_ns)
        attributes: dict[str, str | int | float | bool] = {
            "duplexq.session": self.session_id,
            "duplexq.total_ms": shown["total_ms"],
            "duplexq.own_ms": shown["own_ms"],
            "duplexq.delivery_ms": shown["delivery_ms"],
        }
        for stage in shown["stages"]:
            attributes[f"duplexq.{stage['stage']}.work_ms"] = stage["work_ms"]
            attributes[f"duplexq.{stage['stage']}.queued_ms"] = stage["queued_ms"]
        self.sink.emit(
            SpanRecord(
                name="duplexq.turn",
                trace_id=trace.trace_id,
                span_id=trace.span_id,
                parent_id=None,
                start_ns=trace.start_ns,
                end_ns=max(trace.start_ns, delivered_ns),
                attributes=attributes,
            )
        )
        return shown
