"""Commands packed by hiredis, in C.

redis-py's asyncio connection builds the Redis protocol in Python, argument by
argument; at thousands of script calls a second that was about a tenth of the
coordinator's and the worker's CPU (``bench/``). Its synchronous connection
already packs with hiredis when hiredis is installed; this connection does the
same for asyncio. The bytes on the wire are the same (``tests/test_packing.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import DataError


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

    def pack_command(self, *args: Any) -> list[bytes]:
        return [pack(args)]

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        return [b"".join(pack(tuple(command)) for command in commands)]
