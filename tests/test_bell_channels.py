"""Bells on a Redis Cluster are shard channels (``dataplane.bell_channels``).

A reader holds one connection per primary, subscribed to its bells of every slot
there. A channel keeps nothing for a reader that was not listening, so whenever
the reader subscribes again (its connection was lost, a slot moved to another
primary, or the primary stopped answering its PING) it is told (``on_gap``) and
reads every session it follows; the rings after that reach it from wherever the
slot is now served.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import redis

from dataplane.authority import SessionAuthority
from dataplane.bell_channels import channel_rings
from dataplane.bells import BellReader
from dataplane.bus import RedisBus
from schemas.config import echo_pipeline
from schemas.events import TextPayload
from schemas.keys import Keys, partition_of, worker_bell
from tests.bell_tap import BellTap
from tests.redis_cluster import move_slot
from workers.ownership import StageOwnership

PIPELINE = echo_pipeline("echo")
BELL = worker_bell("echo", "w1")


class Heard:
    """What a reader was told: rings, and how many times rings may have been missed."""

    def __init__(self) -> None:
        self.rings: list[tuple[str, str]] = []
        self.gaps = 0

    def ring(self, session_id: str, kind: str) -> None:
        self.rings.append((session_id, kind))

    def gap(self) -> None:
        self.gaps += 1

    async def until(self, ring: tuple[str, str], *, gaps: int = 0) -> None:
        async with asyncio.timeout(10):
            while ring not in self.rings or self.gaps < gaps:
                await asyncio.sleep(0.01)


@pytest.fixture(params=["lanes", "redis-py"])
def path(request: pytest.FixtureRequest) -> str:
    """How the reader's connections are made: lanes (a plain-TCP cluster, as the tests'
    cluster is) or redis-py's connections (as on a TLS cluster, where a bus has no
    lanes)."""
    return str(request.param)


def cluster_bus(url: str, prefix: str, path: str) -> RedisBus:
    bus = RedisBus(url, Keys(prefix))
    if path == "redis-py":
        bus.node_lanes = None  # as a TLS cluster's bus: reads and bells through redis-py
    return bus


@asynccontextmanager
async def reading(bus: RedisBus) -> AsyncIterator[Heard]:
    """A bell reader of ``BELL`` on ``bus``, subscribed, until the block ends. Its
    ``block_ms`` is 200, not the shipped 500, so that a quiet spell and its PING take
    less of a test's time; the nemesis suite runs its cluster with the shipped value."""
    heard = Heard()
    running = True
    reader = BellReader(bus, BELL, heard.ring, block_ms=200, running=lambda: running,
                        on_gap=heard.gap)  # fmt: skip
    task = asyncio.create_task(reader.run())
    try:
        async with asyncio.timeout(10):
            await reader.started.wait()
        yield heard
    finally:
        running = False
        async with asyncio.timeout(5):
            await task


async def held_session(bus: RedisBus, session_id: str) -> SessionAuthority:
    """``session_id`` opened, and held on the echo stage by w1 (whose bell it rings)."""
    authority = SessionAuthority(bus, PIPELINE)
    await authority.open(session_id)
    _, lease = await StageOwnership(bus, PIPELINE, "echo", "w1", 60_000).acquire(session_id, 0)
    assert lease is not None
    return authority


def test_a_channel_message_names_its_kind_then_its_sessions():
    message = b"c" + msgspec.msgpack.encode(["s1", "a b"])
    assert channel_rings(message) == [("s1", "c"), ("a b", "c")]


