"""The Redis adapter: every Redis Streams detail lives behind this module.

Connections, retries, script loading, consumer groups, claiming, trimming and
the shapes of Redis replies are handled here; the rest of duplexq sees plain
``Entry`` tuples and typed results.

Connections. ``RedisBus.client`` is a redis-py pool for short commands. On a
plain-TCP Redis the hot path (every script call, the stream reads of the data
and journal rounds) goes over ``RedisBus.lane`` instead, one pipelined
connection (``dataplane.lane``), and each bell reader blocks on a lane of its
own (``stream_reader``); elsewhere (TLS, unix sockets, a cluster) they use the
pool and redis-py readers (a cluster's bells are channels, followed by
``dataplane.bell_channels``). Each blocking reader has its own connection, whose
timeout exceeds its block time: a blocking XREAD(GROUP) must not be cut by the
timeout, and a blocking read on a shared connection would hold up everyone
behind it; loops let BLOCK expire instead of cancelling reads (a redis-py
connection whose read is cancelled falls out of step).

Retries. Connection errors are retried with backoff (a Redis restart is a
pause, not a crash), including a reset during a connection's handshake when
it is checked out of the pool. A retried write may reach Redis twice: every
script that writes recognises the repeat (the caller's producer id and call
number, the outputs' seqs, the lease token) and changes nothing more
(``tests/test_idempotence.py``); plain commands retried here are idempotent
or harmless when repeated (an assignment entry offered twice is taken once).

A full Redis. A write refused because Redis is at its ``maxmemory`` is raised as
``schemas.errors.RedisFullError`` (``dataplane.full``), by a script call as by a
plain command; it is not retried here, since only the caller knows whether to wait
(a worker) or answer at once (a client's event). A script may declare Redis flags on
its first line (``#!lua flags=allow-oom``): they stay first, before the shared prelude.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dataplane import scripts
from dataplane.batching import RedisPyPipe, ScriptBatcher
from dataplane.cluster import ClusterClient, cluster_client
from dataplane.full import full_error, refused_for_memory
from dataplane.lane import Lane
from dataplane.multi import split_flags
from dataplane.node_lanes import NodeLanes
from dataplane.packing import PackedConnection
from dataplane.replicated import ReplicatedRunner
from schemas.keys import Keys


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: the first non-empty ``{...}``."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


class Entry(NamedTuple):
    """One stream entry: its id and raw fields (trimmed pending entries have none)."""

    stream: str
    id: str
    fields: dict[bytes, bytes]

    @property
    def event(self) -> bytes:
        """The event's bytes: field ``e``, then ``x`` where the writer kept a part apart
        (an append stores the client's bytes as ``x`` rather than copy them into the
        event in Lua); empty when the entry has no event."""
        fields = self.fields
        head = fields.get(b"e", b"")
        rest = fields.get(b"x")
        return head + rest if rest is not None else head


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_read_reply(reply: Any) -> list[Entry]:
    """Flatten an XREAD/XREADGROUP reply as redis-py gives it (``[[stream, [(id,
    fields)]]]``, fields a dict)."""
    entries: list[Entry] = []
    for stream, messages in reply or ():
        name = _text(stream)
        for entry_id, fields in messages:
            entries.append(Entry(name, _text(entry_id), dict(fields or {})))
    return entries


_new_tuple = tuple.__new__
"""Makes an ``Entry`` without its generated ``__new__`` (a Python call per entry)."""


def parse_raw_read_reply(reply: Any) -> list[Entry]:
    """Flatten an XREAD reply as Redis sends it (RESP2: ``[[stream, [[id, [field,
    value, ...]]]]]``; ``dataplane.lane``). Every entry read by a worker or a coordinator
    passes here: it is written for speed (measured: 785 -> 424 ns an entry)."""
    entries: list[Entry] = []
    append = entries.append
    for stream, messages in reply or ():
        name = stream.decode()
        for entry_id, items in messages:
            flat = items or ()  # a trimmed pending entry has none
            if len(flat) % 2:  # checked here: zip(strict=True) cost a third of the parse
                raise ValueError(f"entry {entry_id!r} of {name} has an odd number of items")
            pairs = iter(flat)
            append(
                _new_tuple(Entry, (name, entry_id.decode(), dict(zip(pairs, pairs, strict=False))))
            )
    return entries


Reader = Lane | aioredis.Redis
"""A dedicated connection for blocking reads (``RedisBus.stream_reader``)."""


def _retry() -> Retry:
    return Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=60)


_RETRY_ON = [RedisConnectionError, RedisTimeoutError, ConnectionResetError, OSError]


async def _no_cleanup(error: Exception) -> None:
    return None


class _ReconnectingPool(aioredis.ConnectionPool):
    """A pool whose checkout survives a Redis restart.

    redis-py retries a command's send and read, but a connection is (re)connected
    when it is checked out of the pool, before that retry starts, and a failure of
    the handshake there (``CLIENT SETINFO`` on a socket Redis resets while it
    restarts) would reach the caller: a worker then failed its sessions over.
    The checkout is retried with the same backoff instead
    (``tests/test_redis_restart.py``)."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        checkout = super().get_connection
        retry = _retry()
        retry.update_supported_errors(_RETRY_ON)
        return await retry.call_with_retry(lambda: checkout(*args, **kwargs), _no_cleanup)


