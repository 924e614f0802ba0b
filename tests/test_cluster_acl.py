"""A Redis Cluster reached as an ACL user with the rights ``docs/deploy.md`` names.

Managed Redis services and careful operators give an application a user of its own:
its key prefix's keys and channels, and every command but the dangerous ones
(``-@dangerous``: no ``INFO``, ``CONFIG``, ``ROLE``...). Every connection the data
plane makes to a cluster's nodes carries that user: the cluster client's, the lanes
of reads and of script batches, the bells' subscriptions (shard channels, ``&``
patterns), and the replica count a batch's ``WAIT`` depends on must be learnt
without ``INFO``.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis

from coordinator.service import Coordinator
from dataplane.redis_config import findings, observe
from schemas.config import echo_pipeline
from schemas.events import TextPayload
from tests.pipeline_helpers import fast_settings, outputs_of, running_worker
from tests.redis_cluster import NODE_TIMEOUT_MS, RedisCluster

USER = ["--user", "duplexq", "on", ">s3cret", "~acl:*", "&acl:*", "+@all", "-@dangerous"]
"""The application's user: its prefix's keys and channels, no dangerous command. The
default user stays for the test's own set-up (creating the cluster, replication)."""


async def test_an_acl_user_without_dangerous_commands_is_served_on_a_cluster(tmp_path):
    """Sessions on every primary are opened, appended to and answered as that user."""
    cluster = RedisCluster(tmp_path / "cluster", extra=USER)
    cluster.start()
    try:
        node = cluster.live()
        with redis.Redis(port=node.port, username="duplexq", password="s3cret") as client:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.info("replication")  # the user is as restricted as it says
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.set("other:key", 1)
        url = cluster.url.replace("://", "://duplexq:s3cret@", 1)
        # The start-up check counts each primary's replica from CLUSTER NODES: only
        # CONFIG's refusal is left to say (the operator vouches for persistence).
        said = {(f.severity.value, f.setting) for f in findings(await observe(url))}
        assert said == {("warning", "CONFIG")}
        settings = fast_settings(url, "acl")
        pipeline = echo_pipeline("echo")
        coordinator = Coordinator(settings, pipeline)
        keys = coordinator.bus.keys
        sessions = [f"s{i}" for i in range(12)]
        primaries = {cluster.primary_of(keys.session(sid).meta).port for sid in sessions}
        assert len(primaries) == 3
        try:
            async with running_worker(settings, pipeline, "echo"):
                for sid in sessions:
                    await coordinator.open(sid)
                await asyncio.gather(*(
                    coordinator.append(sid, "append_text", TextPayload(f"hi {sid}"))
                    for sid in sessions
                ))  # fmt: skip
                got: set[str] = set()
                async with asyncio.timeout(30):
                    while len(got) < len(sessions):
                        for out in outputs_of(await coordinator.outputs(block_ms=200)):
                            assert out.text == f"hi {out.fence.session_id}"
                            got.add(out.fence.session_id)
        finally:
            await coordinator.aclose()
        # Counted without INFO, each primary's replica made its batches wait for it.
        waits = 0
        for port in primaries:
            with redis.Redis(port=port) as client:
                waits += int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
        assert waits >= 3
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "node_timeout_ms",
    [NODE_TIMEOUT_MS, 15_000],
    ids=["tests-node-timeout", "redis-default-node-timeout"],
)
async def test_an_acl_users_writes_go_on_once_a_dead_replica_is_unlinked(tmp_path, node_timeout_ms):
    """Counted from ``CLUSTER NODES``, a replica killed with SIGKILL stops counting once
    its primary's link to it is down, which is at once, not once the cluster flags it
    failed (its node timeout): a write to its primary meanwhile waits out one ``WAIT``
    and is retried, then is acknowledged by the primary alone, as with INFO's count
    when a replica dies between two checks. No append fails. Run with the tests' node
    timeout (1 s) and with Redis's default (15 s), which the ``cluster`` profile of
    docker-compose.yml runs: counted by the ``fail`` flag alone, the write waited about
    19 s there, close to the 30 s a call is retried for (``RETRY_S``)."""
    options = [*USER, "--cluster-node-timeout", str(node_timeout_ms)]
    cluster = RedisCluster(tmp_path / "cluster", extra=options)
    cluster.start()
    try:
        url = cluster.url.replace("://", "://duplexq:s3cret@", 1)
        settings = fast_settings(url, "acl")
        pipeline = echo_pipeline("echo")
        coordinator = Coordinator(settings, pipeline)
        primary = cluster.primary_of(coordinator.bus.keys.session("s0").meta)
        try:
            async with running_worker(settings, pipeline, "echo"):
                await coordinator.open("s0")
                await coordinator.append("s0", "append_text", TextPayload("before"))
                cluster.replica_of(primary).stop(signal.SIGKILL)
                began = time.monotonic()
                await coordinator.append("s0", "append_text", TextPayload("after"))
                waited = time.monotonic() - began
                assert waited < 10, waited  # not the node timeout, nor RETRY_S
                texts: list[str] = []
                async with asyncio.timeout(30):
                    while texts != ["before", "after"]:
                        texts += [
                            o.text for o in outputs_of(await coordinator.outputs(block_ms=200))
                        ]
        finally:
            await coordinator.aclose()
    finally:
        cluster.stop()
