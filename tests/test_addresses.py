"""Connections to Redis survive a name lookup that hangs while Redis restarts.

On Docker a lookup of the Redis service's name made while its container restarts
is not answered for 5 s; every connection a process made then waited that long
and its worker lost every lease (``dataplane.addresses``). Here the system's
resolver is made to hang (``socket.getaddrinfo`` is wrapped, nothing else is), and
a real redis-server is restarted under real connections. Without the fallback
these connections wait on the hung lookup and fail.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator.service import Coordinator
from dataplane.addresses import Addresses, Found
from dataplane.bus import RedisBus
from dataplane.lane import Lane
from schemas.config import echo_pipeline
from schemas.events import TextPayload
from schemas.keys import Keys
from tests.pipeline_helpers import fast_settings, outputs_of, running_worker
from tests.redis_server import RedisServer


class Resolver:
    """The system's lookup, until ``hang()``: then every lookup blocks until released."""

    def __init__(self, answer: Found) -> None:
        self.answer = answer
        self.calls = 0
        self.hanging = False
        self.released = threading.Event()

    def __call__(self, host: str, port: int) -> Found:
        self.calls += 1
        if self.hanging:
            self.released.wait(30)
        return self.answer

    def hang(self) -> None:
        self.hanging = True
        self.calls = 0


class SystemResolver:
    """``socket.getaddrinfo`` as it is, until ``hang()``: then a lookup of a name (not of
    an address) blocks until released, as Docker's DNS does while Redis restarts."""

    def __init__(self) -> None:
        self.real = socket.getaddrinfo
        self.calls = 0
        self.hanging = False
        self.released = threading.Event()

    def __call__(self, host: Any, *args: Any, **kwargs: Any) -> Any:
        if self.hanging and not _numeric(host):
            self.calls += 1
            self.released.wait(30)
        return self.real(host, *args, **kwargs)

    def hang(self) -> None:
        self.hanging = True


def _numeric(host: Any) -> bool:
    try:
        ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host)
    except ValueError:
        return False
    return True


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[SystemResolver]:
    """The system's resolver, made to hang on demand (every lookup in this process,
    asyncio's and ``dataplane.addresses``' alike, goes through it)."""
    fake = SystemResolver()
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    try:
        yield fake
    finally:
        fake.released.set()


@pytest.fixture
def lookups() -> Iterator[tuple[Addresses, Resolver]]:
    """A resolver of its own, whose lookups answer 10.0.0.7 until they hang."""
    addresses = Addresses()
    fake = Resolver(("10.0.0.7",))
    addresses.lookup = fake
    try:
        yield addresses, fake
    finally:
        fake.released.set()


async def test_a_hanging_lookup_falls_back_to_the_names_last_address(lookups):
    addresses, fake = lookups
    assert await addresses.resolve("redis", 6379, 1.0) == ("10.0.0.7",)
    fake.hang()
    fake.answer = ("10.0.0.8",)
    assert await addresses.resolve("redis", 6379, 5.0) == ("10.0.0.7",)
    fake.released.set()  # the lookup answers at last: its answer is the one used next
    await asyncio.sleep(0.1)
    assert await addresses.resolve("redis", 6379, 1.0) == ("10.0.0.8",)


async def test_a_name_never_answered_waits_for_its_lookup_until_the_timeout(lookups):
    addresses, fake = lookups
    fake.hang()
    with pytest.raises(TimeoutError):
        await addresses.resolve("redis", 6379, 0.3)


async def test_connections_retrying_during_a_hang_share_one_lookup(lookups):
    addresses, fake = lookups
    await addresses.resolve("redis", 6379, 1.0)
    fake.hang()
    found = await asyncio.gather(*(addresses.resolve("redis", 6379, 5.0) for _ in range(50)))
    assert set(found) == {("10.0.0.7",)}
    assert fake.calls == 1  # one thread waits on the resolver, not fifty


async def test_an_address_is_not_looked_up(lookups):
    addresses, fake = lookups
    assert await addresses.resolve("127.0.0.1", 6379, 1.0) == ("127.0.0.1",)
    assert fake.calls == 0


def _by_name(server: RedisServer) -> str:
    return server.url.replace("127.0.0.1", "localhost")


async def test_a_lane_and_a_client_reconnect_while_lookups_hang(tmp_path, resolver):
    server = RedisServer(tmp_path / "redis")
    server.start()
    lane = Lane(_by_name(server), timeout_s=5.0, connect_timeout_s=1.0)
    bus = RedisBus(_by_name(server))
    try:
        assert await lane.execute("PING") == b"PONG"
        assert await bus.client.ping()
        resolver.hang()
        await asyncio.to_thread(server.restart)
        assert await lane.execute("PING") == b"PONG"
        assert await bus.client.ping()
        assert resolver.calls >= 1  # the name was looked up again: that lookup still hangs
    finally:
        await lane.aclose()
        await bus.aclose()
        server.stop()


async def test_a_worker_keeps_its_leases_when_redis_restarts_while_lookups_hang(tmp_path, resolver):
    server = RedisServer(tmp_path / "redis")
    server.start()
    # The shipped lease TTL and heartbeat: the case the fallback is for.
    settings = fast_settings(_by_name(server), "addr", lease_ttl_ms=3000, heartbeat_ms=750)
    pipeline = echo_pipeline("echo")
    coordinator = Coordinator(settings, pipeline)
    lease_key = Keys(prefix="addr").session("s").lease("echo")

    async def answered(text: str) -> int:
        await coordinator.append("s", "append_text", TextPayload(text))
        async with asyncio.timeout(20):
            while True:
                for output in outputs_of(await coordinator.outputs(block_ms=100)):
                    if output.text == text:
                        return output.fence.incarnation

    try:
        async with running_worker(settings, pipeline, "echo", worker_id="w1"):
            await coordinator.open("s")
            assert await answered("before") == 0
            lease = await coordinator.bus.client.get(lease_key)
            resolver.hang()
            await asyncio.to_thread(server.restart)
            # Two TTLs: a worker that could not reconnect would have lost the lease.
            await asyncio.sleep(6.0)
            assert await coordinator.bus.client.get(lease_key) == lease
            assert await answered("after") == 0
    finally:
        await coordinator.aclose()
        server.stop()
