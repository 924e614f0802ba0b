"""Replaying at the source's turns: each input waits for the answers that preceded it.

A turn's answer depends on what was answered before it (the thinker reads the
conversation so far), and a voice session's inputs depend on timing too: speech that
arrives while an answer is spoken is a barge-in that cuts it. Appending a recorded
session's inputs as fast as possible therefore gives the target another conversation.
So before each input the replay waits until the target has ended, stage by stage, as
many answers (``OutputKind.DONE`` outputs) as the source had ended when that input was
recorded; the source's journal and input log are both stamped by Redis's clock (their
entry ids), which orders them. Answers are counted rather than compared: a greedy
replay of a sampled session answers other words, in as many answers.

A stage the target's pipeline does not have is not waited for, and once a wait times
out the rest of the replay no longer waits (the target is not answering; the
comparison will say so), so a broken target costs one timeout, not one per input.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Collection, Sequence

from coordinator.output_reader import JournalFollower
from dataplane.bus import RedisBus
from schemas.events import OutputEvent, OutputKind
from schemas.fence import Fence

PAGE = 256
POLL_S = 0.05

Record = tuple[int, OutputEvent]
"""An output a client received and the Redis time (ms) its journal entry was written."""


def entry_ms(entry_id: str) -> int:
    """The Redis time (ms) of a stream entry id ``MS-SEQ``."""
    return int(entry_id.partition("-")[0])


class AnswerClock:
    """The source's ends of answers (``DONE`` outputs of ``stages``) in time order, and
    how many each stage had reached at a time: asked with times that do not go back
    (inputs in log order), it takes each end once, so a replay stays linear."""

    def __init__(self, records: Sequence[Record], stages: Collection[str]) -> None:
        self._ends = sorted(
            (at, event.stage)
            for at, event in records
            if event.kind is OutputKind.DONE and event.stage in stages
        )
        self._passed = 0
        self.needed: Counter[str] = Counter()

    def before(self, ms: int | None) -> Counter[str]:
        """Per stage, the answers ended before ``ms`` (None: all of them)."""
        ends = self._ends
        while self._passed < len(ends) and (ms is None or ends[self._passed][0] < ms):
            self.needed[ends[self._passed][1]] += 1
            self._passed += 1
        return self.needed


def reached(ended: Counter[str], needed: Counter[str]) -> bool:
    return all(ended[stage] >= count for stage, count in needed.items())


def _follower(session_id: str) -> JournalFollower:
    return JournalFollower(session_id, Fence(session_id), metrics=False)


async def client_records(bus: RedisBus, session_id: str) -> list[Record]:
    """The outputs a client following ``session_id`` received (coordinator notices left
    out), each with the time of its journal entry."""
    follower = _follower(session_id)
    journal = bus.keys.session(session_id).client
    records: list[Record] = []
    start = "-"
    while page := await bus.xrange(journal, start, "+", count=PAGE):
        start = "(" + page[-1].id
        for entry in page:
            delivery = follower.judge(entry)
            if delivery is None or not isinstance(delivery.event, OutputEvent):
                continue
            if delivery.event.kind is not OutputKind.NOTICE:
                records.append((entry_ms(entry.id), delivery.event))
    return records


class TurnWaiter:
    """Follows the target's journal and holds each input back until the target has
    ended the answers the source had ended before it (see the module docstring)."""

    def __init__(
        self,
        bus: RedisBus,
        target: str,
        recorded: Sequence[Record],
        stages: Collection[str],
        timeout_s: float,
    ) -> None:
        self.bus = bus
        self.journal = bus.keys.session(target).client
        self.follower = _follower(target)
        self.clock = AnswerClock(recorded, frozenset(stages))
        self.timeout_s = timeout_s
        self.ended: Counter[str] = Counter()
        self.timed_out = False
        self._start = "-"

    async def before(self, input_entry_id: str) -> bool:
        """Wait until the target has ended the answers the source had ended before the
        input logged as ``input_entry_id``; False when the wait timed out (now or on an
        earlier input: the waiter then no longer waits)."""
        return await self._until(entry_ms(input_entry_id))

    async def at_end(self) -> bool:
        """Wait until the target has ended every answer the source ended (after the last
        input: a stage may think longer than any quiet spell the final wait allows)."""
        return await self._until(None)

    async def _until(self, ms: int | None) -> bool:
        needed = self.clock.before(ms)
        if self.timed_out or reached(self.ended, needed):
            return not self.timed_out
        deadline = time.monotonic() + self.timeout_s
        while not reached(self.ended, needed):
            if not await self._read():
                if time.monotonic() >= deadline:
                    self.timed_out = True
                    return False
                await asyncio.sleep(POLL_S)
        return True

    async def _read(self) -> bool:
        """Read the target's journal on; whether there was anything new."""
        page = await self.bus.xrange(self.journal, self._start, "+", count=PAGE)
        if not page:
            return False
        self._start = "(" + page[-1].id
        for entry in page:
            delivery = self.follower.judge(entry)
            event = None if delivery is None else delivery.event
            if isinstance(event, OutputEvent) and event.kind is OutputKind.DONE:
                self.ended[event.stage] += 1
        return True
