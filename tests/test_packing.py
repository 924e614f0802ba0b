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


async def test_a_write_the_peer_does_not_take_times_out_and_closes_the_connection():
    """A peer that stops reading fills the socket: the write fails with redis-py's
    TimeoutError after the socket timeout (as redis-py's own connection does), and the
    connection is closed, so the next command starts on a fresh one."""
    import asyncio
    import time

    from redis.exceptions import TimeoutError as RedisTimeoutError

    accepted: list[asyncio.StreamWriter] = []

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = PackedConnection(host="127.0.0.1", port=port, socket_timeout=0.3)
        conn._reader, conn._writer = await asyncio.open_connection("127.0.0.1", port)
        began = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await conn.send_packed_command(b"x" * (64 << 20), check_health=False)
        assert 0.25 < time.monotonic() - began < 5
        assert not conn.is_connected
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
