"""Commands packed by hiredis, in C.

redis-py's asyncio connection builds the Redis protocol in Python, argument by
argument; at thousands of script calls a second that was about a tenth of the
coordinator's and the worker's CPU (``bench/``). Its synchronous connection
already packs with hiredis when hiredis is installed; this connection does the
same for asyncio. The bytes on the wire are the same (``tests/test_packing.py``).

It also sends without a task per write: redis-py bounds a write by the socket
timeout with ``asyncio.wait_for``, which wraps every write in a new task (about
a tenth of a pipelined command's cost); here the write is bounded by
``asyncio.timeout``, with the same errors on a timeout or a broken socket.

And it connects to the address ``dataplane.addresses`` gives for the host: a
name lookup that hangs while Redis restarts does not hold up the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dataplane.addresses import ADDRESSES, connect_first


def pack(args: tuple[Any, ...]) -> bytes:
    """One command in the Redis protocol. A command name with spaces ("CONFIG GET")
    is split into its words, as redis-py does."""
    first = args[0]
    if isinstance(first, str):
        args = (*first.encode().split(), *args[1:])
    elif b" " in first:
        args = (*first.split(), *args[1:])
    try:  # hiredis refuses what redis-py refuses (bool, None, containers)
        return hiredis.pack_command(args)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise DataError(str(exc)) from exc


class PackedConnection(aioredis.Connection):
    """redis-py's asyncio connection, packing commands with hiredis."""

    _address: str | None = None

    async def _connect(self) -> None:
        timeout_s = self.socket_connect_timeout or 5.0
        try:
            found = await ADDRESSES.resolve(self.host, self.port, timeout_s)
        except TimeoutError as exc:
            raise RedisTimeoutError(str(exc)) from None
        except OSError as exc:
            raise RedisConnectionError(f"cannot look up {self.host}: {exc}") from exc
        await connect_first(found, self._connect_to)

    async def _connect_to(self, address: str) -> None:
        self._address = address  # read by _connection_arguments, in redis-py's _connect
        await super()._connect()  # type: ignore[no-untyped-call]

    def _connection_arguments(self) -> dict[str, Any]:
        return {**super()._connection_arguments(), "host": self._address or self.host}

    def pack_command(self, *args: Any) -> list[bytes]:
        return [pack(args)]

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        return [b"".join(pack(tuple(command)) for command in commands)]

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        if not self.is_connected:
            await self.connect()  # type: ignore[no-untyped-call]
        elif check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        writer = self._writer
        if writer is None:
            raise RedisConnectionError("the connection was closed before the write")
        try:
            if isinstance(command, str):
                command = command.encode()
            if isinstance(command, bytes):
                command = [command]
            writer.writelines(command)
            # drain() waits only while the socket's buffer is full; that wait is bounded.
            async with asyncio.timeout(self.socket_timeout):
                await writer.drain()
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:
            # A write cut short (cancelled) leaves the stream out of step: start afresh.
            await self.disconnect(nowait=True)
            raise
