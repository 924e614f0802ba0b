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
from collections.abc import Callable

from coordinator.service import Coordinator
from dataplane.cluster import cluster_client
from schemas.config import Settings, echo_pipeline
from schemas.keys import Keys
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

    def choose(keys: Keys, sessions: list[str]) -> tuple[RedisServer, list[str]]:
        victim = cluster.primary_of(keys.session("s0").meta)
        elsewhere = [s for s in sessions if cluster.primary_of(keys.session(s).meta) is not victim]
        assert elsewhere, "every session lives on the victim"
        return victim, elsewhere

    ttl_s = settings.lease_ttl_ms / 1000
    await _leases_outlive_a_stop(cluster, settings, 18, choose, ttl_s + 1.5, 1.0)


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

    def choose(keys: Keys, sessions: list[str]) -> tuple[RedisServer, list[str]]:
        primary = cluster.primary_of(keys.session("s0").meta)
        on_it = [s for s in sessions if cluster.primary_of(keys.session(s).meta) is primary]
        return cluster.replica_of(primary), on_it

    await _leases_outlive_a_stop(cluster, fast_settings(cluster.url, "slow"), 6, choose, 3, 1.5)


async def _leases_outlive_a_stop(
    cluster: RedisCluster,
    settings: Settings,
    count: int,
    choose: Callable[[Keys, list[str]], tuple[RedisServer, list[str]]],
    stop_s: float,
    settle_s: float,
) -> None:
    """One echo worker takes ``count`` sessions; the node ``choose`` names is stopped
    (SIGSTOP) for ``stop_s``; ``settle_s`` later, every session ``choose`` names has
    the lease it had before and its actor is still active. The cluster is stopped."""
    pipeline = echo_pipeline("echo")
    coordinator = Coordinator(settings, pipeline)
    keys = coordinator.bus.keys
    sessions = [f"s{i}" for i in range(count)]
    direct = cluster_client(cluster.url)
    try:
        node, kept = choose(keys, sessions)
        async with running_worker(settings, pipeline, "echo") as worker:
            for sid in sessions:
                await coordinator.open(sid)
            async with asyncio.timeout(30):
                while len(worker.actors) < len(sessions):
                    await asyncio.sleep(0.05)
            leases = {sid: await direct.get(keys.session(sid).lease("echo")) for sid in kept}
            assert node.proc is not None
            os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(stop_s)
            finally:
                os.kill(node.proc.pid, signal.SIGCONT)
            await asyncio.sleep(settle_s)
            for sid in kept:
                assert await direct.get(keys.session(sid).lease("echo")) == leases[sid], sid
                assert worker.actors[sid].active, sid
    finally:
        await direct.aclose()
        await coordinator.aclose()
        cluster.stop()
        gc.collect()  # a socket left unclosed by a dropped node object fails this test
