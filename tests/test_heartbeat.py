"""A worker's leases on a Redis Cluster outlive a primary that stops answering.

Each lease is renewed on its own (``workers.heartbeat``): a primary that takes no
command for longer than a lease's TTL costs the worker at most the sessions whose
keys live on it, never those on the other primaries.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal

from coordinator.service import Coordinator
from dataplane.cluster import cluster_client
from schemas.config import Settings, echo_pipeline
from tests.pipeline_helpers import fast_settings, running_worker
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer


async def test_a_stopped_primary_costs_a_worker_no_lease_on_another_primary(tmp_path):
    """One primary is stopped (SIGSTOP) for longer than a lease's TTL, so that its
    replica is promoted meanwhile (a primary restarting or failing over takes no write
    for about as long). Before, a heartbeat renewed every lease in one batch and waited
    for the slowest call: the calls to the stopped primary held back every renewal
    until the command timeout (5 s), and the worker lost its sessions on all three
    primaries."""
    cluster = RedisCluster(tmp_path / "cluster")
    cluster.start()
    # The shipped lease and heartbeat: what a lapse is measured against.
    defaults = Settings.model_fields
    settings = fast_settings(
        cluster.url, "beat", lease_ttl_ms=defaults["lease_ttl_ms"].default,
        heartbeat_ms=defaults["heartbeat_ms"].default,
    )  # fmt: skip
    ttl_s = settings.lease_ttl_ms / 1000
    pipeline = echo_pipeline("echo")
    coordinator = Coordinator(settings, pipeline)
    keys = coordinator.bus.keys
    sessions = [f"s{i}" for i in range(18)]
    victim = cluster.primary_of(keys.session("s0").meta)
    elsewhere = [s for s in sessions if cluster.primary_of(keys.session(s).meta) is not victim]
    direct = cluster_client(cluster.url)
    try:
        async with running_worker(settings, pipeline, "echo") as worker:
            for sid in sessions:
                await coordinator.open(sid)
            async with asyncio.timeout(30):
                while len(worker.actors) < len(sessions):
                    await asyncio.sleep(0.05)
            assert elsewhere, "every session lives on the victim"
            leases = {sid: await direct.get(keys.session(sid).lease("echo")) for sid in elsewhere}
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(ttl_s + 1.5)
            finally:
                os.kill(victim.proc.pid, signal.SIGCONT)
            await asyncio.sleep(1)
            for sid in elsewhere:
                assert await direct.get(keys.session(sid).lease("echo")) == leases[sid], sid
                assert worker.actors[sid].active, sid
    finally:
        await direct.aclose()
        await coordinator.aclose()
        cluster.stop()
        gc.collect()  # a socket left unclosed by a dropped node object fails this test


def _replica_of(cluster: RedisCluster, primary: RedisServer) -> RedisServer:
    """The replica of ``primary``, as the primary's ``CLUSTER NODES`` tells."""
    live = {node.port for node in cluster.nodes}
    for port, role, of in cluster._roles(primary, live):
        if role == "replica" and of == primary.port:
            return next(node for node in cluster.nodes if node.port == port)
    raise LookupError(primary.port)


async def test_a_slow_replica_costs_a_worker_no_lease(tmp_path):
    """A replica that acknowledges nothing for a while (stopped with SIGSTOP: a replica
    stalled on a loaded machine does the same for shorter) makes every write of its
    primary wait out ``WAIT``'s timeout (1 s), retried. A lease renewal is answered
    without waiting for the replica (``ReplicatedRunner.no_wait``): before, a renewal
    waited, the next renewal of its lease was not sent meanwhile (one in flight per
    lease), and a lease whose TTL is no longer than WAIT's timeout lapsed although every
    renewal of it had run; the worker's own orphan scan then took the session again
    under a new incarnation. The tests' 1 s lease TTL (``fast_settings``) is such a
    TTL; the shipped 3 s one outlives a retried WAIT."""
    cluster = RedisCluster(tmp_path / "cluster")
    cluster.start()
    settings = fast_settings(cluster.url, "slow")
    pipeline = echo_pipeline("echo")
    coordinator = Coordinator(settings, pipeline)
    keys = coordinator.bus.keys
    sessions = [f"s{i}" for i in range(6)]
    primary = cluster.primary_of(keys.session("s0").meta)
    on_it = [s for s in sessions if cluster.primary_of(keys.session(s).meta) is primary]
    replica = _replica_of(cluster, primary)
    direct = cluster_client(cluster.url)
    try:
        async with running_worker(settings, pipeline, "echo") as worker:
            for sid in sessions:
                await coordinator.open(sid)
            async with asyncio.timeout(30):
                while len(worker.actors) < len(sessions):
                    await asyncio.sleep(0.05)
            leases = {sid: await direct.get(keys.session(sid).lease("echo")) for sid in on_it}
            assert replica.proc is not None
            os.kill(replica.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(3)
            finally:
                os.kill(replica.proc.pid, signal.SIGCONT)
            await asyncio.sleep(1.5)
            for sid in on_it:
                assert await direct.get(keys.session(sid).lease("echo")) == leases[sid], sid
                assert worker.actors[sid].active, sid
    finally:
        await direct.aclose()
        await coordinator.aclose()
        cluster.stop()
        gc.collect()  # a socket left unclosed by a dropped node object fails this test
