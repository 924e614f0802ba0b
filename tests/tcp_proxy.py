"""A fault-injecting TCP proxy between a client and Redis, for retry tests.

Bytes pass through unchanged until a fault is armed. ``drop_reply_after(marker)``
lets the next request containing ``marker`` reach Redis (which runs it) and
then cuts that connection before its reply gets back: the client sees the
connection die and cannot know whether its command ran, exactly the case a
retry must survive.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tests.redis_server import free_port


class FaultyProxy:
    """``127.0.0.1:port`` forwarding to ``upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.dropped = 0
        self._marker: bytes | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_reply_after(self, marker: bytes) -> None:
        """Lose the reply to the next request that contains ``marker`` (once)."""
        self._marker = marker

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        cut = asyncio.Event()
        tasks = [
            asyncio.create_task(self._requests(reader, up_writer, cut)),
            asyncio.create_task(self._replies(up_reader, writer, cut)),
        ]
        self._tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
                self._tasks.discard(task)
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def _requests(
        self, reader: asyncio.StreamReader, up: asyncio.StreamWriter, cut: asyncio.Event
    ) -> None:
        while data := await reader.read(65536):
            if self._marker is not None and self._marker in data:
                self._marker = None
                cut.set()  # the reply to this request will not get through
            up.write(data)
            await up.drain()

    async def _replies(
        self, up: asyncio.StreamReader, writer: asyncio.StreamWriter, cut: asyncio.Event
    ) -> None:
        while data := await up.read(65536):
            if cut.is_set():
                self.dropped += 1
                return  # the request ran in Redis; its reply is lost with the connection
            writer.write(data)
            await writer.drain()


@contextlib.asynccontextmanager
async def faulty_proxy(upstream_port: int) -> AsyncIterator[FaultyProxy]:
    proxy = FaultyProxy(upstream_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
