"""A stage's part of a turn's trace: stamping its outputs and exporting its span.

The actor of a session's stage has a ``StageTracer`` only while tracing is on
(``dataplane.tracing``); otherwise it holds None and does nothing else. With one:

- ``took`` is told each event the actor hands its backend. An event that carries a
  trace (an upstream output's ``trace``, a commit's ``CommitPayload.trace``) makes
  that trace the current one and opens the stage's span of the turn, if not open;
- ``stamp`` gives each output staged meanwhile the current trace one ``StageMark``
  further (when the input was made, when this stage took it, when it made the
  output, and how long of the wait before it took the input it was still busy with
  earlier input), so the next stage continues the same trace;
- a stage that reads the session itself (the server VAD) begins the trace when it
  ends the user's speech (``speech_stopped``, or a turn end it decided) while no trace
  is current: that is where the turn ends for the user;
- the stage's span (a child of the turn's root span) runs from taking the turn's
  first traced input to its last output of the turn, with an event at its first
  output; it is exported when the stage's answer is done, when another turn's trace
  arrives, or when the actor retires.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dataplane.tracing import SpanRecord, SpanSink
from schemas.events import CommitPayload, InputEvent, OutputEvent, OutputKind
from schemas.trace import StageMark, TraceContext, new_span_id, new_trace, with_mark
from workers.backends.base import OutputDraft, StageEvent


def trace_of(event: StageEvent) -> TraceContext | None:
    if isinstance(event, OutputEvent):
        return event.trace
    payload = event.payload
    return payload.trace if isinstance(payload, CommitPayload) else None


def _ends_speech(draft: OutputDraft) -> bool:
    """Whether a turn-detecting stage's output ends the user's turn."""
    if draft.kind is OutputKind.SPEECH_STOPPED:
        return draft.meta.get("reason") != "cleared"
    return draft.kind is OutputKind.DONE and bool(draft.meta.get("turn_end"))


@dataclass(slots=True)
class _OpenSpan:
    trace: TraceContext
    span_id: bytes
    start_ns: int
    first_ns: int = 0
    last_ns: int = 0
    outputs: int = 0


class StageTracer:
    """One session's stage: the trace of the event in hand and the turn's open span."""

    def __init__(self, stage: str, session_id: str, sink: SpanSink, *, starts_turns: bool):
        self.stage = stage
        self.session_id = session_id
        self.sink = sink
        self.starts_turns = starts_turns
        """The stage reads the session (not another stage): it may begin a turn's trace."""
        self._trace: TraceContext | None = None
        self._sent_ns = 0
        self._took_ns = 0
        self._busy_ns = 0
        self._free_ns = 0
        """When the backend last finished handling an event."""
        self._span: _OpenSpan | None = None
        self._closed_id = b""
        """The trace whose span was exported last: late outputs of it open none again."""

    def took(self, event: StageEvent) -> None:
        """The actor hands ``event`` to the backend now."""
        self._took_ns = now = time.time_ns()
        trace = self._trace = trace_of(event)
        if trace is None:
            self._sent_ns = event.ts_ms * 1_000_000 if isinstance(event, InputEvent) else now
        else:
            self._sent_ns = trace.marks[-1].made_ns if trace.marks else trace.start_ns
            self._open(trace, now)
        # Busy until the previous event was handled, if that was after this one was made.
        self._busy_ns = max(0, min(now, self._free_ns) - self._sent_ns)

    def handled(self) -> None:
        """The event is done with: outputs staged from now on answer no traced input."""
        self._trace = None
        self._free_ns = time.time_ns()

    def stamp(self, draft: OutputDraft) -> TraceContext | None:
        """The trace for an output being staged now (None: it belongs to no trace)."""
        trace = self._trace
        if trace is None:
            if not (self.starts_turns and self._took_ns and _ends_speech(draft)):
                return None
            trace = self._trace = new_trace(self._sent_ns or self._took_ns)
            self._open(trace, self._took_ns)
        now = time.time_ns()
        span = self._span
        if span is not None and span.trace.trace_id == trace.trace_id:
            span.first_ns = span.first_ns or now
            span.last_ns = now
            span.outputs += 1
            if draft.kind is OutputKind.DONE:
                self.close()
        mark = StageMark(self.stage, self._sent_ns, self._took_ns, now, self._busy_ns)
        return with_mark(trace, mark)

    def _open(self, trace: TraceContext, start_ns: int) -> None:
        span = self._span
        if trace.trace_id == self._closed_id or (
            span is not None and span.trace.trace_id == trace.trace_id
        ):
            return
        self.close()
        self._span = _OpenSpan(trace, new_span_id(), start_ns)

    def close(self) -> None:
        """Export the open span, if any."""
        span, self._span = self._span, None
        if span is None:
            return
        self._closed_id = span.trace.trace_id
        events = [("first_output", span.first_ns)] if span.first_ns else []
        self.sink.emit(
            SpanRecord(
                name=f"stage {self.stage}",
                trace_id=span.trace.trace_id,
                span_id=span.span_id,
                parent_id=span.trace.span_id,
                start_ns=span.start_ns,
                end_ns=max(span.start_ns, span.last_ns),
                attributes={
                    "duplexq.stage": self.stage,
                    "duplexq.session": self.session_id,
                    "duplexq.outputs": span.outputs,
                    "duplexq.first_output_ms": _ms(span.first_ns - span.start_ns)
                    if span.first_ns
                    else -1.0,
                },
                events=events,
            )
        )


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)
