"""Closing a cluster bus while a call is being retried through a failover.

A call retried through a failover (``dataplane.replicated``) learns the slot map again
between tries, and redis-py connects to a node for that. Once the bus was closed, the
retries went on: the client connected afresh, and the sockets it opened then were left
for the garbage collector (a ``ResourceWarning`` that failed whichever test was running
when it was collected). Closing now stops the retries and the client refuses to
connect again; redis-py's own closing of the client, which asks for a fresh start,
is not a close for good.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from dataplane.bus import RedisBus
from dataplane.cluster import ClientClosedError, ClusterClient
from schemas.keys import Keys
from tests.redis_cluster import RedisCluster, another_slot_of, cluster_state, slot_of


def clients_of(cluster: RedisCluster) -> int:
    """Connections to the cluster's nodes, the ones asking left out."""
    count = 0
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as client:
            me = client.client_id()
            count += sum(1 for c in client.client_list() if int(c["id"]) != me)
    return count


async def test_closing_the_bus_stops_a_call_retried_through_a_failover(own_cluster):
    bus = RedisBus(own_cluster.url, Keys("closing"))
    incr = bus.register("return redis.call('INCR', KEYS[1])")
    assert await bus.run(incr, ["{a}k"], []) == [1]
    primary = own_cluster.primary_of("{a}k")
    lost = another_slot_of(primary, slot_of(own_cluster, "{a}k"))
    with redis.Redis(port=primary.port) as client:
        client.execute_command("CLUSTER", "DELSLOTS", lost)  # the cluster is down there
    assert cluster_state(primary) == "cluster_state:fail"
    call = asyncio.ensure_future(bus.run(incr, ["{a}k"], []))
    await asyncio.sleep(0.5)
    assert not call.done()  # retried, waiting for the cluster
    await bus.aclose()
    # Its caller hears that the client closed: a CancelledError in a task nobody
    # cancelled would pass for that task's own cancellation.
    with pytest.raises(ClientClosedError):
        await asyncio.wait_for(call, 5)
    with pytest.raises(ClientClosedError):
        await bus.run(incr, ["{a}k"], [])
    await asyncio.sleep(1.0)  # longer than the retries' backoff
    assert clients_of(own_cluster) == 0


async def test_the_client_serves_on_after_redis_py_closes_it_to_start_again(own_cluster):
    """redis-py's cluster pipeline answers a connection error by closing the client
    (``aclose``) so that the next command learns the cluster again; only the bus's own
    close (``close_for_good``) is for good. A pipeline failing during a partition once left a
    coordinator refusing every command."""
    bus = RedisBus(own_cluster.url, Keys("again"))
    try:
        client = bus.client
        assert isinstance(client, ClusterClient)
        await client.set("{a}k", 1)
        await client.aclose()  # as ClusterPipeline.execute does after a ConnectionError
        async with client.pipeline(transaction=False) as pipe:
            pipe.incr("{a}k")
            assert await pipe.execute() == [2]
        assert await client.get("{a}k") == b"2"
    finally:
        await bus.aclose()
    with pytest.raises(ClientClosedError):
        await client.get("{a}k")
    assert clients_of(own_cluster) == 0
