"""Driving sessions through a real pipeline and timing what comes back.

A benchmark's client side is one ``Coordinator`` (the product's: the session
authority for appends, the output reader for deliveries) in this process.
Each input is a 40 ms audio chunk (1,280 bytes: 16 kHz, 16-bit mono) whose
first bytes carry the ``time.monotonic_ns()`` at which it was handed to the
coordinator and its number in the session; the echo stage answers with the
same bytes, so every delivered output is matched to its input and timed,
in this process, with one clock.

- ``Collector`` follows the outputs (``Coordinator.outputs``) and records a
  latency per delivery, the set of delivered inputs, and stale outputs (an
  old epoch delivered after a cancel's acknowledgement);
- ``paced_load`` sends every session's chunks at 25 per second (open loop,
  each session on its own schedule, staggered over the 40 ms period);
- ``saturate`` sends as fast as deliveries allow, with a bounded window of
  events in flight (closed loop).
"""

from __future__ import annotations

import asyncio
import struct
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common import now_ns, summarize_ns
from coordinator.service import Coordinator
from schemas.events import AudioPayload, InputMode, OutputEvent, OutputKind

CHUNK_BYTES = 1280
PERIOD_S = 0.040
"""One chunk is 40 ms of audio: 25 events/s per session."""
_STAMP = struct.Struct("<QI")


def chunk(stamp_ns: int, number: int) -> AudioPayload:
    head = _STAMP.pack(stamp_ns, number)
    return AudioPayload(head + bytes(CHUNK_BYTES - len(head)), format="pcm_s16le")


def read_chunk(data: bytes) -> tuple[int, int] | None:
    """(send stamp, number) of an echoed chunk; None for anything else."""
    if len(data) < _STAMP.size:
        return None
    stamp, number = _STAMP.unpack_from(data)
    return stamp, number


async def send(coordinator: Coordinator, session_id: str, number: int) -> int:
    """Append one stamped chunk; returns its stamp."""
    stamp = now_ns()
    await coordinator.append(session_id, InputMode.APPEND_AUDIO_CHUNK, chunk(stamp, number))
    return stamp


class Delivered:
    """The (session, chunk number) pairs delivered, kept where the cyclic collector does
    not walk them: a byte per chunk number in one ``bytearray`` per session. A set of
    60,000 pairs, as a 200-session run delivers, made each of the benchmark process's
    full collections take 8 ms instead of 0.8, and that pause was timed as the
    pipeline's latency."""

    def __init__(self) -> None:
        self._marks: dict[str, bytearray] = {}
        self._count = 0

    def add(self, session_id: str, number: int) -> None:
        marks = self._marks.setdefault(session_id, bytearray())
        if number >= len(marks):
            marks.extend(bytes(max(number + 1 - len(marks), len(marks))))
        if not marks[number]:
            marks[number] = 1
            self._count += 1

    def __contains__(self, item: tuple[str, int]) -> bool:
        marks = self._marks.get(item[0])
        return marks is not None and item[1] < len(marks) and bool(marks[item[1]])

    def __len__(self) -> int:
        return self._count

    def missing(self, sent: Mapping[str, int]) -> int:
        """How many of chunks 1..n of each session were not delivered, for ``sent``
        mapping each session to its last chunk's number n: a count made in C per session,
        so that checking while the last chunks are in flight does not hold them up."""
        missing = 0
        for session_id, last in sent.items():
            marks = self._marks.get(session_id, b"")
            missing += last - marks.count(1, 1, last + 1)
        return missing


