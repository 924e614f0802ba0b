"""What a stage's new owner reads to take a session over: bounded, paged, exact.

A new owner (a failover, a hand-back, a live worker taking its session back)
rebuilds the backend's state from the session's recorded inputs up to the
stage's read position and from the outputs the stage already published. A
backend declares how much of each it needs (``RebuildWindow``: the newest N
entries, or all); both are read newest first, one page per round trip, so a
takeover of a long session costs what the backend needs, not the session's
length (``bench/takeover.py`` measures a 30-minute voice session).

The tail of the stage's outputs also says what must not be published twice:
outputs for inputs not yet applied were published by the previous owner as it
streamed them (flush drafts publish without progress) before it died. The new
owner handles those inputs again, and the runtime drops as many of the
answer's first drafts as were already published (``Takeover.published``), so
each reaches the client once (``tests/test_takeover.py``). A model backend that
continues the cut answer itself (``RebuildWindow.resumes_answers``: vLLM,
MiniCPM-o) rebuilds it from the published part and produces only the rest, so
nothing is dropped for it.

A client-facing stage that no stage reads keeps its outputs once, in the
session's client journal (``PipelineConfig.outputs_in_journal``): its takeover
reads them there, those of the stage among the journal's entries.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import NamedTuple

from dataplane.bus import Entry, RedisBus
from schemas.errors import WireDecodeError
from schemas.events import OutputEvent, carries_settings, decode_event, decode_output
from workers.backends.base import RebuildWindow, StageEvent

PAGE = 512
"""Entries read per round trip."""


class Takeover(NamedTuple):
    inputs: list[StageEvent]
    """Applied inputs, oldest first."""
    outputs: list[OutputEvent]
    """Outputs this stage published, oldest first."""
    published: dict[int, int]
    """Input seq -> outputs already published for that input, which is not yet applied."""


async def _backwards(bus: RedisBus, stream: str, end: str) -> AsyncIterator[Entry]:
    """Entries of ``stream`` from ``end`` back to the start, newest first, paged."""
    while page := await bus.xrevrange(stream, end, "-", count=PAGE):
        for entry in page:
            yield entry
        if len(page) < PAGE:
            return
        end = "(" + page[-1].id


def _decode_input(entry: Entry) -> StageEvent | None:
    """A history event for the backend: settings are the runtime's, not its (conversation
    edits are the backend's: a model stage replays them)."""
    if b"e" not in entry.fields:
        return None  # a fence barrier, or a trimmed entry
    with contextlib.suppress(WireDecodeError):
        event = decode_event(entry.event)
        if isinstance(event, StageEvent) and not carries_settings(event):
            return event
    return None


def _decode_output(entry: Entry, stage: str | None) -> OutputEvent | None:
    if b"e" not in entry.fields:
        return None
    with contextlib.suppress(WireDecodeError):
        output = decode_output(entry.fields[b"e"])
        if stage is not None and output.stage != stage:
            return None
        return None if carries_settings(output) else output
    return None


async def load_takeover(
    bus: RedisBus,
    input_stream: str,
    output_stream: str,
    *,
    read_id: str,
    applied_seq: int,
    window: RebuildWindow,
    stage: str | None = None,
) -> Takeover:
    """The history a new owner rebuilds from, and what it must not publish again.

    ``output_stream`` is the stage's own stream, or, with ``stage``, the session's client
    journal, where a client-facing stage that no stage reads keeps its outputs
    (``PipelineConfig.outputs_in_journal``): its outputs are then those of ``stage``
    among the journal's entries."""
    inputs: list[StageEvent] = []
    if read_id != "0-0" and window.inputs != 0:
        async for entry in _backwards(bus, input_stream, read_id):
            event = _decode_input(entry)
            if event is not None:
                inputs.append(event)
                if window.inputs is not None and len(inputs) >= window.inputs:
                    break
    outputs: list[OutputEvent] = []
    published: Counter[int] = Counter()
    in_tail = True
    async for entry in _backwards(bus, output_stream, "+"):
        output = _decode_output(entry, stage)
        if output is None:
            continue
        in_tail = in_tail and output.source_seq > applied_seq
        if in_tail:
            published[output.source_seq] += 1
        wanted = window.outputs is None or len(outputs) < window.outputs
        if wanted:
            outputs.append(output)
        elif not in_tail:
            break
    inputs.reverse()
    outputs.reverse()
    return Takeover(inputs, outputs, dict(published))
