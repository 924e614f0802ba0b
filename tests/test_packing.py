"""Commands packed by hiredis are byte for byte what redis-py packs, and real Redis
answers them."""

from __future__ import annotations

import pytest
from redis.asyncio import Connection
from redis.exceptions import DataError

from dataplane.bus import RedisBus
from dataplane.packing import PackedConnection, pack

COMMANDS = [
    ("SET", "key", "value"),
    (b"EVALSHA", "0123abcd", 2, "k1", b"k2", 0, -17, 2.5, "é", b"\x00\xff\r\n"),
    ("CONFIG GET", "maxmemory"),
    (b"CLIENT SETINFO", b"LIB-NAME", "redis-py"),
    ("XADD", "stream", "MAXLEN", "~", 100, "*", "e", b"x" * 10_000),
    ("XREAD", "COUNT", 10, "STREAMS", "a", "b", "0-0", "0-0"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_a_command_packs_as_redis_py_packs_it(command):
    assert pack(command) == b"".join(Connection().pack_command(*command))


def test_commands_pack_into_one_pipeline_as_redis_py_packs_them():
    assert b"".join(PackedConnection().pack_commands(COMMANDS)) == b"".join(
        Connection().pack_commands(COMMANDS)
    )


@pytest.mark.parametrize("bad", [True, None, {"a": 1}])
def test_an_argument_redis_cannot_take_is_refused_as_redis_py_refuses_it(bad):
    with pytest.raises(DataError):
        pack(("SET", "key", bad))


async def test_the_bus_talks_to_redis_through_packed_connections(redis_server):
    bus = RedisBus(redis_server.url)
    try:
        pool = bus.client.connection_pool
        assert pool.connection_class is PackedConnection
        await bus.client.set("packed", "é\x00")
        assert await bus.client.get("packed") == "é\x00".encode()
        async with bus.client.pipeline(transaction=False) as pipe:
            pipe.xadd("packed-stream", {"e": b"\xff" * 5000})
            pipe.xlen("packed-stream")
            _, length = await pipe.execute()
        assert length == 1
    finally:
        await bus.aclose()
