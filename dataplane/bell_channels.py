"""Bells on Redis Cluster: shard channels, one subscription connection per node.

On one Redis a consumer's bell is one stream, read by one blocking XREAD. On a
cluster a consumer has a bell in each partition (``PARTITIONS``, each its own
slot, so that a script rings it in the same atomic step as it writes the
session's streams), and a blocking XREAD cannot span slots: read as streams,
that was a blocking read per slot and consumer, each re-sent after every ring
(16 per consumer, about one command per event on each side), and every ring an
entry written, replicated and fsynced. There a bell is a shard channel instead
(``SPUBLISH`` from the script, ``dataplane.scripts``): a ring costs the primary
a message to the subscribers of that moment and nothing stored, and a reader
holds one connection per primary, subscribed to its bells of every slot that
primary serves (one ``SSUBSCRIBE`` per slot: a cluster refuses one across
slots), which Redis writes the rings to as they happen.

On a plain-TCP cluster each connection is a lane (``dataplane.lane``) whose
messages are parsed by hiredis and handled in the connection's data callback, as
they arrive: no task wakes and no read is awaited per message. Through redis-py's
connection (a TLS cluster) each message is one awaited read with its own timeout,
several times the CPU per ring (``bench/bell_cost.py``).

A ring is a hint, as on one Redis (``dataplane.bells``), and a channel keeps
nothing for a reader that was not subscribed. Whenever the subscriptions are
made again (a node failed or was cut off, a slot moved: its node tells its
subscribers with ``sunsubscribe``) the reader is told (``on_gap``) once every
bell is subscribed again, and reads every session it follows: a ring sent in
between is not lost, only its session read then. A connection quiet for a
while is asked for a ``PING``; one that does not answer within the same while is
taken as lost (a node cut off with its socket left open).

``tests/test_doorbells.py`` runs each ring test on a cluster too, and
``tests/test_bell_channels.py`` follows bells through killed connections and a slot
migrated to another primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from dataplane.cluster import slot_of
from dataplane.lane import Lane
from dataplane.node_lanes import NodeLanes

log = logging.getLogger("duplexq.bells")

OnRing = Callable[[str, str], None]
"""Called with (session id, kind) for each ring: ``d`` data, ``c`` control."""

SESSION_IDS = msgspec.msgpack.Decoder(list[str])
"""The session ids of a ring: a msgpack array, as the scripts pack it."""


def channel_rings(message: bytes) -> list[tuple[str, str]]:
    """The (session id, kind) rings of one channel message: the kind (``d`` or ``c``)
    then a msgpack array of the session ids rung with it (``dataplane.scripts``)."""
    kind = message[:1].decode()
    return [(session_id, kind) for session_id in SESSION_IDS.decode(message[1:])]


class Moved(Exception):
    """A subscription ended on the node's side (its slot moved elsewhere)."""


@dataclass(frozen=True)
class _Subscribed:
    """One node's connection and the bells it is subscribed to there: a redis-py
    connection, or a subscribed lane's connection (``Lane.subscribe``) with its
    ``lane``."""

    conn: Any
    node: str
    bells: frozenset[str]
    lane: Lane | None = None

    async def close(self) -> None:
        if self.lane is not None:
            await self.lane.aclose()
        else:
            await self.conn.disconnect()


