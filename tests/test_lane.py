"""The hot path's pipelined connection (``dataplane.lane``) on real Redis, and on
small fake servers for what a real one cannot be made to do on cue."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dataplane.bus import Entry, RedisBus, parse_raw_read_reply
from dataplane.lane import Lane
from schemas.keys import Keys
from tests.redis_server import RedisServer, free_port


def lane_of(url: str, timeout_s: float = 5.0) -> Lane:
    return Lane(url, timeout_s=timeout_s, connect_timeout_s=timeout_s)


async def test_concurrent_callers_get_their_own_replies(redis_server, key_prefix):
    lane = lane_of(redis_server.url)
    try:
        key = f"{key_prefix}:n"
        replies = await asyncio.gather(
            *(lane.pipeline([("INCR", key), ("GET", key)]) for _ in range(200))
        )
        # Each caller's two commands ran back to back: its GET saw its own INCR.
        assert sorted(int(got) for n, got in replies if int(got) == n) == list(range(1, 201))
    finally:
        await lane.aclose()


async def test_a_caller_that_gives_up_leaves_the_connection_in_step(redis_server, key_prefix):
    """A cancelled blocking read's reply still comes; it is dropped, and the next
    command gets its own reply (a redis-py connection falls out of step here)."""
    lane = lane_of(redis_server.url)
    try:
        stream = f"{key_prefix}:s"
        read = asyncio.create_task(
            lane.execute("XREAD", "BLOCK", 300, "STREAMS", stream, "$", extra_timeout_s=1)
        )
        await asyncio.sleep(0.05)
        read.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await read
        assert await lane.execute("SET", f"{key_prefix}:k", "v") == b"OK"
        assert await lane.execute("GET", f"{key_prefix}:k") == b"v"
    finally:
        await lane.aclose()


async def test_a_started_batch_is_on_the_socket_before_anyone_awaits_it(redis_server, key_prefix):
    """``start`` writes at once on a connected lane (Redis runs the batch while the caller
    goes on); on a lane not yet connected, the replies' wait connects and sends it."""
    lane = lane_of(redis_server.url)
    check = lane_of(redis_server.url)  # another connection
    try:
        fresh = lane.start([("SET", f"{key_prefix}:a", "1")])
        assert fresh.written is None  # not connected yet
        assert await lane.replies(fresh) == [b"OK"]
        started = lane.start([("SET", f"{key_prefix}:b", "2"), ("GET", f"{key_prefix}:b")])
        assert started.written is not None
        deadline = time.monotonic() + 2
        while await check.execute("GET", f"{key_prefix}:b") is None:
            assert time.monotonic() < deadline, "the started batch never reached Redis"
            await asyncio.sleep(0.01)  # the batch's replies are not awaited meanwhile
        assert await lane.replies(started) == [b"OK", b"2"]
    finally:
        await check.aclose()
        await lane.aclose()


async def test_a_started_batch_whose_sender_gave_up_reports_nothing(redis_server, caplog):
    """A batch whose sender never came to wait (its task cancelled before its first step)
    and whose connection then failed leaves no 'exception never retrieved' behind."""
    lane = lane_of(redis_server.url)
    try:
        await lane.execute("PING")
        started = lane.start([("PING",)])
        assert started.written is not None
        started.written[0].abort()
        await asyncio.sleep(0.01)
        assert started.written[1].done()
        del started
        gc.collect()
        await asyncio.sleep(0)
        assert "never retrieved" not in caplog.text
    finally:
        await lane.aclose()


async def test_error_replies_come_as_redis_py_exceptions(redis_server, key_prefix):
    lane = lane_of(redis_server.url)
    try:
        replies = await lane.pipeline([("EVALSHA", "0" * 40, 0), ("PING",), ("INCR", "x", "y")])
        assert isinstance(replies[0], NoScriptError) and replies[1] == b"PONG"
        assert isinstance(replies[2], ResponseError)
        with pytest.raises(ResponseError, match="wrong number of arguments"):
            await lane.execute("GET")
    finally:
        await lane.aclose()


async def test_a_batch_rides_out_a_redis_restart(tmp_path, key_prefix):
    server = RedisServer(tmp_path / "redis")
    server.start()
    lane = lane_of(server.url)
    try:
        assert await lane.execute("SET", "k", "before") == b"OK"
        server.stop()

        async def restart_later() -> None:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(server.start)

        restarting = asyncio.create_task(restart_later())
        # Sent while Redis is down: refused connections are retried until it is back.
        assert await lane.pipeline([("SET", "k", "after"), ("GET", "k")]) == [b"OK", b"after"]
        await restarting
    finally:
        await lane.aclose()
        server.stop()


