"""One owner at a time: judged from what the stages published, as Redis kept it.

Only a stage's lease holder may publish for a session, and a takeover bumps the
session's incarnation; every output carries the incarnation it was produced
under and a sequence number its owner gives it. So in what a stage published
for a session, as it lies in Redis once the run is over (the stage's own
output stream; the client journal for the client-facing stage), the pairs
(incarnation, seq) must rise strictly in stream order. A pair that does not
is two owners' outputs interleaved: a zombie's publish that landed after its
successor's (a lower incarnation), or two publishers in one incarnation (a
seq repeated or going back). The clients' histories show what reached them;
this shows what landed, delivered or not.

``two_owners`` and ``handovers`` are pure (entries in, violations out); ``read_outputs`` reads the
streams of the run's sessions before the cluster stops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dataplane.bus import RedisBus
from schemas.config import PipelineConfig
from schemas.errors import WireDecodeError
from schemas.events import OutputEvent, decode_event
from schemas.keys import Keys

Published = tuple[str, str, int, int]
"""(stream, stage, incarnation, seq) of one output, in its stream's order."""


def two_owners(outputs: Iterable[Published]) -> list[str]:
    """Every output whose (incarnation, seq) does not rise above the one before it of
    the same stage in the same stream."""
    last: dict[tuple[str, str], tuple[int, int]] = {}
    found = []
    for stream, stage, incarnation, seq in outputs:
        before = last.get((stream, stage))
        if before is not None and (incarnation, seq) <= before:
            found.append(f"{stream} {stage}: inc {incarnation} seq {seq} after "
                         f"inc {before[0]} seq {before[1]}")  # fmt: skip
        last[(stream, stage)] = max(before or (incarnation, seq), (incarnation, seq))
    return found


def handovers(outputs: Iterable[Published]) -> int:
    """How often a stage's outputs in a stream went on under a higher incarnation (a
    takeover, or the session reopened): what ``two_owners`` had to judge."""
    last: dict[tuple[str, str], int] = {}
    count = 0
    for stream, stage, incarnation, _ in outputs:
        count += last.get((stream, stage), incarnation) < incarnation
        last[(stream, stage)] = max(last.get((stream, stage), incarnation), incarnation)
    return count


async def read_outputs(
    url: str, keys: Keys, pipeline: PipelineConfig, sessions: Sequence[str]
) -> list[Published]:
    """What each stage published for ``sessions``, in each stream's order."""
    bus = RedisBus(url, keys)
    out: list[Published] = []
    try:
        for session in sessions:
            own = keys.session(session)
            streams = [own.stage_out(stage) for stage in pipeline.stage_names]
            for name in [*streams, own.client]:  # the client journal last
                for _, fields in await bus.client.xrange(name):
                    out.extend(_published(name, fields))
    finally:
        await bus.aclose()
    return out


def _published(stream: str, fields: dict[bytes, bytes]) -> list[Published]:
    try:
        event = decode_event(fields.get(b"e", b""))
    except WireDecodeError:
        return []  # not an output (nothing else a stage writes there decodes as one)
    if not isinstance(event, OutputEvent):
        return []
    return [(stream, event.stage, event.fence.incarnation, event.seq)]