class ChannelBells:
    """Follows a consumer's bells, one shard channel per partition, until stopped."""

    def __init__(
        self,
        cluster: Any,
        bells: Sequence[str],
        on_ring: OnRing,
        on_gap: Callable[[], None],
        started: asyncio.Event,
        *,
        idle_s: float,
        running: Callable[[], bool],
        lanes: NodeLanes | None = None,
    ) -> None:
        self.cluster = cluster
        """The process's cluster client (``dataplane.cluster.ClusterClient``): its slot
        map says which node serves each bell, its nodes how to connect to them."""
        self.lanes = lanes
        """Where a lane to a node comes from (a plain-TCP cluster); None: redis-py's
        connections."""
        self.bells = list(bells)
        self.on_ring = on_ring
        self.on_gap = on_gap
        self.started = started
        self.idle_s = idle_s
        self.running = running

    async def run(self) -> None:
        """Subscribe, follow, and subscribe again after every loss, until ``running()``
        turns false (noticed within ``idle_s``)."""
        failing = False  # logged once per outage, not once per attempt
        while self.running():
            subscribed: list[_Subscribed] = []
            try:
                await self.cluster.initialize()  # learns the slot map once, if not yet
                for node, bells in self._by_node():
                    subscribed.append(await self._subscribe(node, bells))
                if self.started.is_set():
                    self.on_gap()  # rings between the old subscriptions and these
                self.started.set()
                if failing:
                    log.info("bells subscribed again")
                    failing = False
                await self._follow_all(subscribed)
            except Exception as exc:
                if self.running():
                    if not failing:
                        log.warning("bell subscriptions lost (%s); subscribing again", exc)
                    failing = True
                    await asyncio.sleep(0.2)
            finally:
                for sub in subscribed:
                    with contextlib.suppress(Exception):
                        await sub.close()
            if self.running():
                with contextlib.suppress(Exception):
                    await self.cluster.refresh()

    def _by_node(self) -> list[tuple[Any, list[str]]]:
        """The bells grouped by the node serving their slot now."""
        manager = self.cluster.nodes_manager
        nodes: dict[str, tuple[Any, list[str]]] = {}
        for bell in self.bells:
            node = manager.get_node_from_slot(slot_of(bell))
            nodes.setdefault(node.name, (node, []))[1].append(bell)
        return list(nodes.values())

    async def _subscribe(self, node: Any, bells: list[str]) -> _Subscribed:
        """A connection of its own to ``node``, subscribed to ``bells`` (one command per
        slot), returned once Redis confirmed every subscription."""
        by_slot: dict[int, list[str]] = {}
        for bell in bells:
            by_slot.setdefault(slot_of(bell), []).append(bell)
        commands = [("SSUBSCRIBE", *group) for group in by_slot.values()]
        if self.lanes is not None:
            return await self._subscribe_lane(node, bells, commands)
        conn = node.connection_class(**node.connection_kwargs)
        try:
            await conn.connect()
            await conn.send_packed_command(conn.pack_commands(commands))
            confirmed = 0
            while confirmed < len(bells):
                reply = await conn.read_response(disable_decoding=True, timeout=self.idle_s)
                if reply is None:
                    raise TimeoutError(f"{node.name} did not confirm the bells' subscriptions")
                if isinstance(reply, Exception):
                    raise reply
                if _kind(reply) == b"ssubscribe":
                    confirmed += 1
                else:
                    self._message(reply)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.disconnect()
            raise
        return _Subscribed(conn, node.name, frozenset(bells))

    async def _subscribe_lane(
        self, node: Any, bells: list[str], commands: list[tuple[str, ...]]
    ) -> _Subscribed:
        """``_subscribe`` on a lane: each message is handled as it is parsed."""
        assert self.lanes is not None
        lane = self.lanes.new_lane(node)
        loop = asyncio.get_running_loop()
        confirmed: asyncio.Future[None] = loop.create_future()
        count = 0

        def pushed(reply: Any) -> None:
            nonlocal count
            if isinstance(reply, Exception):
                raise reply
            if _kind(reply) != b"ssubscribe":
                self._message(reply)
                return
            count += 1
            if count == len(bells) and not confirmed.done():
                confirmed.set_result(None)

        try:
            protocol = await lane.subscribe(commands, pushed)
            either: list[asyncio.Future[Any]] = [confirmed, protocol.ended]
            await asyncio.wait(either, timeout=self.idle_s, return_when=asyncio.FIRST_COMPLETED)
            if protocol.ended.done():
                raise protocol.ended.result()
            if not confirmed.done():
                raise TimeoutError(f"{node.name} did not confirm the bells' subscriptions")
        except BaseException:
            confirmed.cancel()
            await lane.aclose()
            raise
        return _Subscribed(protocol, node.name, frozenset(bells), lane)

    async def _follow_all(self, subscribed: list[_Subscribed]) -> None:
        """Follow every connection until one is lost or moved, or the reader stops."""
        follow = self._follow_lane if self.lanes is not None else self._follow
        tasks = [asyncio.create_task(follow(sub)) for sub in subscribed]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a loss is raised here
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, sub: _Subscribed) -> None:
        asked = False  # a PING is unanswered
        while self.running():
            reply = await sub.conn.read_response(disable_decoding=True, timeout=self.idle_s)
            if reply is None:  # quiet: is the node still there, and still serving?
                if asked:
                    raise TimeoutError(f"{sub.node} did not answer a PING")
                if self._moved(sub):
                    raise Moved(f"a bell's slot is no longer served by {sub.node}")
                await sub.conn.send_packed_command(sub.conn.pack_command("PING"))
                asked = True
                continue
            asked = False
            if isinstance(reply, Exception):
                raise reply
            self._message(reply)

    async def _follow_lane(self, sub: _Subscribed) -> None:
        """``_follow`` for a lane's connection, whose messages are handled as they come:
        this only watches it, every ``idle_s``, for its end and for a quiet spell."""
        protocol = sub.conn
        asked = -1.0  # when an unanswered PING was sent
        while self.running():
            await asyncio.wait([protocol.ended], timeout=self.idle_s)
            if protocol.ended.done():
                raise protocol.ended.result()
            now = time.monotonic()
            if protocol.heard > asked >= 0:  # the node answered
                asked = -1.0
            if now - protocol.heard < self.idle_s:
                continue
            if asked >= 0:
                raise TimeoutError(f"{sub.node} did not answer a PING")
            if self._moved(sub):
                raise Moved(f"a bell's slot is no longer served by {sub.node}")
            protocol.send([("PING",)])
            asked = now

    def _message(self, reply: Any) -> None:
        kind = _kind(reply)
        if kind == b"smessage":
            for session_id, ring_kind in channel_rings(reply[2]):
                self.on_ring(session_id, ring_kind)
        elif kind == b"sunsubscribe":
            raise Moved(f"the node ended the subscription to {reply[1]!r} (its slot moved)")

    def _moved(self, sub: _Subscribed) -> bool:
        """Whether the slot map now puts one of ``sub``'s bells on another node."""
        manager = self.cluster.nodes_manager
        try:
            return any(manager.get_node_from_slot(slot_of(bell)).name != sub.node
                       for bell in sub.bells)  # fmt: skip
        except Exception:
            return True


def _kind(reply: Any) -> bytes:
    """A pushed message's kind (``smessage``, ``ssubscribe``, ``pong``...)."""
    if isinstance(reply, list) and reply and isinstance(reply[0], bytes):
        return reply[0].lower()
    return b""
