"""The Redis Cluster client, steadied for failovers.

redis-py's cluster client reacts to a failed node in ways that hurt a server
with many commands in flight, so three of its reactions are changed here:

- A connection to a dead node is not retried for long. A node's connections
  retry their connect briefly (``CONNECT_RETRY``); the command is then retried
  by the client as a whole, with the slot map learnt again, so it goes to the
  replica promoted in the dead node's place.
- A command is retried through a failover (``CLUSTERDOWN``, an unreachable
  node, an uncovered slot) for up to ``RETRY_S`` with backoff, as a command on
  one Redis is retried through a restart; redis-py alone gives up after a
  fixed number of quick tries, long before a replica is promoted.
- Learning the slot map again keeps the node objects (and their connections)
  of nodes that still serve. redis-py replaces every node object and closes
  every connection, including those other commands are using at that moment,
  which fail with errors no retry covers (``AttributeError`` on a connection
  closed under a write). Its "close everything and start again" on an error
  is likewise turned into "learn the slot map again before the next command".
- Learning the slot map again asks first the nodes that answer at all: redis-py
  asks the nodes one after the other, and a node that is stopped or cut off
  (its socket open, nothing answered) held every refresh, and so every command
  retried meanwhile, until its timeout: seconds in which a worker's leases on
  the live primaries lapsed (``tests/test_heartbeat.py``). Each node is probed
  with a ``PING`` on a socket of its own (no pooled connection is cancelled
  mid-reply) for ``PROBE_S``; a node behind TLS answers no plain probe and
  keeps its place.

``tests/test_cluster.py`` kills a primary with SIGKILL under load and checks
that every acknowledged input is answered once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio.cluster import ClusterNode, NodesManager, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dataplane.full import full_error, refused_for_memory
from dataplane.packing import PackedConnection

PROBE_S = 0.25
"""How long a node may take to answer the probe that orders a refresh's nodes."""

RETRY_S = 30.0
"""How long a command is retried through a failover before its error is raised."""

FAILOVER_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterDownError,
    SlotNotCoveredError,
    TryAgainError,
    MasterDownError,
    ClusterError,  # "TTL exhausted": redirected too often while slots moved
    RedisClusterException,  # no node reachable while the slot map was learnt
)
"""Errors that mean "the cluster is changing": retried with the slot map learnt again."""


SLOT_CACHE = 65_536
"""Keys whose slot is remembered (``slot_of``); the memory is emptied when full."""

_slots: dict[str, int] = {}


def slot_of(key: str) -> int:
    """The cluster slot of ``key``, remembered: a process names the same keys on every
    round (its sessions' streams, its bells), and redis-py computes CRC16 in Python, a
    microsecond or two a key, several keys an event."""
    slot = _slots.get(key)
    if slot is None:
        if len(_slots) >= SLOT_CACHE:
            _slots.clear()
        slot = _slots[key] = key_slot(key.encode())
    return slot


_READ_OPTIONS = {"COUNT": 1, "BLOCK": 1, "GROUP": 2, "NOACK": 0}
"""XREAD / XREADGROUP options before STREAMS, with how many values each takes."""


