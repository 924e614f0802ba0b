"""A lean pipelined connection to one Redis, for the data plane's hot path.

Each script call and stream read of the data plane went through redis-py's
asyncio client: a pool checkout, a retry wrapper, a lock, a stream reader and a
chain of parse callbacks per reply. Measured side by side, a pipeline of 64
append scripts cost about 18-24 us of Python per call that way, and about 5 us
written straight to the socket and parsed by hiredis in C. ``Lane`` is that
second way, kept small:

- Commands from any number of coroutines share one connection. Redis answers a
  connection's commands in the order it received them, so replies are matched to
  their callers in order (one future per call, which may carry many commands).
- A caller that gives up (cancelled, timed out) leaves its replies to be read and
  dropped: the connection never falls out of step, as redis-py's does when a read
  is cancelled.
- A write Redis does not take (the socket's buffer stays full) or replies that do
  not come within the timeout close the connection: every caller waiting on it
  gets a ``TimeoutError`` or ``ConnectionError`` (redis-py's), and the next call
  connects afresh (``tests/test_lane.py``).
- ``start`` writes a batch at once, before anyone awaits its replies (``replies``
  does): Redis runs it while this process goes on building the next.
- ``pipeline`` retries a batch lost with its connection (refused, reset, timed
  out, or answered ``LOADING`` by a Redis still reading its data) with the same
  backoff as ``RedisBus``'s client, so a Redis restart is a pause, not a crash.
  Only commands that may be repeated go through it: the data plane's scripts
  recognise a repeat (``dataplane.scripts``), and reads change nothing.

Only plain TCP (``redis://``) is served this way; TLS, unix sockets and Redis
Cluster keep redis-py's connections (``dataplane.bus``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast
from urllib.parse import unquote, urlsplit

import hiredis
from redis._parsers.base import BaseParser
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, DataError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dataplane.addresses import ADDRESSES, connect_first

log = logging.getLogger("duplexq.lane")

RETRIES = 60
"""Attempts after the first one, as ``RedisBus``'s client makes (about 30 s in all)."""
_RETRY_ON = (RedisConnectionError, RedisTimeoutError, OSError)


def as_error(message: str) -> RedisError:
    """redis-py's exception for an error reply (``NoScriptError`` for NOSCRIPT, ...);
    hiredis builds one for every error reply, nested ones included."""
    error = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
    return error if isinstance(error, RedisError) else ResponseError(message)


class _Waiter:
    __slots__ = ("count", "future", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], count: int) -> None:
        self.future = future
        self.count = count
        self.replies: list[Any] = []


