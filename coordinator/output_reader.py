"""The output reader: follows sessions' client journals and drops what regressed.

Stage workers append client-bound outputs to each session's journal stream
(``dq:{p}:{sid}:out``) together with fence barriers (cancel, failover, close).
The reader walks each attached session's journal in order, judges every
output against the session's ``FenceView`` and yields the rest. Whatever
buffer a stale output sat in, it stops here: an output of a cancelled epoch,
a zombie's output after a failover barrier, a response superseded by a newer
one, or a duplicate of an output already delivered (a retried write).
Drops are counted per reason.

``advance`` is how a cancel acknowledged by this process takes effect at once,
before its barrier has been read from the journal.

The reader does not read every attached journal on every round: it follows the
coordinators' bells (``dataplane.bells``) and reads the journals that rang, a
newly attached one at once, and all of them each ``sweep_ms``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import NamedTuple

from dataplane.bells import BellReader, Dirty
from dataplane.bus import Entry, RedisBus
from dataplane.metrics import DROPPED_STALE
from dataplane.pacing import Pacer
from dataplane.sessions import FenceView
from schemas.errors import WireDecodeError
from schemas.events import ControlEvent, OutputEvent, decode_control, decode_output
from schemas.fence import Fence
from schemas.keys import CLIENT


class Delivery(NamedTuple):
    """One journal item for the client: an output (with its server seq) or a control."""

    session_id: str
    event: OutputEvent | ControlEvent
    server_event_seq: int
    entry_id: str


class JournalFollower:
    """The judging state of one session's journal, read in order."""

    def __init__(
        self, session_id: str, fence: Fence, cursor: str = "0-0", *, metrics: bool = True
    ) -> None:
        self.session_id = session_id
        self._metrics = metrics
        # The journal may be read from the middle (a reconnect, another coordinator):
        # the incarnation live at the cursor is learnt from the journal itself.
        self.view = FenceView.resuming(fence)
        self.cursor = cursor
        self.last_seq: dict[str, int] = {}
        """Highest output seq delivered per stage, to drop duplicates."""
        self.dropped: Counter[str] = Counter()

    def judge(self, entry: Entry) -> Delivery | None:
        """The delivery for ``entry``, or None when it is dropped (and counted)."""
        self.cursor = entry.id
        try:
            if b"c" in entry.fields:
                control = decode_control(entry.fields[b"c"])
                self.view.observe(control.fence)
                # A barrier has a journal seq of its own (0 if written before they had).
                return Delivery(
                    self.session_id, control, int(entry.fields.get(b"n", b"0")), entry.id
                )
            output = decode_output(entry.fields.get(b"e", b""))
        except WireDecodeError:
            self._drop("undecodable", "")
            return None
        if output.seq <= self.last_seq.get(output.stage, 0):
            self._drop("duplicate", output.stage)
            return None
        reason = self.view.judge(output.fence)
        if reason is not None:
            self._drop(reason.value, output.stage)
            return None
        self.last_seq[output.stage] = output.seq
        return Delivery(self.session_id, output, int(entry.fields.get(b"n", b"0")), entry.id)

    def _drop(self, reason: str, stage: str) -> None:
        self.dropped[reason] += 1
        if self._metrics:
            DROPPED_STALE.labels(stage=stage or "client", reason=reason).inc()


class OutputReader:
    """Reads the client journals of attached sessions on one dedicated connection."""

    def __init__(
        self, bus: RedisBus, *, block_ms: int = 500, batch: int = 256, sweep_ms: int = 1000
    ) -> None:
        self.bus = bus
        self.block_ms = block_ms
        self.batch = batch
        self._follows: dict[str, JournalFollower] = {}
        self._retired: Counter[str] = Counter()
        self._dirty = Dirty(sweep_ms)
        self._pacer = Pacer(bus.linger_ms)
        self._closing = False
        self._bells = BellReader(
            bus, CLIENT, self._ring, block_ms=block_ms, running=lambda: not self._closing,
            on_gap=self._dirty.sweep_now,
        )  # fmt: skip
        self._bell_task: asyncio.Task[None] | None = None

    def _ring(self, session_id: str, _kind: str) -> None:
        if session_id in self._follows:
            self._dirty.mark(session_id)

    async def aclose(self) -> None:
        """Stop following the bells. The blocking bell read ends by itself within
        ``block_ms``: cancelling it could leave its connection out of step."""
        self._closing = True
        if self._bell_task is not None:
            await asyncio.wait([self._bell_task], timeout=self.block_ms / 1000 + 5)
            self._bell_task = None

    @property
    def dropped(self) -> Counter[str]:
        """Drops by reason, over every session this reader followed."""
        total = Counter(self._retired)
        for follow in self._follows.values():
            total.update(follow.dropped)
        return total

    def attach(
        self,
        session_id: str,
        fence: Fence,
        *,
        after: str = "0-0",
        follower: JournalFollower | None = None,
    ) -> None:
        """Follow ``session_id``'s journal after entry ``after``, judging against ``fence``
        (or continue with ``follower``'s state, as a resume does)."""
        if follower is None:
            follower = JournalFollower(session_id, fence, after)
        self._follows[session_id] = follower
        self._dirty.mark(session_id)

    def detach(self, session_id: str) -> None:
        follow = self._follows.pop(session_id, None)
        if follow is not None:
            self._retired.update(follow.dropped)

    def advance(self, fence: Fence) -> None:
        """Out-of-band fence news (a cancel this process acknowledged)."""
        follow = self._follows.get(fence.session_id)
        if follow is not None:
            follow.view.advance(fence)

    def view(self, session_id: str) -> FenceView:
        return self._follows[session_id].view

    async def read(self, block_ms: int | None = None) -> list[Delivery]:
        """One round: everything new across the journals that have news, stale items
        removed; waits up to ``block_ms`` for news when there is none."""
        if self._closing:
            return []
        if self._bell_task is None or self._bell_task.done():
            self._bell_task = asyncio.create_task(self._bells.run(), name="journal bells")
            await self._bells.started.wait()
        if self._dirty.pending:
            await self._pacer.pace()  # under load, what comes meanwhile joins this read
        streams = self._marked()
        if not streams:
            await self._dirty.wait(self.block_ms if block_ms is None else block_ms)
            streams = self._marked()
            if not streams:
                return []
        owners = {self.bus.keys.session(f.session_id).client: f for f in streams}
        entries = await self.bus.xread_now(
            {stream: f.cursor for stream, f in owners.items()}, self.batch
        )
        self._pacer.carried(len(entries))
        delivered: list[Delivery] = []
        counts: Counter[str] = Counter()
        for entry in entries:
            follow = owners[entry.stream]
            counts[entry.stream] += 1
            if self._follows.get(follow.session_id) is not follow:
                continue  # detached meanwhile
            item = follow.judge(entry)
            if item is not None:
                delivered.append(item)
        for stream, count in counts.items():
            if count >= self.batch:
                self._dirty.mark(owners[stream].session_id)  # more to read
        return delivered

    def _marked(self) -> list[JournalFollower]:
        """The followers to read now (marked ones; all of them when a sweep is due)."""
        if self._dirty.sweep_due():
            self._dirty.mark_all(self._follows)
        marked = [self._follows[sid] for sid in self._dirty.pending if sid in self._follows]
        self._dirty.pending.clear()
        return marked
