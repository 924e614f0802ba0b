"""Bells: how a reader learns which of the sessions it follows have news.

A worker follows the streams of every session it owns, a coordinator the
journals of every session attached to it. Reading all of those on every round
costs O(sessions) per round, and rounds grow with the load. Instead, every
script that writes a stream rings its consumer's bell in the session's
partition (``schemas.keys``), in the same atomic step. A reader blocks on its
consumer's bells only (``PARTITIONS`` keys, whatever the number of sessions),
and then reads just the sessions that rang (``Dirty``), one XREAD per slot. On a
cluster the bells are shard channels instead of streams (``dataplane.bell_channels``).

A ring is a hint, never the data: the streams stay the truth. A reader that
missed rings (a bell is capped at ``BELL_LENGTH``; a reader started after the
ring) finds the sessions anyway, because a session is read once when it is
taken or attached, and every session is swept (read without a ring) every
``sweep_ms``. Rings for sessions the reader does not follow are ignored.

A ring entry names its sessions by kind (``rings_of``): the calls of one script
batch ring each bell once, with the sessions rung listed in one field per kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from dataplane.bell_channels import SESSION_IDS, ChannelBells, OnRing
from dataplane.bus import RedisBus
from dataplane.pacing import Pacer

log = logging.getLogger("duplexq.bells")

RING_BATCH = 1024
"""Most rings one bell read returns."""


def rings_of(fields: dict[bytes, bytes]) -> list[tuple[str, str]]:
    """The (session id, kind) rings of one bell entry: fields ``d`` and ``c``, each a
    msgpack array of the session ids rung with that kind (``dataplane.scripts``). Entries
    written before name each session as a field ``:<session id>`` valued with its kind,
    or as ``s=<session id>`` and ``k=<kind>``."""
    rings = [(session_id, kind) for kind in ("d", "c")
             for session_id in SESSION_IDS.decode(fields.get(kind.encode(), b"\x90"))]  # fmt: skip
    if b"s" in fields:
        rings.append((fields[b"s"].decode(), fields.get(b"k", b"d").decode()))
    rings += [(f[1:].decode(), k.decode()) for f, k in fields.items() if f[:1] == b":"]
    return rings


class BellReader:
    """Follows one consumer's bells in every partition until stopped."""

    def __init__(
        self,
        bus: RedisBus,
        consumer: str,
        on_ring: OnRing,
        *,
        block_ms: int,
        running: Callable[[], bool] = lambda: True,
        on_gap: Callable[[], None] = lambda: None,
    ) -> None:
        self.bus = bus
        self.bells = bus.keys.bells(consumer)
        self.on_ring = on_ring
        self.block_ms = block_ms
        self.running = running
        self.on_gap = on_gap
        """Called when rings may have been missed (on a cluster, the bells' channels were
        subscribed to again): the reader then reads every session it follows."""
        self.started = asyncio.Event()
        """Set once the bells' positions are known: every ring after it is seen. Readers
        take or attach sessions only then, or a ring in between would be missed."""

    async def run(self) -> None:
        """Read rings until ``running()`` turns false; blocking reads end by themselves."""
        if self.bus.cluster:
            channels = ChannelBells(
                self.bus.client, self.bells, self.on_ring, self.on_gap, self.started,
                idle_s=self.block_ms / 1000, running=self.running, lanes=self.bus.node_lanes,
            )  # fmt: skip
            await channels.run()
            return
        while True:
            try:
                cursors = await self.bus.tails(self.bells)
                break
            except Exception:
                log.exception("reading the bells' positions failed; retrying")
                await asyncio.sleep(0.5)
        self.started.set()
        async with asyncio.TaskGroup() as group:
            for bells in self.bus.slot_groups(self.bells):
                group.create_task(self._follow(bells, cursors))

    async def _follow(self, bells: list[str], cursors: dict[str, str]) -> None:
        conn = self.bus.stream_reader(self.block_ms)
        pacer = Pacer(self.bus.linger_ms)  # rings that come meanwhile join the next read
        while self.running():
            await pacer.pace()
            try:
                entries = await self.bus.xread(
                    conn, {bell: cursors[bell] for bell in bells}, RING_BATCH, self.block_ms
                )
            except Exception:
                log.exception("reading bells failed; retrying")
                await asyncio.sleep(0.2)
                continue
            pacer.carried(len(entries))
            for entry in entries:
                cursors[entry.stream] = entry.id
                for session_id, kind in rings_of(entry.fields):
                    self.on_ring(session_id, kind)


class Dirty:
    """The sessions a reader must read next: rung, newly followed, or due a sweep."""

    def __init__(self, sweep_ms: int) -> None:
        self.sweep_ms = sweep_ms
        self.pending: set[str] = set()
        self.ready = asyncio.Event()
        self._swept = time.monotonic()

    def mark(self, session_id: str) -> None:
        self.pending.add(session_id)
        self.ready.set()

    def mark_all(self, session_ids: Iterable[str]) -> None:
        self.pending.update(session_ids)
        self.ready.set()

    def sweep_now(self) -> None:
        """Make the next round a sweep: rings may have been missed."""
        self._swept = float("-inf")
        self.ready.set()

    def sweep_due(self) -> bool:
        """True once per ``sweep_ms``: the caller then marks everything it follows."""
        now = time.monotonic()
        if (now - self._swept) * 1000 < self.sweep_ms:
            return False
        self._swept = now
        return True

    async def wait(self, timeout_ms: int) -> None:
        """Wait for a mark, at most ``timeout_ms`` and never past the next sweep."""
        until_sweep = self.sweep_ms - (time.monotonic() - self._swept) * 1000
        wait_ms = max(1.0, min(float(timeout_ms), until_sweep))
        self.ready.clear()
        # A timeout around the wait rather than ``asyncio.wait_for``, which on Python 3.11
        # runs the wait in a task of its own: one more task and wake-up per round.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_ms / 1000):
                await self.ready.wait()