class _Protocol(asyncio.Protocol):
    """The socket: writes what it is given, hands each reply to the oldest waiter."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=as_error)
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.pushed: Callable[[Any], None] | None = None
        """Where replies go that no caller waits for, each as soon as it is parsed: a
        subscribed connection's messages (``Lane.subscribe``)."""
        self.heard = 0.0
        """When a subscribed connection last received anything (monotonic clock)."""
        self.error: BaseException | None = None
        """What ``pushed`` raised, which ended the connection."""
        self.ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        """Set once the connection is lost, to the error it ended with."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport instances, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiters = self.waiters
        while waiters:
            waiter = waiters[0]
            replies = waiter.replies
            while len(replies) < waiter.count:
                reply = self.reader.gets()
                if reply is False:
                    return
                replies.append(reply)
            waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(replies)
        if self.pushed is not None:
            self.heard = time.monotonic()
            self._push(self.pushed)

    def _push(self, pushed: Callable[[Any], None]) -> None:
        """Hand every complete reply to ``pushed``, here in the loop's callback: no task
        wakes per message. What it raises ends the connection (``ended``)."""
        while (reply := self.reader.gets()) is not False:
            try:
                pushed(reply)
            except Exception as exc:
                self.error = exc
                self.abort()
                return

    def send(self, commands: Sequence[Sequence[Any]]) -> None:
        """Write ``commands`` with nobody waiting for their replies (a subscribed
        connection's replies go to ``pushed``)."""
        if self.transport is not None and not self.closed:
            self.transport.write(b"".join([hiredis.pack_command(tuple(c)) for c in commands]))

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writable.set()
        error = RedisConnectionError(f"the connection to Redis was lost: {exc or 'closed'}")
        if not self.ended.done():
            self.ended.set_result(self.error or error)
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def abort(self) -> None:
        """Drop the connection now; its waiters learn in ``connection_lost``."""
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()


_Written = tuple[_Protocol, "asyncio.Future[list[Any]]"]
"""A batch on the socket: the connection it went to and the future of its replies."""


class Started(NamedTuple):
    """A batch ``Lane.start`` began: its commands, and where it was written (None: not
    yet, the lane was not connected)."""

    commands: Sequence[Sequence[Any]]
    written: _Written | None
    extra_timeout_s: float


def _read_error(future: asyncio.Future[list[Any]]) -> None:
    """A started batch nobody came to wait for (its sender's task was cancelled first):
    its connection's error is read here rather than reported as never retrieved."""
    if not future.cancelled():
        future.exception()


class Lane:
    """One pipelined connection to the Redis of a ``redis://`` URL."""

    def __init__(
        self, url: str, *, timeout_s: float, connect_timeout_s: float, retries: int = RETRIES
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "redis":
            raise ValueError(f"a lane speaks plain TCP only, not {parts.scheme}://")
        self.host = parts.hostname or "localhost"
        self.port = parts.port or 6379
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        path = parts.path.strip("/")
        self.db = int(path) if path else 0
        self.where = f"{self.host}:{self.port}"
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        """Attempts after the first one of a batch lost with its connection (0: a lane to
        a cluster node, whose loss its caller meets by learning the slot map again)."""
        self._protocol: _Protocol | None = None
        self._connecting = asyncio.Lock()
        self._closed = False
        self._down_since: float | None = None
        """When this lane's calls began to fail (logged once per outage)."""

    async def execute(self, *args: Any, extra_timeout_s: float = 0.0) -> Any:
        """One command (retried as ``pipeline`` retries); an error reply is raised.
        ``extra_timeout_s``: how long past the timeout a blocking command may take."""
        (reply,) = await self.pipeline([args], extra_timeout_s=extra_timeout_s)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def pipeline(
        self, commands: Sequence[Sequence[Any]], *, extra_timeout_s: float = 0.0
    ) -> list[Any]:
        """Send ``commands`` together and return their replies in order, error replies
        as exception objects; a batch lost with its connection is sent again."""
        return await self._replies(commands, None, extra_timeout_s)

    def start(self, commands: Sequence[Sequence[Any]], *, extra_timeout_s: float = 0.0) -> Started:
        """Begin a ``pipeline`` now, before anyone awaits: a connected lane puts the
        commands on the socket at once, so Redis runs them while this process goes on
        (``dataplane.batching`` sends a full batch this way). ``replies`` then waits for
        them, retrying as ``pipeline`` does; a batch never waited for leaves nothing behind."""
        written = None
        protocol = self._protocol
        if protocol is not None and not protocol.closed:
            with contextlib.suppress(DataError):  # raised to whoever awaits the replies
                written = self._write(protocol, commands)
                written[1].add_done_callback(_read_error)
        return Started(commands, written, extra_timeout_s)

    async def replies(self, started: Started) -> list[Any]:
        """The replies to a batch ``start`` began, in order, as ``pipeline`` gives them."""
        return await self._replies(started.commands, started.written, started.extra_timeout_s)

    async def _replies(
        self,
        commands: Sequence[Sequence[Any]],
        written: _Written | None,
        extra_timeout_s: float,
    ) -> list[Any]:
        backoff = ExponentialBackoff(cap=0.5, base=0.02)
        failures = 0
        while True:
            try:
                if written is not None:
                    protocol, future = written
                    written = None
                    replies = await self._await(protocol, future, extra_timeout_s)
                else:
                    replies = await self._send(commands, extra_timeout_s)
                if any(isinstance(reply, BusyLoadingError) for reply in replies):
                    raise BusyLoadingError("Redis is loading its data")
                if self._down_since is not None:
                    log.info("Redis at %s answers again, after %.1f s", self.where,
                             time.monotonic() - self._down_since)  # fmt: skip
                    self._down_since = None
                return replies
            except _RETRY_ON as exc:
                if self._down_since is None:  # once per outage, not once per caller
                    self._down_since = time.monotonic()
                    log.warning("Redis at %s: %s; retrying", self.where, exc)
                failures += 1
                if failures > self.retries or self._closed:
                    raise
                await asyncio.sleep(backoff.compute(failures))

    async def subscribe(
        self, commands: Sequence[Sequence[Any]], pushed: Callable[[Any], None]
    ) -> _Protocol:
        """Connect (authenticated, as for any call) and make this a subscribed
        connection: every reply from now on goes to ``pushed`` as soon as it is parsed
        (Redis pushes a subscription's messages, not one reply per command), then send
        ``commands`` (the subscriptions). The connection returned says when it ended
        (``ended``) and when it last heard anything (``heard``); ``send`` writes on it.
        A lane subscribed once serves nothing else."""
        protocol = await self._connect()
        protocol.pushed = pushed
        protocol.heard = time.monotonic()
        protocol.send(commands)
        return protocol

    async def load(self, script: str) -> None:
        """SCRIPT LOAD (for ``dataplane.batching``)."""
        await self.execute("SCRIPT", "LOAD", script)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection now, for good: whoever waits on it gets a
        ``ConnectionError``, and later calls are refused."""
        self._closed = True
        if self._protocol is not None:
            self._protocol.abort()
            self._protocol = None

    async def _send(self, commands: Sequence[Sequence[Any]], extra_timeout_s: float) -> list[Any]:
        protocol = self._protocol
        if protocol is None or protocol.closed:
            protocol = await self._connect()
        return await self._await(*self._write(protocol, commands), extra_timeout_s)

    def _write(self, protocol: _Protocol, commands: Sequence[Sequence[Any]]) -> _Written:
        """Put ``commands`` on the socket; their replies will settle the future."""
        try:  # the lane's command names are single words: hiredis packs them as they are
            buffer = b"".join([hiredis.pack_command(tuple(command)) for command in commands])
        except TypeError as exc:
            raise DataError(str(exc)) from exc
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        protocol.waiters.append(_Waiter(future, len(commands)))
        cast(asyncio.Transport, protocol.transport).write(buffer)
        return protocol, future

    async def _await(
        self, protocol: _Protocol, future: asyncio.Future[list[Any]], extra_timeout_s: float
    ) -> list[Any]:
        try:
            async with asyncio.timeout(self.timeout_s + extra_timeout_s):
                if not protocol.writable.is_set():
                    await protocol.writable.wait()  # Redis is not taking what we write
                return await future
        except TimeoutError:
            protocol.abort()  # everyone waiting on it learns at once; the next call reconnects
            raise RedisTimeoutError("Redis did not answer within the timeout") from None
        finally:
            if not future.done():
                future.cancel()  # given up: its replies are read and dropped

    async def _connect(self) -> _Protocol:
        async with self._connecting:
            if self._closed:
                raise RedisConnectionError("the lane is closed")
            if self._protocol is not None and not self._protocol.closed:
                return self._protocol
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    found = await ADDRESSES.resolve(self.host, self.port, self.connect_timeout_s)
                    _, protocol = await connect_first(
                        found, lambda host: loop.create_connection(_Protocol, host, self.port)
                    )
            except TimeoutError:
                raise RedisTimeoutError(f"connecting to {self.where} timed out") from None
            except OSError as exc:
                raise RedisConnectionError(f"cannot connect to {self.where}: {exc}") from exc
            self._protocol = protocol
            await self._hello(protocol)
            return protocol

    async def _hello(self, protocol: _Protocol) -> None:
        """Authenticate and select the database, as redis-py does on connect."""
        setup: list[tuple[Any, ...]] = []
        if self.password is not None:
            auth = (self.username, self.password) if self.username else (self.password,)
            setup.append(("AUTH", *auth))
        if self.db:
            setup.append(("SELECT", self.db))
        if not setup:
            return
        try:
            replies = await self._send(setup, 0.0)
        except BaseException:
            protocol.abort()
            raise
        for reply in replies:
            if isinstance(reply, Exception):
                protocol.abort()
                raise reply
