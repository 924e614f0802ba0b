"""Each process's own way to Redis: TCP proxies the nemesis can cut or slow down.

Every worker, coordinator and the control plane reaches Redis through a
``Route`` of its own: one listening socket per Redis node, forwarding bytes
both ways unchanged. The nemesis acts on one route, so on one process:

- ``cut()``: nothing is forwarded any more, either way, and no socket is
  closed. The process's connections stay open, its requests wait in the
  proxy and in the kernel's buffers, as behind a network partition; new
  connections are accepted and wait too. ``heal()`` forwards everything held,
  in order (requests made before the cut reach Redis late, as retransmitted
  packets would);
- ``slow(delay_s)``: every request waits ``delay_s`` before it is forwarded,
  so each round trip to Redis takes that much longer; ``slow(0)`` ends it.

On a Redis Cluster a client learns the nodes' addresses from the cluster
(``CLUSTER SLOTS``, ``MOVED`` and ``ASK`` redirections) and would then connect
to them directly, past the proxy. A cluster route therefore rewrites those
addresses in Redis's replies (``AddressRewriter``) into its own listening
ports, so every connection the process makes stays on its route.

The routes are served by one event loop on a thread of the nemesis process
(``Proxies``); the nemesis and ``chaos.cluster`` call them from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

BUFFER = 65_536
HOLD_S = 0.2
"""Longest a reply's tail that may be a split address waits for the rest of it."""


def _prefixes(literal: bytes, then: bytes = b"") -> bytes:
    """A pattern matching every non-empty prefix of ``literal``, and once ``literal``
    is whole, what follows it as ``then`` (itself a pattern of prefixes)."""
    pattern = then
    for byte in reversed(literal):
        pattern = re.escape(bytes([byte])) + b"(?:" + pattern + b")?"
    return pattern


class AddressRewriter:
    """Rewrites the Redis nodes' addresses in a stream of Redis replies (pure).

    Two shapes carry an address: a node in a ``CLUSTER SLOTS`` reply (the host as a
    bulk string, then the port as an integer) and a ``MOVED`` or ``ASK`` error
    (``-MOVED <slot> <host>:<port>``). A port of ``ports`` (a node's) is replaced by
    the port it maps to (the route's listener for that node). An address split
    between two reads is held back until its rest arrives (``held``): ``feed``
    returns what can be forwarded now; ``flush`` gives up holding."""

    def __init__(self, host: str, ports: dict[int, int]) -> None:
        self.ports = ports
        h = re.escape(host.encode())
        self._node = re.compile(rb"(\$%d\r\n%s\r\n:)(\d+)(\r\n)" % (len(host), h))
        self._redirect = re.compile(rb"(-(?:MOVED|ASK) \d+ %s:)(\d+)(\r\n)" % h)
        address = _prefixes(host.encode() + b":", rb"\d{0,5}\r?")
        redirect = rb"\d{1,5}(?: (?:%s)?)?" % address
        self._partial = re.compile(
            b"|".join([
                _prefixes(b"$%d\r\n%s\r\n:" % (len(host), host.encode()), rb"\d{0,5}\r?"),
                _prefixes(b"-MOVED ", redirect),
                _prefixes(b"-ASK ", redirect),
            ])
        )  # fmt: skip
        self._longest = len(host) + 32
        self.held = b""

    def _port(self, match: re.Match[bytes]) -> bytes:
        port = self.ports.get(int(match[2]))
        return match[0] if port is None else match[1] + str(port).encode() + match[3]

    def feed(self, data: bytes) -> bytes:
        data = self.held + data
        data = self._node.sub(self._port, data)
        data = self._redirect.sub(self._port, data)
        cut = self._split_at(data)
        self.held = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        held, self.held = self.held, b""
        return held

    def _split_at(self, data: bytes) -> int:
        """Where a tail that may be the start of an address begins (len: none)."""
        start = max(0, len(data) - self._longest)
        for at in range(start, len(data)):
            if data[at] in b"$-" and self._partial.fullmatch(data, at):
                return at
        return len(data)


