"""Lanes to a node that stops serving as a primary are closed.

A process's script batches and stream reads go over lanes to each primary
(``dataplane.replicated``, ``dataplane.node_lanes``). A failover demotes a primary
to a replica; the lanes to it served nothing from then on but were kept, each with
its socket open on that node, for as long as the process ran. They are closed once
the slot map is learnt again.
"""

from __future__ import annotations

import asyncio

import redis

from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from dataplane.lane import Lane
from schemas.config import echo_pipeline
from schemas.events import TextPayload
from schemas.keys import Keys
from tests.redis_cluster import RedisCluster

PIPELINE = echo_pipeline("echo")


def local_address(lane: Lane) -> str:
    """``host:port`` of a connected lane's end here, as the node's CLIENT LIST shows it."""
    assert lane._protocol is not None and lane._protocol.transport is not None
    host, port = lane._protocol.transport.get_extra_info("sockname")[:2]
    return f"{host}:{port}"


def clients_of(port: int) -> set[str]:
    with redis.Redis(port=port) as client:
        return {entry["addr"] for entry in client.client_list()}


async def test_lanes_to_a_primary_demoted_by_a_failover_are_closed(tmp_path):
    cluster = RedisCluster(tmp_path / "cluster")
    cluster.start()
    bus = RedisBus(cluster.url, Keys("demoted"))
    try:
        authority = SessionAuthority(bus, PIPELINE)
        sessions = [f"s{i}" for i in range(12)]
        for sid in sessions:
            await authority.open(sid)

        async def append_and_read() -> None:
            await asyncio.gather(
                *(authority.append(sid, "append_text", TextPayload("x")) for sid in sessions)
            )
            inputs = {bus.keys.session(sid).input: "0-0" for sid in sessions}
            assert {e.stream for e in await bus.xread_now(inputs, 10)} == set(inputs)

        await append_and_read()
        demoted = cluster.primary_of(bus.keys.session("s0").meta)
        name = f"127.0.0.1:{demoted.port}"
        assert bus.node_lanes is not None and bus._replicated is not None
        pool = bus._replicated.pool
        assert pool is not None
        lanes = [bus.node_lanes._lanes[name], *pool.idle(name)]
        ours = {local_address(lane) for lane in lanes}
        assert ours <= clients_of(demoted.port)

        promoted = cluster.replica_of(demoted)
        with redis.Redis(port=promoted.port) as client:
            client.execute_command("CLUSTER", "FAILOVER")
        async with asyncio.timeout(30):
            while cluster.primary_of(bus.keys.session("s0").meta).port != promoted.port:
                await asyncio.sleep(0.1)
        cluster.wait_ok()

        await append_and_read()  # redirected from the demoted node: the map is learnt again
        async with asyncio.timeout(10):
            while ours & clients_of(demoted.port):
                await asyncio.sleep(0.05)
        assert name not in bus.node_lanes._lanes
        assert not pool.idle(name)
        await append_and_read()  # and the promoted node serves on
    finally:
        await bus.aclose()
        cluster.stop()
