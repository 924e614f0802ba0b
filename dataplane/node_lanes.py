"""Stream reads on a Redis Cluster over a lane per node.

A worker's and a coordinator's rounds read many sessions' streams at once
without blocking (``RedisBus.xread_now``). A cluster refuses a read across
slots, so each slot's streams are read by an XREAD of their own; through
redis-py's cluster client each of those was a command of its own (a slot
lookup, a pool checkout, a retry wrapper, a reply parsed in Python), and
that was the largest share of a process's CPU on a cluster. Here the
slots' XREADs are grouped by the primary serving them and each primary gets
its group in one write on its lane (``dataplane.lane``: one pipelined
connection, replies parsed by hiredis), one round trip per primary.

The slot map is redis-py's: the client learns it, and learns it again after a
redirection or a failover. A group that meets any of those here (``MOVED``,
``ASK``, ``CLUSTERDOWN``, a lost connection, a timeout) is read again
through redis-py's client, which follows the redirection or waits out the
failover with its retries (``dataplane.cluster``); a node's lane never
retries on its own, so a dead node costs one failed write, not a lane's
backoff. These shared lanes carry only reads that do not block: a blocking
read holds its connection, and so does a script batch's ``WAIT`` for a
replica. The bells' blocking reads each have a lane of their own
(``SlotReader``), and script batches a lane each while in flight, from a pool
per node (``dataplane.replicated``), both made by ``NodeLanes.new_lane``.

``tests/test_cluster.py`` reads streams on every primary this way, after a
slot moved, and after a primary died.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

from redis.cluster import ClusterParser
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError, ReadOnlyError, ResponseError

from dataplane.cluster import FAILOVER_ERRORS
from dataplane.lane import Lane

T = TypeVar("T")

ELSEWHERE: tuple[type[BaseException], ...] = (*FAILOVER_ERRORS, MovedError, AskError, ReadOnlyError)
"""What a node's read meets when its slot is elsewhere or the cluster is changing: the
read is made again through redis-py's client."""


class NodeLanes:
    """A lane to each node of a cluster that reads go to, opened when first used."""

    def __init__(self, cluster: Any, *, timeout_s: float, connect_timeout_s: float) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._lanes: dict[str, Lane] = {}
        """Node name (host:port) -> its lane."""

    def lane(self, node: Any) -> Lane:
        """The node's lane (the same one each time)."""
        lane = self._lanes.get(node.name)
        if lane is None:
            lane = self._lanes[node.name] = self.new_lane(node)
        return lane

    def new_lane(self, node: Any) -> Lane:
        """A lane to ``node`` that its caller owns (and closes), with these timeouts and
        the client's credentials; it never retries on its own."""
        kwargs = node.connection_kwargs
        user, password = kwargs.get("username"), kwargs.get("password")
        auth = ""
        if password is not None:
            auth = f"{quote(user or '', safe='')}:{quote(password, safe='')}@"
        return Lane(
            f"redis://{auth}{node.host}:{node.port}", timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s, retries=0,
        )  # fmt: skip

    async def read_now(
        self,
        streams: Mapping[str, str],
        count: int,
        parse: Callable[[Any], list[T]],
        again: Callable[[dict[str, str]], Awaitable[list[T]]],
    ) -> list[T]:
        """The entries after each stream's last id read (``streams``), read without
        blocking, each raw reply parsed by ``parse``; a slot whose read failed here is
        read with ``again`` (redis-py's client)."""
        slots: dict[int, dict[str, str]] = {}
        for stream, last in streams.items():
            slots.setdefault(key_slot(stream.encode()), {})[stream] = last
        nodes: dict[str, tuple[Any, list[dict[str, str]]]] = {}
        manager = self.cluster.nodes_manager
        reads: list[Awaitable[list[T]]] = []
        for slot, group in slots.items():
            try:
                node = manager.get_node_from_slot(slot)
            except ELSEWHERE:  # the slot map is being learnt again: redis-py's path waits
                reads.append(again(group))
                continue
            nodes.setdefault(node.name, (node, []))[1].append(group)
        for node, groups in nodes.values():
            reads.append(self._node_read(node, groups, count, parse, again))
        return [entry for entries in await asyncio.gather(*reads) for entry in entries]

    async def _node_read(
        self,
        node: Any,
        groups: list[dict[str, str]],
        count: int,
        parse: Callable[[Any], list[T]],
        again: Callable[[dict[str, str]], Awaitable[list[T]]],
    ) -> list[T]:
        """One slot's XREAD per group, all in one write on the node's lane."""
        commands = [("XREAD", "COUNT", count, "STREAMS", *group, *group.values())
                    for group in groups]  # fmt: skip
        replies: list[Any]
        try:
            replies = await self.lane(node).pipeline(commands)
        except ELSEWHERE as exc:  # lost connection, timeout: each group goes redis-py's way
            replies = [exc] * len(groups)
        out: list[T] = []
        for group, reply in zip(groups, replies, strict=True):
            if not isinstance(reply, Exception):
                out += parse(reply)
            elif elsewhere(reply):
                out += await again(group)
            else:
                raise reply
        return out

    async def aclose(self) -> None:
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            await lane.aclose()