def stream_read_keys(args: tuple[Any, ...]) -> list[Any]:
    """The stream keys of an XREAD or XREADGROUP (``args``: what follows the command's
    name), or [] where they cannot be told apart from the options."""
    at = 0
    while at < len(args):
        token = args[at]
        word = (token.decode() if isinstance(token, bytes) else str(token)).upper()
        if word == "STREAMS":
            rest = args[at + 1 :]
            return list(rest[: len(rest) // 2])
        taken = _READ_OPTIONS.get(word)
        if taken is None:
            return []
        at += 1 + taken
    return []


def connect_retry() -> Retry:
    """A node's connect is retried briefly: a dead node must surface fast."""
    return Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=2)


_in_command: contextvars.ContextVar[bool] = contextvars.ContextVar("in_command", default=False)
"""True while a command of this task runs: redis-py's ``aclose`` from its error
handling is then a request to learn the slot map again, not a shutdown."""


_closing: set[asyncio.Task[None]] = set()
"""Closes of nodes gone from the cluster, still running."""


async def _close(node: Any) -> None:
    try:
        await node.disconnect()
    except Exception:  # a dead node's sockets: nothing left to close cleanly
        return


def _close_later(node: Any) -> None:
    """Close ``node``'s connections in a task of their own (``set_nodes`` is not async)."""
    task = asyncio.create_task(_close(node))
    _closing.add(task)
    task.add_done_callback(_closing.discard)


class _StableNodes(NodesManager):
    """Learns the slot map again but keeps the node objects of nodes still serving."""

    __slots__ = ()

    async def initialize(self) -> None:
        await super().initialize()
        # The slot map was built from fresh node objects; point it at the kept ones.
        kept: dict[int, list[Any]] = {}
        for slot, nodes in self.slots_cache.items():
            same = kept.get(id(nodes))
            if same is None:
                same = kept[id(nodes)] = [self.nodes_cache.get(n.name, n) for n in nodes]
            self.slots_cache[slot] = same

    def set_nodes(self, old: Any, new: Any, remove_old: bool = False) -> None:
        """As the parent, but a node still serving keeps its object (and connections);
        only nodes gone from the cluster are closed.

        The seed nodes (``startup_nodes``) take the serving nodes' objects, as in the
        parent, and a seed's own object is closed: redis-py drops a seed from its dict
        when a command to that node fails, without closing it, and the socket its slot
        map query had opened was left for the garbage collector to find."""
        if remove_old:
            for name in list(old):
                if name not in new:
                    _close_later(old.pop(name))
        seeds = old is self.startup_nodes
        for name, node in new.items():
            kept = old.get(name)
            if kept is None or kept is node:
                old[name] = node
            elif seeds:
                old[name] = node
                _close_later(kept)
            else:
                kept.server_type = node.server_type

    async def aclose(self, attr: str = "nodes_cache") -> None:
        if _in_command.get():  # a failed slot-map refresh inside a command: keep serving
            return
        await super().aclose(attr)


class ClientClosedError(RuntimeError):
    """A command, or a refresh of the slot map, on a cluster client already closed."""


class ClusterClient(RedisCluster):
    """redis-py's asyncio cluster client with the failover behaviour described above."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nodes_manager.__class__ = _StableNodes
        self._refreshing = asyncio.Lock()
        self._refreshed_at = 0.0
        """When the last successful refresh started."""
        self._closed = False
        """Closed for good (``close_for_good``). redis-py would connect afresh for a command,
        or a refresh, made after that, and the sockets it opened then were left for the
        garbage collector (``tests/test_cluster_close.py``)."""
        self.relearned: list[Callable[[frozenset[str]], None]] = []
        """Called with the primaries' names each time the whole slot map was learnt
        (again): the data plane's lanes to other nodes are closed then
        (``dataplane.lane_pool``, ``dataplane.node_lanes``)."""

    async def initialize(self) -> ClusterClient:
        if self._closed:
            raise ClientClosedError("the Redis Cluster client is closed")
        learning = self._initialize
        await super().initialize()
        if learning:
            self._tell_relearned()
        return self

    def _tell_relearned(self) -> None:
        primaries = frozenset(node.name for node in self.get_primaries())
        for listener in self.relearned:
            listener(primaries)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ClientClosedError("the Redis Cluster client is closed")
        deadline = time.monotonic() + RETRY_S
        delay = 0.02
        token = _in_command.set(True)
        try:
            while True:
                try:
                    return await super().execute_command(*args, **kwargs)
                except FAILOVER_ERRORS:
                    if time.monotonic() + delay > deadline:
                        raise
                except ResponseError as exc:  # as ``dataplane.bus``'s client raises it
                    if refused_for_memory(exc):
                        raise full_error(exc) from exc
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                await self.refresh()
        finally:
            _in_command.reset(token)

    def keyslot(self, key: Any) -> int:
        """The slot of ``key``, remembered for a text key (``slot_of``)."""
        return slot_of(key) if isinstance(key, str) else int(super().keyslot(key))

    async def _determine_slot(self, command: str, *args: Any) -> int:
        """A stream read's slot is its streams' slot, found here. redis-py asks a node
        for the keys of every command whose keys can move (``COMMAND GETKEYS``), a round
        trip before each XREAD: that was a fifth of a worker's CPU on a cluster."""
        if command.upper() in ("XREAD", "XREADGROUP"):
            slots = {self.keyslot(key) for key in stream_read_keys(args)}
            if len(slots) == 1:
                return slots.pop()
        return int(await super()._determine_slot(command, *args))

    async def refresh(self) -> None:
        """Learn the slot map again (a failover moved slots to a promoted replica);
        connections to nodes that still serve stay open. Errors are left to the next
        command."""
        asked = time.monotonic()
        if self._closed:
            return
        async with self._refreshing:
            if self._refreshed_at >= asked:  # a refresh began after we asked: use it
                return
            started = time.monotonic()
            token = _in_command.set(True)
            try:
                await self._answering_first()
                await self.nodes_manager.initialize()
                self._initialize = False
                self._refreshed_at = started
                self._tell_relearned()
            except Exception:  # no node answered yet: the next attempt asks again
                self._initialize = True
            finally:
                _in_command.reset(token)

    async def _answering_first(self) -> None:
        """Order the nodes a refresh asks so that those answering a probe come first
        (in their order before); the dict is reordered in place (it is compared by
        identity in ``_StableNodes.set_nodes``)."""
        seeds = self.nodes_manager.startup_nodes
        nodes = list(seeds.items())
        answers = await asyncio.gather(*(_answers(node.host, int(node.port)) for _, node in nodes))
        if all(answers) or not any(answers):
            return
        seeds.clear()
        seeds.update([item for item, ok in zip(nodes, answers, strict=True) if ok])
        seeds.update([item for item, ok in zip(nodes, answers, strict=True) if not ok])

    async def aclose(self) -> None:
        if _in_command.get():  # redis-py's reaction to an error, not a shutdown
            self._initialize = True
            return
        # redis-py closes only a client it holds initialised, but one whose last slot-map
        # refresh failed (or whose command's error asked for one) still holds the
        # connections of every node it knew: close them all, whatever the flag says.
        self._initialize = True
        await self.nodes_manager.aclose()
        await self.nodes_manager.aclose("startup_nodes")

    async def close_for_good(self) -> None:
        """Close for good: later commands and refreshes are refused
        (``ClientClosedError``). ``aclose`` alone is what redis-py's cluster pipeline
        calls after a connection error, to start again with the next command: the client
        must serve on after it (``tests/test_cluster_close.py``)."""
        self._closed = True
        await self.aclose()


async def _answers(host: str, port: int) -> bool:
    """Whether a node at ``host``:``port`` answers a plain ``PING`` within ``PROBE_S``
    (any reply counts, an authentication error too)."""
    try:
        async with asyncio.timeout(PROBE_S):
            reader, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    try:
        async with asyncio.timeout(PROBE_S):
            writer.write(b"PING\r\n")
            await writer.drain()
            return bool(await reader.read(1))
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def seed_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """Split a ``redis+cluster://[user:pass@]HOST:PORT[,HOST:PORT...][/...]`` URL into
    the plain URL of its first node and the (host, port) of the others.

    Any node can tell the client the whole cluster, so one is enough while it is up;
    naming several lets a process start (and learn the slot map again) while the first
    one is down."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a URL: {url!r}")
    scheme = scheme.replace("+cluster", "", 1)
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    first, *others = hosts.split(",")
    seeds: list[tuple[str, int]] = []
    for other in others:
        host, colon, port = other.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"cluster node {other!r} in {url!r} is not HOST:PORT")
        seeds.append((host, int(port)))
    return f"{scheme}://{userinfo}{at}{first}{tail}", seeds


def cluster_client(url: str, **options: Any) -> ClusterClient:
    """A cluster client for a ``redis+cluster://`` URL naming one node of the cluster or
    several, comma-separated (``seed_nodes``)."""
    options.pop("single_connection_client", None)
    options.pop("health_check_interval", None)
    options.pop("retry_on_error", None)
    options["retry"] = connect_retry()
    plain, seeds = seed_nodes(url)
    if seeds:
        options["startup_nodes"] = [ClusterNode(host, port) for host, port in seeds]
    client = ClusterClient.from_url(
        plain, cluster_error_retry_attempts=1, connection_error_retry_attempts=1, **options
    )
    assert isinstance(client, ClusterClient)
    # Nodes learnt from the slot map (every node commands go to) pack with hiredis. A TLS
    # cluster keeps redis-py's own TLS connection, as one Redis over TLS does: the packed
    # one speaks plain TCP (given the TLS options, it refused to be made at all).
    if not url.startswith("rediss"):
        client.nodes_manager.connection_kwargs["connection_class"] = PackedConnection
    return client