async def test_a_reader_hears_rings_again_after_its_connections_are_killed(
    redis_cluster, key_prefix, path
):
    bus = cluster_bus(redis_cluster.url, key_prefix, path)
    try:
        authority = await held_session(bus, "s1")
        async with reading(bus) as heard:
            await authority.append("s1", "append_text", TextPayload("one"))
            await heard.until(("s1", "d"))
            assert heard.gaps == 0
            for node in redis_cluster.nodes:  # every subscriber's connection, cut
                with redis.Redis(port=node.port) as client:
                    client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            heard.rings.clear()
            await authority.append("s1", "append_text", TextPayload("two"))
            # Told of the gap once subscribed again: the append above may have been
            # made before, and its ring lost; the ring of the next one is heard.
            async with asyncio.timeout(10):
                while heard.gaps < 1:
                    await asyncio.sleep(0.01)
            await authority.append("s1", "append_text", TextPayload("three"))
            await heard.until(("s1", "d"), gaps=1)
    finally:
        await bus.aclose()


async def test_a_reader_follows_its_bell_to_the_primary_its_slot_moved_to(own_cluster, path):
    bus = cluster_bus(own_cluster.url, "moved", path)
    try:
        authority = await held_session(bus, "s1")
        bell = bus.keys.session("s1").bell(BELL)
        source = own_cluster.primary_of(bell)
        target = next(n for n in own_cluster.nodes if n.port != source.port)
        async with reading(bus) as heard:
            await authority.append("s1", "append_text", TextPayload("before"))
            await heard.until(("s1", "d"))
            slot = int(redis.Redis(port=source.port).execute_command("CLUSTER", "KEYSLOT", bell))
            move_slot(source, target, own_cluster.nodes, slot)
            own_cluster.wait_ok()
            assert own_cluster.primary_of(bell).port == target.port
            async with asyncio.timeout(10):  # the source ended the subscription: again
                while heard.gaps < 1:
                    await asyncio.sleep(0.01)
            heard.rings.clear()
            await authority.append("s1", "append_text", TextPayload("after"))
            await heard.until(("s1", "d"), gaps=1)
    finally:
        await bus.aclose()


async def test_calls_of_one_batch_ring_a_channel_once_per_kind(redis_cluster, key_prefix):
    """As a stream bell gets one entry per batch (``test_doorbells``), a channel gets one
    message per kind for the calls of one batch in its partition."""
    ids = (f"b{i}" for i in itertools.count())
    sessions = list(itertools.islice((s for s in ids if partition_of(s) == 3), 3))
    bus = RedisBus(redis_cluster.url, Keys(key_prefix))
    try:
        async with BellTap(bus, [BELL]) as tap:
            held = [(await held_session(bus, sid), sid) for sid in sessions]
            await asyncio.gather(
                *(a.append(sid, "append_text", TextPayload("x")) for a, sid in held)
            )
            await asyncio.gather(*(a.cancel(sid, reason="barge_in") for a, sid in held))
            assert [sorted(m) for m in await tap.messages(BELL)] == [
                sorted((sid, "d") for sid in sessions),
                sorted((sid, "c") for sid in sessions),
            ]
    finally:
        await bus.aclose()


async def test_a_reader_whose_primary_stops_answering_subscribes_again(own_cluster, path):
    """A primary that stops answering with its socket left open (stopped with SIGSTOP,
    for less than the cluster's node timeout, so no failover) sends nothing, not even a
    closed socket: the reader's PING goes unanswered, it subscribes again once the node
    answers, and is told of the gap."""
    bus = cluster_bus(own_cluster.url, "quiet", path)
    try:
        authority = await held_session(bus, "s1")
        node = own_cluster.primary_of(bus.keys.session("s1").bell(BELL))
        assert node.proc is not None
        async with reading(bus) as heard:
            await authority.append("s1", "append_text", TextPayload("before"))
            await heard.until(("s1", "d"))
            os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(0.8)  # four of the reader's quiet spells (block_ms 200)
            finally:
                os.kill(node.proc.pid, signal.SIGCONT)
            async with asyncio.timeout(10):
                while heard.gaps < 1:
                    await asyncio.sleep(0.01)
            heard.rings.clear()
            await authority.append("s1", "append_text", TextPayload("after"))
            await heard.until(("s1", "d"), gaps=1)
    finally:
        await bus.aclose()