class SlotReader:
    """Blocking reads of one slot's streams (a group of bells) over a lane of its own to
    the node serving the slot, instead of redis-py's cluster client: a blocking read
    holds its connection, and on a cluster each slot's bells have a reader of their own,
    read about once per event; through redis-py each of those reads was the largest
    share of a worker's and a coordinator's CPU. A read that meets a redirection, a
    failover or a lost connection is made through ``fallback`` (redis-py's, which
    follows it and learns the slot map again); the next read finds the slot's node
    again."""

    def __init__(self, lanes: NodeLanes, fallback: Any) -> None:
        self.lanes = lanes
        self.fallback = fallback
        """A redis-py cluster client for blocking reads (``RedisBus.reader``; its owner
        closes it)."""
        self._lane: Lane | None = None
        self._node = ""

    async def read(
        self,
        streams: Mapping[str, str],
        on_lane: Callable[[Lane], Awaitable[list[T]]],
        again: Callable[[Any], Awaitable[list[T]]],
    ) -> list[T]:
        """The read of ``streams`` (all in one slot) made by ``on_lane`` with the lane to
        the slot's node, or by ``again(fallback)``."""
        slot = key_slot(next(iter(streams)).encode())
        try:
            node = self.lanes.cluster.nodes_manager.get_node_from_slot(slot)
        except ELSEWHERE:
            return await self._elsewhere(again)
        if node.name != self._node or self._lane is None:
            if self._lane is not None:
                await self._lane.aclose()
            self._lane, self._node = self.lanes.new_lane(node), node.name
        try:
            return await on_lane(self._lane)
        except Exception as exc:
            if elsewhere(exc):
                return await self._elsewhere(again)
            raise

    async def _elsewhere(self, again: Callable[[Any], Awaitable[list[T]]]) -> list[T]:
        """The read through ``fallback``; then the client that the lanes' nodes come
        from learns the slot map again (the fallback learnt it for itself only), so the
        next read finds the slot's node."""
        entries = await again(self.fallback)
        await self.lanes.cluster.refresh()
        return entries

    async def aclose(self) -> None:
        if self._lane is not None:
            await self._lane.aclose()
            self._lane = None


def elsewhere(error: Exception) -> bool:
    """Whether ``error`` (raised, or an error reply as a lane gives it) means the slot is
    served elsewhere or the cluster is changing: the read goes redis-py's way."""
    return isinstance(error, ELSEWHERE) or isinstance(named_error(error), ELSEWHERE)


def named_error(reply: Exception) -> Exception:
    """The cluster's error for an error reply: a lane names MOVED, ASK, CLUSTERDOWN...
    as a plain ``ResponseError`` (and NOSCRIPT, READONLY, OOM as redis-py does)."""
    if type(reply) is not ResponseError:
        return reply  # named already (NoScriptError, ReadOnlyError...) or not a reply
    error = ClusterParser.parse_error(str(reply))
    return error if isinstance(error, Exception) else reply
