"""A turn's trace context, as it travels in stream events (``OutputEvent.trace``,
``CommitPayload.trace``). No I/O.

One trace per turn: it begins where the user's turn ends (a client's commit, or the
server VAD's end of speech) and ends when the answer's first audio reaches the client.
Every stage that handles an event carrying a trace stamps its own outputs with the
same trace, adding one ``StageMark``: the marks of an output are the path that led to
it, stage by stage, which is what the coordinator turns into the turn's waterfall
(``coordinator.turn_trace``) without waiting for any exporter.

Times are wall-clock nanoseconds (``time.time_ns()``), the clock OpenTelemetry spans
use, so marks made by different processes on one host line up.

Every field that carries a trace defaults to None and the structs that hold one are
encoded with ``omit_defaults``: an event without a trace costs no byte more.
"""

from __future__ import annotations

import os

import msgspec


class StageMark(msgspec.Struct, frozen=True, array_like=True):
    """One stage's step on the path to an output."""

    stage: str
    sent_ns: int
    """When the input this stage acted on was made (by the stage before it, or accepted
    by the coordinator): the hop from there to ``took_ns`` is duplexq's own time."""
    took_ns: int
    """When this stage took that input from its stream."""
    made_ns: int
    """When this stage made the output that carries the mark: from ``took_ns`` to here
    is the stage's own work (its model)."""
    busy_ns: int = 0
    """How much of the wait from ``sent_ns`` to ``took_ns`` this stage was still busy
    with earlier input (an ASR transcribing the utterance whose end then waited): that
    part is the stage's work too, not duplexq's."""


class TraceContext(msgspec.Struct, frozen=True, array_like=True):
    """The W3C trace context of a turn plus the path of marks to this event."""

    trace_id: bytes
    """16 random bytes."""
    span_id: bytes
    """8 bytes: the turn's root span, parent of every stage span."""
    start_ns: int
    """When the turn began (the root span's start)."""
    flags: int = 1
    """W3C trace flags (1: sampled)."""
    marks: tuple[StageMark, ...] = ()


def new_trace(start_ns: int) -> TraceContext:
    """A fresh trace whose root span starts at ``start_ns``."""
    return TraceContext(trace_id=os.urandom(16), span_id=os.urandom(8), start_ns=start_ns)


def new_span_id() -> bytes:
    return os.urandom(8)


def with_mark(trace: TraceContext, mark: StageMark) -> TraceContext:
    """``trace`` one stage further along the path."""
    return msgspec.structs.replace(trace, marks=(*trace.marks, mark))