@dataclass
class Collector:
    """Follows every attached session's outputs and times them."""

    coordinator: Coordinator
    count_from_ns: int = 0
    """Latencies of inputs stamped before this are not recorded (warm-up)."""
    latencies: array[int] = field(default_factory=lambda: array("q"))
    """Nanoseconds, in an array the cyclic collector does not walk (see ``Delivered``)."""
    delivered: Delivered = field(default_factory=Delivered)
    arrivals: int = 0
    on_delivery: Callable[[str, int, int], None] | None = None
    """Called with (session, number, latency ns) for each delivered chunk."""
    on_output: Callable[[str, OutputEvent, int], None] | None = None
    """Called with (session, output, arrival ns) for every output delivered."""
    stale: int = 0
    """Outputs delivered whose epoch is below what a cancel acknowledged for their session."""
    acknowledged_epoch: dict[str, int] = field(default_factory=dict)
    other: list[OutputEvent] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _stop: bool = False

    def start(self) -> Collector:
        self._task = asyncio.create_task(self._run(), name="collector")
        return self

    async def stop(self) -> None:
        self._stop = True
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        while not self._stop:
            for delivery in await self.coordinator.outputs(block_ms=50):
                if isinstance(delivery.event, OutputEvent):
                    self._judge(delivery.session_id, delivery.event, now_ns())

    def _judge(self, session_id: str, event: OutputEvent, arrived: int) -> None:
        if self.on_output is not None:
            self.on_output(session_id, event, arrived)
        if event.fence.epoch < self.acknowledged_epoch.get(session_id, 0):
            self.stale += 1
        if event.kind is not OutputKind.AUDIO_DELTA:
            self.other.append(event)
            return
        stamped = read_chunk(event.data)
        if stamped is None:
            return
        stamp, number = stamped
        self.arrivals += 1
        self.delivered.add(session_id, number)
        latency = arrived - stamp
        if stamp >= self.count_from_ns:
            self.latencies.append(latency)
        if self.on_delivery is not None:
            self.on_delivery(session_id, number, latency)

    async def wait_for(self, expected: Iterable[tuple[str, int]], limit_s: float) -> bool:
        """Wait until every (session, number) in ``expected`` was delivered."""
        wanted = list(expected)
        deadline = now_ns() + int(limit_s * 1e9)
        while not all(item in self.delivered for item in wanted):
            if now_ns() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def drain(
        self, sent: Mapping[str, int], quiet_s: float = 2.0, limit_s: float = 30.0
    ) -> tuple[int, bool]:
        """Wait for chunks 1..n of every session to be delivered (``sent`` maps each
        session to its n) while deliveries keep coming. Returns how many are missing, and
        whether the wait was cut by ``limit_s`` while deliveries were still arriving (then
        the missing ones are late, not known to be lost)."""
        deadline = now_ns() + int(limit_s * 1e9)
        last, since = self.arrivals, now_ns()
        while True:
            missing = self.delivered.missing(sent)
            if not missing:
                return 0, False
            if now_ns() >= deadline:
                return missing, True
            await asyncio.sleep(0.05)
            if self.arrivals != last:
                last, since = self.arrivals, now_ns()
            elif now_ns() - since >= quiet_s * 1e9:
                return self.delivered.missing(sent), False


async def open_sessions(coordinator: Coordinator, session_ids: Sequence[str]) -> None:
    """Open sessions, 64 at a time."""
    for start in range(0, len(session_ids), 64):
        batch = session_ids[start : start + 64]
        await asyncio.gather(*(coordinator.open(sid) for sid in batch))


async def prime(coordinator: Coordinator, collector: Collector, session_ids: Sequence[str],
                limit_s: float = 120.0) -> None:  # fmt: skip
    """Send chunk 0 to every session and wait for all of them: every session has an owner."""
    for start in range(0, len(session_ids), 64):
        batch = session_ids[start : start + 64]
        await asyncio.gather(*(send(coordinator, sid, 0) for sid in batch))
    if not await collector.wait_for(((sid, 0) for sid in session_ids), limit_s):
        missing = sum((sid, 0) not in collector.delivered for sid in session_ids)
        raise TimeoutError(f"{missing} of {len(session_ids)} sessions got no owner in {limit_s} s")