class Route:
    """One process's proxies to the Redis nodes (``ports``: node port -> listening
    port). Its methods may be called from any thread."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, host: str) -> None:
        self.name = name
        self.host = host
        self.ports: dict[int, int] = {}
        self.delay_s = 0.0
        self.is_cut = False
        self._loop = loop
        self._rewrite = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        """Every connection's task and its pipes' tasks, each removed as it ends."""
        self._closing = False

    # -- the nemesis's side (any thread) ---------------------------------------------

    def cut(self) -> None:
        self.is_cut = True
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def heal(self) -> None:
        self.is_cut = False
        self._loop.call_soon_threadsafe(self._flowing.set)

    def slow(self, delay_s: float) -> None:
        self.delay_s = delay_s  # read by the forwarding tasks before each request

    # -- the loop's side ----------------------------------------------------------------

    async def open(self, upstreams: Sequence[int], *, rewrite: bool) -> None:
        self._rewrite = rewrite
        for upstream in upstreams:
            server = await asyncio.start_server(
                functools.partial(self._serve, upstream), self.host, 0
            )
            self._servers.append(server)
            self.ports[upstream] = int(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self._closing = True
        for server in self._servers:
            server.close()
        # Every connection's task (those still connecting upstream included) ends here,
        # with both its sockets closed, before the proxies' loop stops.
        while self._tasks:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()

    async def _serve(
        self, upstream: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self._closing:  # accepted as the route closed: its task starts only now
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._track(task)
        await self._forward(upstream, reader, writer)

    def _track(self, task: asyncio.Task[None]) -> None:
        """Keep ``task`` until it ends, however it ends: ``close`` waits for the tasks
        kept, and one that stayed after its end kept ``close`` looping for ever."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(
        self, upstream: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, upstream)
        except OSError:  # Redis is down: the process sees its connection refused
            writer.transport.abort()
            return
        except asyncio.CancelledError:  # the route closes while this one connects
            writer.transport.abort()
            raise
        rewriter = AddressRewriter(self.host, self.ports) if self._rewrite else None
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer, requests=True)),
            asyncio.create_task(self._pipe(up_reader, writer, rewriter=rewriter)),
        ]
        for task in pipes:
            self._track(task)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            try:
                await asyncio.gather(*pipes, return_exceptions=True)
            finally:  # cancelled while its pipes end (the route closing): still closed
                await _close(writer, up_writer)

    async def _pipe(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        *,
        requests: bool = False,
        rewriter: AddressRewriter | None = None,
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                data = await self._read(source, rewriter)
                if data is None:
                    return
                if requests and self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                await self._flowing.wait()
                sink.write(data)
                await sink.drain()

    @staticmethod
    async def _read(source: asyncio.StreamReader, rewriter: AddressRewriter | None) -> bytes | None:
        """The next bytes to forward; None at the end of the stream."""
        if rewriter is None:
            return await source.read(BUFFER) or None
        out = b""
        while not out:
            if rewriter.held:
                try:
                    data = await asyncio.wait_for(source.read(BUFFER), HOLD_S)
                except TimeoutError:
                    return rewriter.flush()
            else:
                data = await source.read(BUFFER)
            if not data:
                return rewriter.flush() or None
            out = rewriter.feed(data)
        return out


async def _settle() -> None:
    """Let the loop finish what the routes' closing started (the connection-lost
    callbacks of the sockets just closed) before it stops."""
    for _ in range(3):
        await asyncio.sleep(0)


async def _close(*sides: asyncio.StreamWriter) -> None:
    """Close both ends of a connection, flushing what was written to them; one whose
    flush cannot end (its peer stopped reading, or the route is closing) is aborted so
    that no socket outlives the proxies' loop."""
    for side in sides:
        side.close()
    try:
        async with asyncio.timeout(1):
            for side in sides:
                with contextlib.suppress(Exception):
                    await side.wait_closed()
    except TimeoutError:
        pass
    finally:
        for side in sides:
            side.transport.abort()  # does nothing to one already closed


class Proxies:
    """Every route of a run, served by one event loop on a thread of its own."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.routes: dict[str, Route] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxies",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _call(self, make: Callable[[], Coroutine[Any, Any, None]], within_s: float = 10) -> None:
        asyncio.run_coroutine_threadsafe(make(), self._loop).result(within_s)

    def route(self, name: str, upstreams: Sequence[int], *, rewrite: bool) -> Route:
        """``name``'s route (opened on first use) to the nodes listening on ``upstreams``;
        ``rewrite``: the nodes form a Redis Cluster, whose addresses are rewritten."""
        route = self.routes.get(name)
        if route is None:
            route = Route(name, self._loop, self.host)
            self._call(lambda: route.open(upstreams, rewrite=rewrite))
            self.routes[name] = route
        return route

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        for route in self.routes.values():
            self._call(route.close)
        self._call(_settle)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