class _Redis(aioredis.Redis):
    """redis-py's client, raising a write refused by a full Redis as ``RedisFullError``."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            # redis-py leaves this method unannotated.
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        except ResponseError as exc:
            if refused_for_memory(exc):
                raise full_error(exc) from exc
            raise


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
"""URL schemes that name a Redis Cluster (any of its nodes) instead of one Redis."""


def _client(url: str, **options: Any) -> aioredis.Redis:
    if url.startswith(CLUSTER_SCHEMES):
        return cast(aioredis.Redis, cluster_client(url, **options))
    single = bool(options.pop("single_connection_client", False))
    if url.startswith("redis://"):  # TLS and unix sockets keep redis-py's own classes
        options["connection_class"] = PackedConnection
    pool = _ReconnectingPool.from_url(url, **options)
    client = _Redis(connection_pool=pool, single_connection_client=single)
    client.auto_close_connection_pool = True
    return client


CONNECT_TIMEOUT_S = 1.0
"""A connect that takes longer is given up and tried again. The TCP handshake with a
reachable Redis takes well under a millisecond; a SYN lost while a restarted Redis's
address comes back up must not hold a connection past a lease's TTL."""


class RedisBus:
    """Redis connections, Lua scripts and stream operations for one deployment."""

    def __init__(
        self,
        url: str,
        keys: Keys | None = None,
        *,
        command_timeout: float = 5.0,
        linger_ms: float = 0.0,
        batch_size: int = 0,
    ):
        self.url = url
        self.linger_ms = linger_ms
        """The linger of this process's data-plane loops (``dataplane.pacing``)."""
        self.cluster = url.startswith(CLUSTER_SCHEMES)
        """True on Redis Cluster: multi-key reads are split per slot."""
        self.keys = dataclasses.replace(keys or Keys(), cluster=self.cluster)
        self._command_timeout = command_timeout
        self._connect_timeout = min(command_timeout, CONNECT_TIMEOUT_S)
        self.client: aioredis.Redis = _client(
            url,
            socket_timeout=command_timeout,
            socket_connect_timeout=self._connect_timeout,
            retry=_retry(),
            retry_on_error=list(_RETRY_ON),
            health_check_interval=30,
        )
        self.lane = self._lane() if url.startswith("redis://") else None
        """The hot path's connection (scripts, stream reads) on one plain-TCP Redis."""
        self._readers: list[Reader] = []
        self._batcher = ScriptBatcher(self.lane or RedisPyPipe(self.client), linger_ms, batch_size)
        """Script calls made in the same loop turn share one round trip (``batch_size``:
        a batch that big goes at once, the rest of the turn's calls in the next)."""
        plain_cluster = url.startswith("redis+cluster://")
        self.node_lanes = (
            NodeLanes(
                self.client, timeout_s=command_timeout, connect_timeout_s=self._connect_timeout
            )
            if plain_cluster
            else None
        )
        """On a plain-TCP cluster, reads of many streams go over a lane per node; the
        lanes of script batches (``dataplane.lane_pool``) and of the bells'
        subscriptions (``dataplane.bell_channels``) are made by it too."""
        self._replicated = (
            ReplicatedRunner(self.client, lanes=self.node_lanes) if self.cluster else None
        )
        """On a cluster, scripts are acknowledged once a replica has their writes (on a
        plain-TCP one, sent over lanes, a batch in flight on each: ``dataplane.replicated``)."""
        self.open_script = self._register(scripts.OPEN)
        self.append_script = self._register(scripts.APPEND)
        self.append_taken_script = self._register(scripts.APPEND_TAKEN)
        self.accept_script = self._register(scripts.ACCEPT)
        self.cancel_script = self._register(scripts.CANCEL)
        self.close_script = self._register(scripts.CLOSE)
        self.acquire_script = self._register(scripts.ACQUIRE)
        self.renew_script = self._register(scripts.RENEW)
        self.release_script = self._register(scripts.RELEASE)
        self.publish_script = self._register(scripts.PUBLISH)
        self.journal_script = self._register(scripts.JOURNAL)
        self.receipt_script = self._register(scripts.RECEIPT)
        self.reserve_script = self._register(scripts.RESERVE)
        self.attach_script = self._register(scripts.ATTACH)
        self.configure_script = self._register(scripts.CONFIGURE)
        self.hold_script = self._register(scripts.HOLD)
        self.detach_script = self._register(scripts.DETACH)
        self.expire_closed_script = self._register(scripts.EXPIRE_CLOSED)
        self.set_durable_script = self._register(scripts.SET_DURABLE)
        self.rescore_script = self._register(scripts.RESCORE)
        if self._replicated is not None:
            self._replicated.no_wait(self.renew_script)

    def _register(self, body: str) -> Any:
        flags, rest = split_flags(body)  # Redis reads a script's flags on its first line only
        prelude = scripts.prelude(channel_bells=self.cluster)  # a cluster's bells: channels
        return self.client.register_script(flags + prelude + rest)

    def register(self, body: str) -> Any:
        """A Lua script of another module, for ``run`` and ``run_many`` (with the
        shared prelude)."""
        return self._register(body)

    def _lane(self) -> Lane:
        return Lane(
            self.url, timeout_s=self._command_timeout, connect_timeout_s=self._connect_timeout
        )

    def stream_reader(self, block_ms: int) -> Reader:
        """A dedicated connection for blocking XREADs of up to ``block_ms`` (``xread``):
        a lane of its own where the bus has lanes, else a redis-py connection (a cluster's
        bells, read most, are channels: ``dataplane.bell_channels``)."""
        if self.lane is None:
            return self.reader(block_ms)
        lane = self._lane()
        self._readers.append(lane)
        return lane

    def reader(self, block_ms: int) -> aioredis.Redis:
        """A dedicated redis-py connection for blocking reads of up to ``block_ms``."""
        conn: aioredis.Redis = _client(
            self.url,
            socket_timeout=block_ms / 1000 + self._command_timeout,
            socket_connect_timeout=self._connect_timeout,
            retry=_retry(),
            retry_on_error=list(_RETRY_ON),
            single_connection_client=True,
        )
        self._readers.append(conn)
        return conn

    async def aclose(self) -> None:
        for conn in self._readers:
            await conn.aclose()
        self._readers.clear()
        if self.lane is not None:
            await self.lane.aclose()
        if self.node_lanes is not None:
            await self.node_lanes.aclose()
        if self._replicated is not None:
            await self._replicated.aclose()
        if isinstance(self.client, ClusterClient):
            await self.client.close_for_good()
        else:
            await self.client.aclose()

    async def ping(self) -> bool:
        """Whether Redis answers within the command timeout: a probe (readiness) must
        not wait through the retries a command gets."""
        try:
            async with asyncio.timeout(self._command_timeout):
                return bool(await self.client.ping())
        except (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError):
            return False

    async def run(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        """Run a registered script; replies are normalized to str/int lists."""
        reply = await self.run_raw(script, keys, args)
        return [_text(item) if isinstance(item, bytes) else item for item in reply]

    async def run_raw(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        """``run`` without decoding: the reply's strings stay bytes (the append's caller
        reads its numbers with ``int`` and decodes the one string it keeps)."""
        if self._replicated is not None:
            reply = await self._replicated.run(script, list(keys), list(args))
        else:
            try:
                reply = await self._batcher.run(script, keys, args)
            except ResponseError as exc:
                if refused_for_memory(exc):
                    raise full_error(exc) from exc
                raise
        return reply if isinstance(reply, list) else [reply]

    async def set_durable(self, key: str, value: str, ttl_s: int) -> None:
        """SET with a TTL, acknowledged as durably as a script (on a cluster: once a
        replica has it)."""
        await self.run(self.set_durable_script, [key], [value, ttl_s])

    async def run_many(
        self, script: Any, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]
    ) -> list[Any]:
        """Run a script once per (keys, args), in one round trip on a single Redis; on a
        cluster (which refuses scripts in pipelines) concurrently, one call per slot's
        node. Replies in call order, unnormalised."""
        if not calls:
            return []
        if self._replicated is not None:
            runner = self._replicated
            return list(
                await asyncio.gather(*(runner.run(script, list(k), list(a)) for k, a in calls))
            )
        try:
            return list(await asyncio.gather(*(self._batcher.run(script, k, a) for k, a in calls)))
        except ResponseError as exc:
            if refused_for_memory(exc):
                raise full_error(exc) from exc
            raise

    async def rescore(self, key: str, scores: Mapping[str, int]) -> None:
        """ZADD ``scores`` (member -> score) to the sorted set ``key``. Members already in
        it are moved by a script a full Redis still runs (``scripts.RESCORE``); new ones
        are added by a plain ZADD, which a full Redis refuses (``RedisFullError``)."""
        if not scores:
            return
        args: list[Any] = []
        for member, score in scores.items():
            args += [score, member]
        missing = await self.run(self.rescore_script, [key], args)
        if missing:
            await self.client.zadd(key, {member: scores[member] for member in missing})

    async def xread(
        self, conn: Reader, streams: Mapping[str, str], count: int, block_ms: int | None
    ) -> list[Entry]:
        if not streams:
            return []
        if isinstance(conn, Lane):
            block = () if block_ms is None else ("BLOCK", block_ms)
            reply = await conn.execute(
                "XREAD", "COUNT", count, *block, "STREAMS", *streams, *streams.values(),
                extra_timeout_s=(block_ms or 0) / 1000,
            )  # fmt: skip
            return parse_raw_read_reply(reply)
        request: dict[Any, Any] = dict(streams)
        reply = await conn.xread(request, count=count, block=block_ms)
        return parse_read_reply(reply)

    async def xread_now(self, streams: Mapping[str, str], count: int) -> list[Entry]:
        """Read many streams without blocking: one XREAD on one Redis; on a cluster one
        XREAD per slot, a round trip per node (``dataplane.node_lanes``)."""
        if self.lane is not None:
            return await self.xread(self.lane, streams, count, None)
        if self.node_lanes is not None and streams:
            return await self.node_lanes.read_now(
                streams, count, parse_raw_read_reply,
                lambda group: self.xread(self.client, group, count, None),
            )  # fmt: skip
        groups = self.slot_groups(streams)
        if len(groups) == 1:
            return await self.xread(self.client, streams, count, None)
        replies = await asyncio.gather(
            *(self.xread(self.client, {k: streams[k] for k in keys}, count, None)
              for keys in groups)
        )  # fmt: skip
        return [entry for reply in replies for entry in reply]

    def slot_groups(self, keys: Iterable[str]) -> list[list[str]]:
        """``keys`` split into groups one multi-key command may touch: all of them on a
        single Redis; one group per hash tag on a cluster."""
        listed = list(keys)
        if not self.cluster or not listed:
            return [listed]
        groups: dict[str, list[str]] = {}
        for key in listed:
            groups.setdefault(hash_tag(key), []).append(key)
        return list(groups.values())

    async def tails(self, streams: Sequence[str]) -> dict[str, str]:
        """The id of each stream's newest entry ("0-0" for an empty or missing one)."""
        tails: dict[str, str] = {}
        for stream in streams:
            tails[stream] = await self.last_id(stream) or "0-0"
        return tails

    async def xrange(
        self, stream: str, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[Entry]:
        reply = await self.client.xrange(stream, min=start, max=end, count=count)
        return [Entry(stream, _text(entry_id), dict(fields or {})) for entry_id, fields in reply]

    async def xrevrange(
        self, stream: str, end: str = "+", start: str = "-", count: int | None = None
    ) -> list[Entry]:
        """Entries from ``end`` back to ``start``, newest first."""
        reply = await self.client.xrevrange(stream, max=end, min=start, count=count)
        return [Entry(stream, _text(entry_id), dict(fields or {})) for entry_id, fields in reply]

    async def ensure_group(self, stream: str, group: str) -> None:
        """Create ``group`` on ``stream`` (and the stream) unless it exists."""
        try:
            await self.client.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def xreadgroup(
        self,
        conn: aioredis.Redis,
        group: str,
        consumer: str,
        stream: str,
        count: int,
        block_ms: int | None,
    ) -> list[Entry]:
        reply = await conn.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
        return parse_read_reply(reply)

    async def xautoclaim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, count: int
    ) -> list[Entry]:
        """Claim entries another consumer read but did not ack for ``min_idle_ms``."""
        reply = await self.client.xautoclaim(
            stream, group, consumer, min_idle_time=min_idle_ms, start_id="0-0", count=count
        )
        messages = reply[1] if len(reply) > 1 else []
        return [
            Entry(stream, _text(entry_id), dict(fields or {}))
            for entry_id, fields in messages
            if entry_id is not None
        ]

    async def xack(self, stream: str, group: str, *ids: str) -> int:
        if not ids:
            return 0
        return int(await self.client.xack(stream, group, *ids))

    async def trim_before(self, stream: str, min_id: str) -> int:
        """Drop entries older than ``min_id`` (XTRIM MINID, exact)."""
        return int(await self.client.xtrim(stream, minid=min_id, approximate=False))

    async def trim_maxlen(self, stream: str, maxlen: int) -> int:
        """Keep about the newest ``maxlen`` entries (XTRIM MAXLEN ~: whole nodes only)."""
        return int(await self.client.xtrim(stream, maxlen=maxlen, approximate=True))

    async def xlen(self, stream: str) -> int:
        return int(await self.client.xlen(stream))

    async def last_id(self, stream: str) -> str | None:
        """Id of the newest entry, or None for an empty or missing stream."""
        reply = await self.client.xrevrange(stream, count=1)
        return _text(reply[0][0]) if reply else None

    async def group_positions(self, stream: str) -> list[tuple[str, str, str | None]]:
        """Each consumer group of ``stream``: (name, last delivered id, oldest pending id)."""
        try:
            groups = await self.client.xinfo_groups(stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return []
            raise
        positions: list[tuple[str, str, str | None]] = []
        for group in groups:
            name = _text(group["name"])
            summary = await self.client.xpending(stream, name)
            oldest = summary.get("min") if summary.get("pending") else None
            delivered = _text(group["last-delivered-id"])
            positions.append((name, delivered, _text(oldest) if oldest else None))
        return positions

    async def hmget(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        reply = self.client.hmget(key, list(fields))
        return list(await cast(Awaitable[list[bytes | None]], reply))

    async def hgetall(self, key: str) -> dict[str, str]:
        reply = await cast(Awaitable[dict[bytes, bytes]], self.client.hgetall(key))
        return {k.decode(): v.decode() for k, v in reply.items()}

    async def hset(self, key: str, mapping: Mapping[str, str | int]) -> int:
        reply = self.client.hset(key, mapping=dict(mapping))
        return int(await cast(Awaitable[int], reply))

    async def hincrby(self, key: str, field: str, amount: int = 1) -> int:
        return int(await cast(Awaitable[int], self.client.hincrby(key, field, amount)))
