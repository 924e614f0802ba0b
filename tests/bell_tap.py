"""What consumers' bells were rung with, on one Redis and on a cluster.

On one Redis a bell is a stream: its rings are read back from it. On a cluster a
bell is a shard channel (``dataplane.bell_channels``) that keeps nothing, so the
tap subscribes to every bell of its consumers before the test acts, on a
connection of its own per node (not the product's reader: the tap checks what
the scripts publish). To know that every ring published so far has arrived, it
publishes a marker last on each bell and waits for all of them: a channel's
messages reach a subscriber in the order they were published.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import msgspec

from dataplane.bell_channels import channel_rings
from dataplane.bells import rings_of
from dataplane.bus import RedisBus
from dataplane.cluster import slot_of

Ring = tuple[str, str]

_markers = itertools.count()


class BellTap:
    """The rings each of ``consumers``' bells get while the tap is open."""

    def __init__(self, bus: RedisBus, consumers: list[str]) -> None:
        self.bus = bus
        self.bells = {bell: consumer for consumer in consumers
                      for bell in bus.keys.bells(consumer)}  # fmt: skip
        self._heard: list[tuple[str, bytes]] = []
        self._conns: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> BellTap:
        if not self.bus.cluster:
            return self
        await self.bus.client.initialize()
        nodes: dict[str, tuple[Any, list[str]]] = {}
        manager = self.bus.client.nodes_manager
        for bell in self.bells:
            node = manager.get_node_from_slot(slot_of(bell))
            nodes.setdefault(node.name, (node, []))[1].append(bell)
        for node, bells in nodes.values():
            conn = node.connection_class(**node.connection_kwargs)
            await conn.connect()
            self._conns.append(conn)
            await conn.send_packed_command(conn.pack_commands([("SSUBSCRIBE", b) for b in bells]))
            for _ in bells:
                reply = await conn.read_response(disable_decoding=True)
                assert reply[0] == b"ssubscribe", reply
            self._tasks.append(asyncio.create_task(self._listen(conn)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in self._conns:
            with contextlib.suppress(Exception):
                await conn.disconnect()

    async def _listen(self, conn: Any) -> None:
        while True:
            reply = await conn.read_response(disable_decoding=True)
            if reply[0] == b"smessage":
                self._heard.append((reply[1].decode(), reply[2]))

    async def messages(self, consumer: str) -> list[list[Ring]]:
        """The rings of each entry (one Redis) or message (a cluster) ``consumer``'s
        bells got, in order per bell."""
        bells = [bell for bell, owner in self.bells.items() if owner == consumer]
        if not self.bus.cluster:
            return [rings_of(entry.fields) for bell in bells
                    for entry in await self.bus.xrange(bell)]  # fmt: skip
        await self._all_heard(bells)
        heard = [channel_rings(payload) for bell, payload in self._heard if bell in bells]
        return [rings for rings in heard if rings[0][1] != "m"]

    async def rings(self, consumer: str) -> list[Ring]:
        """Every ring ``consumer``'s bells got: (session id, kind)."""
        return [ring for message in await self.messages(consumer) for ring in message]

    async def _all_heard(self, bells: list[str]) -> None:
        """Publish a marker on each of ``bells`` and wait until every one came back."""
        marker = f"marker {next(_markers)}"
        payload = b"m" + msgspec.msgpack.encode([marker])
        for bell in bells:
            await self.bus.client.eval("redis.call('SPUBLISH', KEYS[1], ARGV[1])", 1, bell, payload)
        async with asyncio.timeout(10):
            while sum(1 for _, p in self._heard if p == payload) < len(bells):
                await asyncio.sleep(0.01)


async def stored_rings(bus: RedisBus, consumer: str) -> list[Ring]:
    """The rings kept in ``consumer``'s bell streams (on a cluster, only what was written
    there before its bells became channels, or by a test)."""
    return [ring for bell in bus.keys.bells(consumer)
            for entry in await bus.xrange(bell) for ring in rings_of(entry.fields)]  # fmt: skip