@dataclass
class LoadResult:
    sessions: int
    offered_eps: float
    seconds: float
    sent: int
    sent_eps: float
    delivered_eps: float
    lost: int
    """Inputs never delivered (deliveries had stopped coming)."""
    undelivered_at_cutoff: int
    """Inputs still queued when the drain wait ended with deliveries still coming."""
    late_slots: int
    """Sends more than one period behind their schedule (the sender could not keep up)."""
    latency: dict[str, float]
    cpu_percent: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def paced_load(
    coordinator: Coordinator,
    collector: Collector,
    session_ids: Sequence[str],
    *,
    seconds: float,
    warmup: float,
) -> LoadResult:
    """Every session sends a chunk each 40 ms for ``warmup + seconds``; latencies of the
    last ``seconds`` count. Inputs not delivered once deliveries have stopped coming are
    counted as lost."""
    period = int(PERIOD_S * 1e9)
    began = now_ns() + 50_000_000
    measured_from = began + int(warmup * 1e9)
    ends = measured_from + int(seconds * 1e9)
    collector.count_from_ns = measured_from
    sent = dict.fromkeys(session_ids, 0)
    """Each session's last chunk sent: its chunks are numbered 1, 2, ... in order."""
    late = 0

    async def session(index: int, sid: str) -> None:
        nonlocal late
        due = began + period * index // max(1, len(session_ids))
        number = 1
        while due < ends:
            wait = due - now_ns()
            if wait > 0:
                await asyncio.sleep(wait / 1e9)
            elif -wait > period:
                late += 1
                due = now_ns()  # behind by more than a chunk: resume from now
            await send(coordinator, sid, number)
            sent[sid] = number
            number += 1
            due += period

    arrivals_at_start = 0

    async def mark_window() -> None:
        nonlocal arrivals_at_start
        await asyncio.sleep(max(0.0, (measured_from - now_ns()) / 1e9))
        arrivals_at_start = collector.arrivals

    marker = asyncio.create_task(mark_window())
    await asyncio.gather(*(session(i, sid) for i, sid in enumerate(session_ids)))
    window_s = max(1e-9, (now_ns() - measured_from) / 1e9)
    in_window = collector.arrivals - arrivals_at_start
    await marker
    lost, cut = await collector.drain(sent)
    total = sum(sent.values())
    return LoadResult(
        sessions=len(session_ids),
        offered_eps=round(len(session_ids) / PERIOD_S, 1),
        seconds=round(seconds, 2),
        sent=total,
        sent_eps=round(total / ((ends - began) / 1e9), 1),
        delivered_eps=round(in_window / window_s, 1),
        lost=0 if cut else lost,
        undelivered_at_cutoff=lost if cut else 0,
        late_slots=late,
        latency=summarize_ns(collector.latencies),
    )


async def saturate(
    coordinator: Coordinator,
    collector: Collector,
    session_ids: Sequence[str],
    *,
    seconds: float,
    warmup: float,
    window: int,
    senders: int | None = None,
) -> dict[str, Any]:
    """Send as fast as deliveries come back (at most ``window`` in flight); events/s
    delivered over the last ``seconds``. One sender per session unless ``senders`` says
    otherwise: a session's appends are taken one at a time (its client waits for each),
    so that is the most the sessions can offer; fewer senders than sessions held the
    offered load below what one worker takes."""
    senders = senders or len(session_ids)
    slots = asyncio.Semaphore(window)
    collector.on_delivery = lambda _sid, _n, _lat: slots.release()
    began = now_ns()
    measured_from = began + int(warmup * 1e9)
    ends = measured_from + int(seconds * 1e9)
    collector.count_from_ns = measured_from
    numbers = dict.fromkeys(session_ids, 1)
    sent = 0

    async def sender(index: int) -> None:
        nonlocal sent
        mine = session_ids[index::senders]
        turn = 0
        while mine and now_ns() < ends:
            await slots.acquire()
            sid = mine[turn % len(mine)]
            turn += 1
            number = numbers[sid]
            numbers[sid] = number + 1
            await send(coordinator, sid, number)
            sent += 1

    tasks = [asyncio.create_task(sender(i)) for i in range(senders)]
    await asyncio.sleep(max(0.0, (measured_from - now_ns()) / 1e9))
    start_arrivals, start_sent, window_from = collector.arrivals, sent, now_ns()
    await asyncio.sleep(max(0.0, (ends - now_ns()) / 1e9))
    window_s = max(1e-9, (now_ns() - window_from) / 1e9)
    delivered = collector.arrivals - start_arrivals
    sent_in_window = sent - start_sent
    for _ in range(senders):
        slots.release()  # a sender waiting for a slot sees the end instead
    await asyncio.gather(*tasks)
    collector.on_delivery = None
    # Every send has returned: each session's chunks 1 .. numbers[sid] - 1 went out.
    lost, cut = await collector.drain({sid: number - 1 for sid, number in numbers.items()})
    return {
        "sent": sent,
        "lost": 0 if cut else lost,
        "undelivered_at_cutoff": lost if cut else 0,
        "seconds": round(window_s, 2),
        "events_per_s": round(delivered / window_s, 1),
        "sent_per_s": round(sent_in_window / window_s, 1),
        "latency_at_saturation": summarize_ns(collector.latencies),
    }
