"""A full Redis (maxmemory, noeviction) refuses writes: the adapter raises
``RedisFullError`` (``redis_full``) for what it refused, and renewals, holds and detaches
run all the same (``dataplane.full``)."""

import asyncio
import contextlib

import pytest
import redis

from coordinator.attachments import Attachments
from dataplane.authority import SessionAuthority
from dataplane.batching import multi_script
from dataplane.bus import RedisBus
from dataplane.scripts import ALLOW_OOM
from schemas.config import echo_pipeline
from schemas.errors import ErrorCode, RedisFullError
from schemas.events import TextPayload
from schemas.keys import Keys
from workers.ownership import StageOwnership

# -- the adapter ---------------------------------------------------------------------------


@contextlib.contextmanager
def refusing_writes(ports: list[int]):
    """Every node at a limit far below what it holds (so every write that adds is
    refused), then back to no limit."""
    clients = [redis.Redis(port=port) for port in ports]
    try:
        for client in clients:
            client.config_set("maxmemory", 1)
        yield
    finally:
        for client in clients:
            client.config_set("maxmemory", 0)
            client.close()


@pytest.fixture(params=["redis", "cluster"])
def target(request):
    """(URL, every node's port) of a real single Redis, then of a real Redis Cluster."""
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return cluster.url, [node.port for node in cluster.nodes]
    server = request.getfixturevalue("redis_server")
    return server.url, [server.port]


async def test_a_refused_write_is_a_redis_full_error_and_writes_nothing(target, key_prefix):
    url, ports = target
    pipeline = echo_pipeline("echo")
    bus = RedisBus(url, Keys(key_prefix))
    authority = SessionAuthority(bus, pipeline)
    try:
        await authority.open("s1")
        await authority.open("s2")
        log = bus.keys.session("s1").input
        with refusing_writes(ports):
            with pytest.raises(RedisFullError) as refused:
                await authority.append("s1", "append_text", TextPayload("a"))
            assert refused.value.code is ErrorCode.REDIS_FULL and refused.value.retryable
            # Calls made together share one script call on a single Redis (its multi
            # form): each is refused on its own.
            both = await asyncio.gather(
                authority.append("s1", "append_text", TextPayload("b")),
                authority.append("s2", "append_text", TextPayload("c")),
                return_exceptions=True,
            )
            assert [type(r) for r in both] == [RedisFullError, RedisFullError]
            with pytest.raises(RedisFullError):  # a plain command as well
                await bus.hset(bus.keys.session("s1").meta, {"config": "{}"})
            assert await bus.xlen(log) == 0
        receipt = await authority.append("s1", "append_text", TextPayload("d"))
        assert receipt.seq == 1 and await bus.xlen(log) == 1  # the refused ones left nothing
    finally:
        await bus.aclose()


async def test_renewals_and_holds_run_on_a_full_redis(target, key_prefix):
    url, ports = target
    pipeline = echo_pipeline("echo")
    bus = RedisBus(url, Keys(key_prefix))
    authority = SessionAuthority(bus, pipeline)
    ownership = StageOwnership(bus, pipeline, "echo", "w1", ttl_ms=3000)
    attachments = Attachments(bus, ttl_ms=5000)
    sessions = ["s1", "s2"]
    try:
        leases = []
        for sid in sessions:
            await authority.open(sid)
            leases.append((await ownership.acquire(sid, 1000))[1])
            await attachments.attach(sid, f"att-{sid}", "", 1000, resume=False)
        workers = bus.keys.workers("echo")
        await bus.rescore(workers, {"w1": 1})  # not there yet: added by a plain ZADD
        lease_keys = [bus.keys.session(sid).lease("echo") for sid in sessions]
        for key in lease_keys:
            await bus.client.pexpire(key, 1500)
        with refusing_writes(ports):
            # Renewed together, as a heartbeat renews (one multi script on a single Redis).
            assert await ownership.renew(leases, 2000) == [True, True]
            for key in lease_keys:
                assert await bus.client.pttl(key) > 2000
            holds = await attachments.hold({sid: f"att-{sid}" for sid in sessions}, 9000)
            assert holds == {"s1": "ok", "s2": "ok"}
            for sid in sessions:
                meta = bus.keys.session(sid).meta
                assert await bus.hmget(meta, ["att_until"]) == [b"14000"]
            assert await attachments.detach("s1", "att-s1", 9500)  # the grace starts now
            assert await bus.hmget(bus.keys.session("s1").meta, ["att_until"]) == [b"9500"]
            await bus.rescore(workers, {"w1": 2})  # a member's new score: taken
            assert await bus.client.zscore(workers, "w1") == 2
            with pytest.raises(RedisFullError):  # a new member: refused
                await bus.rescore(workers, {"w2": 2})
            lease_index = bus.keys.lease_index("echo")
            assert await bus.client.zscore(lease_index, "s1") == 2000 + 3000
    finally:
        await bus.aclose()


def test_the_multi_form_keeps_a_scripts_flags_first():
    """Redis reads a script's flags on its first line only (elsewhere the line does not
    compile): the multi form of a flagged script starts with them too."""
    bus = RedisBus("redis://127.0.0.1:1/0")  # not connected: only the scripts' texts
    for script in (bus.renew_script, bus.hold_script, bus.detach_script, bus.rescore_script):
        assert script.script.startswith(ALLOW_OOM)
        assert multi_script(script.script).script.startswith(ALLOW_OOM)
    assert not multi_script(bus.append_script.script).script.startswith("#!")
