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
backoff. These shared lanes carry only reads that do not block: a script batch's
``WAIT`` for a replica holds its connection, so script batches have a lane each
while in flight, from a pool per node (``dataplane.replicated``), made by
``NodeLanes.new_lane``. The bells are channels on a cluster, followed on
connections of their own (``dataplane.bell_channels``).

``tests/test_cluster.py`` reads streams on every primary this way, after a
slot moved, and after a primary died.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

from redis.cluster import ClusterParser
from redis.exceptions import AskError, MovedError, ReadOnlyError, ResponseError

from dataplane.cluster import FAILOVER_ERRORS, slot_of
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
        cluster.relearned.append(self._prune)

    def _prune(self, serving: frozenset[str]) -> None:
        """The slot map was learnt again, ``serving`` its primaries: close the lanes to
        other nodes (reads go to primaries only); a read in flight on one is read again
        through redis-py's client, as after any lost connection."""
        for name in [name for name in self._lanes if name not in serving]:
            self._lanes.pop(name).close()

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
            slots.setdefault(slot_of(stream), {})[stream] = last
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
