"""The output reader: follows sessions' client journals and drops what regressed.

Stage workers append client-bound outputs to each session's journal stream
(``dq:{sid}:out``) together with fence barriers (cancel, failover, close).
The reader walks each attached session's journal in order, judges every
output against the session's ``FenceView`` and yields the rest. Whatever
buffer a stale output sat in, it stops here: an output of a cancelled epoch,
a zombie's output after a failover barrier, a response superseded by a newer
one, or a duplicate of an output already delivered (a retried write).
Drops are counted per reason.

``advance`` is how a cancel acknowledged by this process takes effect at once,
before its barrier has been read from the journal.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from coordinator.bus import Entry, RedisBus
from coordinator.metrics import DROPPED_STALE
from coordinator.sessions import FenceView
from schemas.errors import WireDecodeError
from schemas.events import ControlEvent, OutputEvent, decode_control, decode_output
from schemas.fence import Fence


class Delivery(NamedTuple):
    """One journal item for the client: an output (with its server seq) or a control."""

    session_id: str
    event: OutputEvent | ControlEvent
    server_event_seq: int
    entry_id: str


@dataclass
class _Follow:
    view: FenceView
    cursor: str
    last_seq: dict[str, int] = field(default_factory=dict)
    """Highest output seq delivered per stage, to drop duplicates."""


class OutputReader:
    """Reads the client journals of attached sessions on one dedicated connection."""

    def __init__(self, bus: RedisBus, *, block_ms: int = 500, batch: int = 256) -> None:
        self.bus = bus
        self.block_ms = block_ms
        self.batch = batch
        self.dropped: Counter[str] = Counter()
        self._follows: dict[str, _Follow] = {}
        self._conn = bus.reader(block_ms)

    def attach(self, session_id: str, fence: Fence, *, after: str = "0-0") -> None:
        """Follow ``session_id``'s journal after entry ``after``, judging against ``fence``."""
        self._follows[session_id] = _Follow(FenceView(fence), after)

    def detach(self, session_id: str) -> None:
        self._follows.pop(session_id, None)

    def advance(self, fence: Fence) -> None:
        """Out-of-band fence news (a cancel this process acknowledged)."""
        follow = self._follows.get(fence.session_id)
        if follow is not None:
            follow.view.advance(fence)

    def view(self, session_id: str) -> FenceView:
        return self._follows[session_id].view

    async def read(self, block_ms: int | None = None) -> list[Delivery]:
        """One round: everything new across attached sessions, stale items removed."""
        streams = {self.bus.keys.session(sid).client: f.cursor for sid, f in self._follows.items()}
        owners = {self.bus.keys.session(sid).client: sid for sid in self._follows}
        entries = await self.bus.xread(
            self._conn, streams, self.batch, self.block_ms if block_ms is None else block_ms
        )
        delivered: list[Delivery] = []
        for entry in entries:
            session_id = owners.get(entry.stream)
            follow = self._follows.get(session_id or "")
            if session_id is None or follow is None:
                continue
            follow.cursor = entry.id
            item = self._judge(session_id, follow, entry)
            if item is not None:
                delivered.append(item)
        return delivered

    def _judge(self, session_id: str, follow: _Follow, entry: Entry) -> Delivery | None:
        try:
            if b"c" in entry.fields:
                control = decode_control(entry.fields[b"c"])
                follow.view.observe(control.fence)
                return Delivery(session_id, control, 0, entry.id)
            output = decode_output(entry.fields.get(b"e", b""))
        except WireDecodeError:
            self._drop("undecodable", "")
            return None
        if output.seq <= follow.last_seq.get(output.stage, 0):
            self._drop("duplicate", output.stage)
            return None
        reason = follow.view.judge(output.fence)
        if reason is not None:
            self._drop(reason.value, output.stage)
            return None
        follow.last_seq[output.stage] = output.seq
        return Delivery(session_id, output, int(entry.fields.get(b"n", b"0")), entry.id)

    def _drop(self, reason: str, stage: str) -> None:
        self.dropped[reason] += 1
        DROPPED_STALE.inc(stage=stage or "client", reason=reason)