async def test_an_acl_user_and_password_are_presented_on_connect(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port),
         "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", "",
         "--user", "default", "off", "--user", "duplexq", "on", ">s3cret", "~*", "&*", "+@all"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        good = lane_of(f"redis://duplexq:s3cret@127.0.0.1:{port}/3")
        deadline = time.monotonic() + 10
        while True:
            try:
                assert await good.execute("SET", "k", "v") == b"OK"
                break
            except (ConnectionError, OSError, AuthenticationError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        # The database of the URL was selected: the key is in db 3, not db 0.
        assert await good.execute("CLIENT", "INFO") and b"db=3" in await good.execute(
            "CLIENT", "INFO"
        )
        await good.aclose()
        bad = lane_of(f"redis://duplexq:wrong@127.0.0.1:{port}/0", timeout_s=1)
        with pytest.raises(AuthenticationError):
            await bad._send([("PING",)], 0.0)
        await bad.aclose()
    finally:
        proc.terminate()
        proc.wait(10)


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Event], Awaitable[None]]


@contextlib.asynccontextmanager
async def fake_redis(serve: Serve) -> AsyncIterator[tuple[str, list[asyncio.StreamWriter]]]:
    """A TCP server answering as ``serve`` does; ``serve`` returns once the event given
    to it is set (at the end of the test)."""
    accepted: list[asyncio.StreamWriter] = []
    handlers: list[asyncio.Task[None]] = []
    done = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        await serve(reader, writer, done)

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0", accepted
    finally:
        done.set()
        await asyncio.gather(*handlers)
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_write_the_peer_does_not_take_times_out_and_closes_the_connection():
    """A peer that stops reading fills the socket: the caller gets redis-py's
    TimeoutError after the timeout, and the connection is closed, so the next call
    starts on a fresh one."""

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         done: asyncio.Event) -> None:  # fmt: skip
        await done.wait()

    async with fake_redis(never_read) as (url, accepted):
        lane = lane_of(url, timeout_s=0.3)
        began = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await lane._send([("SET", "k", b"x" * (64 << 20))], 0.0)
        assert 0.25 < time.monotonic() - began < 5
        assert lane._protocol is not None and lane._protocol.closed
        with pytest.raises(RedisTimeoutError):
            await lane._send([("PING",)], 0.0)
        assert len(accepted) == 2  # the second call connected afresh
        await lane.aclose()


async def test_a_redis_still_loading_its_data_is_waited_for():
    """``LOADING`` (a restarted Redis reading its AOF) is a pause: the batch is sent
    again until it is answered."""
    answers = [b"-LOADING Redis is loading the dataset in memory\r\n", b"+PONG\r\n"]

    async def loading_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            done: asyncio.Event) -> None:  # fmt: skip
        while answers and await reader.readline():
            await reader.readline()
            await reader.readline()  # PING arrives as *1\r\n$4\r\nPING\r\n
            writer.write(answers.pop(0))
            await writer.drain()
        await done.wait()

    async with fake_redis(loading_first) as (url, _):
        lane = lane_of(url)
        assert await lane.pipeline([("PING",)]) == [b"PONG"]
        await lane.aclose()


async def test_the_bus_uses_lanes_on_plain_tcp_only(redis_server):
    bus = RedisBus(redis_server.url, Keys("lanes"))
    try:
        assert bus.lane is not None
        assert isinstance(bus.stream_reader(100), Lane)
    finally:
        await bus.aclose()
    assert RedisBus("rediss://127.0.0.1:1/0").lane is None
    assert RedisBus("unix:///tmp/redis.sock").lane is None


def test_a_lane_serves_on_uvloop_as_the_coordinator_runs(redis_server):
    """The coordinator runs on uvloop, whose transports are its own classes."""
    import uvloop

    async def talk() -> list[object]:
        lane = lane_of(redis_server.url)
        try:
            return await lane.pipeline([("PING",), ("ECHO", "uv")])
        finally:
            await lane.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(talk()) == [b"PONG", b"uv"]


async def test_an_argument_redis_cannot_take_is_refused_before_anything_is_sent(redis_server):
    from redis.exceptions import DataError

    lane = lane_of(redis_server.url)
    try:
        with pytest.raises(DataError):
            await lane.pipeline([("SET", "k", None)])
        assert await lane.execute("PING") == b"PONG"
    finally:
        await lane.aclose()


def test_a_raw_read_reply_is_flattened_into_entries():
    reply = [
        [b"a", [[b"1-0", [b"e", b"\x01", b"n", b"7"]], [b"2-0", None]]],  # 2-0: trimmed
        [b"b", [[b"3-1", [b"c", b""]]]],
    ]
    entries = parse_raw_read_reply(reply)
    assert entries == [
        Entry("a", "1-0", {b"e": b"\x01", b"n": b"7"}),
        Entry("a", "2-0", {}),
        Entry("b", "3-1", {b"c": b""}),
    ]
    assert all(type(e) is Entry for e in entries) and entries[0].event == b"\x01"
    assert parse_raw_read_reply(None) == []
    with pytest.raises(ValueError, match="odd number"):
        parse_raw_read_reply([[b"a", [[b"1-0", [b"e", b"\x01", b"n"]]]]])
