"""The verdict of a replay: two sessions' client outputs compared, stage by stage (pure).

What is compared is what a client reads: settings and conversation records (a
session's settings and edits passed down the chain for the stages, never shown to a
client; a greedy replay writes settings of its own) are left out, and a run of text
or audio deltas is read as one output (``as_read``). Each stage's outputs are compared
in order with the same stage's: the order of one stage's outputs follows from the
inputs, while how two stages' outputs interleave in the journal depends on timing (the
speech stage speaks a sentence while the thinker still writes the next).

Two outputs are equal when their stage, kind, text, data, token ids (and for a
function call the function and call id) are: fences, seqs and timestamps are not.

The first differing record is the one that comes first in the journal among each
stage's first difference; the verdict names its stage, kind, its index among that
stage's outputs, and both sides' values, shortened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from schemas.events import OutputEvent, OutputKind

NOT_COMPARED = frozenset({OutputKind.NOTICE, OutputKind.SETTINGS, OutputKind.CONVERSATION})
"""Records of the journal that are not the pipeline's answers to a client."""

STREAMED = frozenset({OutputKind.TEXT_DELTA, OutputKind.AUDIO_DELTA})
"""Output kinds a client joins: their cut into pieces is not part of the answer."""

SHOWN = 40
"""Characters of a text shown in a verdict."""


def output_key(event: OutputEvent) -> tuple[str, str, str, bytes, tuple[int, ...], str]:
    """What makes two outputs the same for a replay: (stage, kind, text, data, token ids,
    and for a function call the function and the call's id)."""
    call = ""
    if event.kind is OutputKind.FUNCTION_CALL:
        call = f"{event.meta.get('name', '')}:{event.meta.get('call_id', '')}"
    return event.stage, event.kind.value, event.text, event.data, event.token_ids, call


def summarize(event: OutputEvent | None) -> str:
    """A short human description of one output."""
    if event is None:
        return "(none)"
    text = event.text if len(event.text) <= SHOWN else event.text[: SHOWN - 3] + "..."
    return (
        f"{event.stage}/{event.kind.value} text={text!r} data={len(event.data)}B "
        f"tokens={len(event.token_ids)}"
    )


def joins(previous: OutputEvent, event: OutputEvent) -> bool:
    """Whether ``event`` continues the stream ``previous`` is part of, as read."""
    return (
        event.kind in STREAMED
        and event.kind is previous.kind
        and event.stage == previous.stage
        and event.fence == previous.fence
    )


def as_read(outputs: Sequence[OutputEvent]) -> list[OutputEvent]:
    """``outputs`` with every run of ``STREAMED`` outputs of one stage and kind under
    one fence joined into one (text, data and token ids concatenated; the first's
    seq and meta kept): what a client reads, whatever the cut."""
    joined: list[OutputEvent] = []
    run: list[OutputEvent] = []

    def close_run() -> None:
        if len(run) == 1:
            joined.append(run[0])
        elif run:
            joined.append(
                msgspec.structs.replace(
                    run[0],
                    text="".join(o.text for o in run),
                    data=b"".join(o.data for o in run),
                    token_ids=tuple(i for o in run for i in o.token_ids),
                )
            )
        run.clear()

    for event in outputs:
        if run and not joins(run[0], event):
            close_run()
        if event.kind in STREAMED:
            run.append(event)
        else:
            joined.append(event)
    close_run()
    return joined


def compared(outputs: Sequence[OutputEvent]) -> list[OutputEvent]:
    """The outputs a replay compares, in journal order: ``NOT_COMPARED`` left out, and
    each stage's runs of deltas joined as read, even where another stage's outputs
    came between two pieces (a joined stream is placed where its first piece is)."""
    kept = [(i, o) for i, o in enumerate(outputs) if o.kind not in NOT_COMPARED]
    placed: list[tuple[int, OutputEvent]] = []
    for stage in dict.fromkeys(o.stage for _, o in kept):
        runs: list[list[tuple[int, OutputEvent]]] = []
        for i, event in kept:
            if event.stage != stage:
                continue
            if runs and joins(runs[-1][0][1], event):
                runs[-1].append((i, event))
            else:
                runs.append([(i, event)])
        placed += [(run[0][0], as_read([o for _, o in run])[0]) for run in runs]
    return [event for _, event in sorted(placed, key=lambda p: p[0])]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first record where two sessions' outputs differ."""

    index: int
    """Its position among its stage's outputs (as read)."""
    source: str
    target: str
    stage: str = ""
    kind: str = ""
    """The kind of the record (the source's, or the target's when the source has none)."""

    def describe(self, reference: str = "source") -> list[str]:
        """Lines that name the record (its stage, kind and index) and show both sides."""
        named = f" {self.kind} output #{self.index} of stage {self.stage}" if self.stage else ""
        return [
            f"  first mismatch at {self.index}:{named}",
            f"    {reference} {self.source}",
            f"    target {self.target}",
        ]


@dataclass(frozen=True, slots=True)
class Comparison:
    """How two sessions' client outputs compare."""

    source_outputs: int
    target_outputs: int
    matched: int
    """Outputs equal in both, counted stage by stage up to each stage's first difference."""
    first_mismatch: Mismatch | None

    @property
    def identical(self) -> bool:
        return self.first_mismatch is None


def compare_outputs(source: Sequence[OutputEvent], target: Sequence[OutputEvent]) -> Comparison:
    """Compare two sessions' outputs stage by stage, as read (see the module docstring)."""
    source, target = compared(source), compared(target)
    matched = 0
    first: tuple[int, Mismatch] | None = None
    for stage in dict.fromkeys([o.stage for o in source] + [o.stage for o in target]):
        mine = [(i, o) for i, o in enumerate(source) if o.stage == stage]
        theirs = [(i, o) for i, o in enumerate(target) if o.stage == stage]
        equal = 0
        for (_, a), (_, b) in zip(mine, theirs, strict=False):
            if output_key(a) != output_key(b):
                break
            equal += 1
        matched += equal
        if equal == max(len(mine), len(theirs)):
            continue
        a_at, a_out = mine[equal] if equal < len(mine) else (len(source), None)
        b_at, b_out = theirs[equal] if equal < len(theirs) else (len(target), None)
        shown = a_out or b_out
        assert shown is not None
        mismatch = Mismatch(equal, summarize(a_out), summarize(b_out), stage, shown.kind.value)
        # The journal position of the record: the source's, else the target's.
        at = a_at if a_out is not None else b_at
        if first is None or at < first[0]:
            first = (at, mismatch)
    return Comparison(len(source), len(target), matched, None if first is None else first[1])
