"""The nemesis suite's CI run: every fault class, and nothing lost, stale or wedged.

``python -m chaos --ci`` (seeded, about 85 s) starts a real Redis with the
shipped persistence (one server; then, with ``--redis-cluster``, a Redis
Cluster of 3 primaries with replicas, whose nodes the nemesis kills and
restarts), two coordinators, the control plane and two workers on each of two
chained stages, drives twenty WebSocket clients through them while the
nemesis kills, pauses and restarts processes, cuts them off from Redis or
slows their Redis, fills Redis's memory and drops sockets, and checks the
clients' histories (see ``chaos``, and docs/nemesis.md for what each class
does). This test runs it as a user
would and asserts on its report. The routes through which the processes reach
Redis (``chaos.proxy``), which the nemesis cuts and slows, are tested here on
their own too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from chaos.checker import COUNTS
from chaos.hosts import PREFIX
from chaos.nemesis import faults_for
from chaos.proxy import AddressRewriter, Proxies, Route
from dataplane.cluster import cluster_client
from tests.processes import ROOT
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer


@pytest.mark.timeout(400)
@pytest.mark.parametrize("redis", ["single", "cluster"])
def test_the_nemesis_ci_run_finds_nothing(tmp_path, redis):
    report = tmp_path / "report.json"
    mode = ["--redis-cluster"] if redis == "cluster" else []
    run = subprocess.run(
        [sys.executable, "-m", "chaos", "--ci", *mode, "--workdir", str(tmp_path / "run"),
         "--report", str(report)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert {name: result["totals"][name] for name in COUNTS} == dict.fromkeys(COUNTS, 0), (
        json.dumps([c for c in result["per_client"] if c["examples"]], indent=1)[:4000]
    )
    struck = result["faults"]
    assert all(struck[kind] >= 1 for kind in faults_for(redis == "cluster")), struck
    assert result["operations"]["ack"] > 1000 and result["operations"]["cancel_sent"] > 100
    assert result["owners"]["two_owners"] == 0, result["owners"]
    assert result["over_bound"] == {}, result["recovery"]  # docs/nemesis.md, "Bounds"
    assert result["ok"] and run.returncode == 0


NO_HOSTS = "DUPLEXQ_NEMESIS_NO_HOSTS"
"""Set (to 1) on a machine that cannot make network namespaces: the hosts run skips."""


@pytest.mark.timeout(400)
def test_the_nemesis_hosts_run_partitions_a_primary_and_loses_nothing(tmp_path):
    """``python -m chaos --ci --hosts``: the cluster's nodes, the workers and the
    coordinators on four simulated hosts (network namespaces), a host holding a primary
    and a minority of the processes partitioned off until its replica is promoted,
    then healed, among the other classes: no acknowledged input lost, no session's
    stage served by two owners (in the clients' histories or in what Redis kept)."""
    if os.environ.get(NO_HOSTS) == "1":
        pytest.skip(f"{NO_HOSTS}=1: this machine makes no network namespaces")
    assert os.geteuid() == 0, (
        f"the hosts run makes network namespaces and needs root; run the tests as root "
        f"(CI does), or set {NO_HOSTS}=1 on a machine that cannot"
    )
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "chaos", "--ci", "--hosts", "--workdir", str(tmp_path / "run"),
         "--report", str(report)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert {name: result["totals"][name] for name in COUNTS} == dict.fromkeys(COUNTS, 0), (
        json.dumps([c for c in result["per_client"] if c["examples"]], indent=1)[:4000]
    )
    assert result["faults"]["partition"] >= 1, result["fault_log"]
    assert all(struck >= 1 for struck in result["faults"].values()), result["faults"]
    assert result["owners"]["two_owners"] == 0, result["owners"]
    assert result["owners"]["handovers"] > 0  # the check had takeovers to judge
    assert result["over_bound"] == {}, result["recovery"]  # docs/nemesis.md, "Bounds"
    assert result["ok"] and run.returncode == 0
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    left = [int(pid) for pid in re.findall(rf"{PREFIX}-(\d+)-", listed.stdout)]
    assert not [pid for pid in left if not os.path.exists(f"/proc/{pid}")], listed.stdout


NODE = b"*4\r\n$9\r\n127.0.0.1\r\n:%d\r\n$40\r\n" + b"a" * 40 + b"\r\n*0\r\n"
SLOTS = b"*1\r\n*4\r\n:0\r\n:16383\r\n" + NODE % 7001 + NODE % 7002
REDIRECTS = b"-MOVED 3999 127.0.0.1:7002\r\n+OK\r\n-ASK 12 127.0.0.1:7001\r\n$9\r\n127.0.0.1\r\n"


@pytest.mark.parametrize("replies", [SLOTS, REDIRECTS])
def test_a_cluster_route_rewrites_node_addresses_however_the_reply_is_split(replies):
    rewritten = replies.replace(b"7001", b"9001").replace(b"7002", b"9002")
    for at in range(len(replies) + 1):
        rewriter = AddressRewriter("127.0.0.1", {7001: 9001, 7002: 9002})
        out = rewriter.feed(replies[:at]) + rewriter.feed(replies[at:])
        assert out + rewriter.flush() == rewritten, at


def test_a_reply_that_only_looks_like_an_address_passes_unchanged():
    rewriter = AddressRewriter("127.0.0.1", {7001: 9001})
    # A port that is not a node's, and values that merely contain the host.
    data = b"$9\r\n127.0.0.1\r\n:7005\r\n$12\r\nx127.0.0.1:7\r\n"
    assert rewriter.feed(data) == data and not rewriter.held


@pytest.fixture
def proxies() -> Iterator[Proxies]:
    hub = Proxies()
    yield hub
    hub.stop()


async def test_a_cut_route_holds_requests_with_the_socket_open_and_delivers_them_on_heal(
    redis_server: RedisServer, proxies: Proxies, key_prefix: str
):
    route = proxies.route("worker", [redis_server.port], rewrite=False)
    client = aioredis.Redis(port=route.ports[redis_server.port])
    try:
        assert await client.ping()
        route.cut()
        write = asyncio.create_task(client.set(f"{key_prefix}:cut", "held"))
        await asyncio.sleep(0.5)
        assert not write.done()  # neither answered nor failed: the socket is open
        direct = aioredis.Redis(port=redis_server.port)
        assert await direct.get(f"{key_prefix}:cut") is None  # nor did it reach Redis
        route.heal()
        assert await asyncio.wait_for(write, 5)
        assert await direct.get(f"{key_prefix}:cut") == b"held"
        await direct.aclose()
    finally:
        await client.aclose()


async def test_a_slowed_route_adds_its_delay_to_every_round_trip(
    redis_server: RedisServer, proxies: Proxies
):
    route = proxies.route("coordinator", [redis_server.port], rewrite=False)
    client = aioredis.Redis(port=route.ports[redis_server.port])
    try:
        await client.ping()
        route.slow(0.15)
        started = time.monotonic()
        for _ in range(3):
            await client.ping()
        assert time.monotonic() - started >= 0.45
        route.slow(0)
        started = time.monotonic()
        await client.ping()
        assert time.monotonic() - started < 0.1
    finally:
        await client.aclose()


async def test_a_cluster_client_on_a_route_reaches_every_node_through_it(
    redis_cluster: RedisCluster, proxies: Proxies, key_prefix: str
):
    ports = [node.port for node in redis_cluster.nodes]
    route = proxies.route("worker", ports, rewrite=True)
    seeds = ",".join(f"127.0.0.1:{route.ports[port]}" for port in ports[:3])
    client = cluster_client(f"redis+cluster://{seeds}/0")
    try:
        for i in range(30):  # keys on every primary
            await client.set(f"{key_prefix}:{{{i}}}", i)
        assert {node.port for node in client.get_nodes()} <= set(route.ports.values())
        route.cut()
        read = asyncio.create_task(client.get(f"{key_prefix}:{{7}}"))
        await asyncio.sleep(0.5)
        assert not read.done()
        route.heal()
        assert await asyncio.wait_for(read, 5) == b"7"
    finally:
        await client.aclose()


async def test_a_route_closes_every_connection_however_far_its_end_had_got():
    """A connection whose upstream ended (its task then cancels and waits for its pipes)
    is cancelled again by the route's close at that moment: the close still ends, with
    no task kept and both sockets closed; and a connection accepted as the route closes
    (its task starting only after) is closed too, not served on."""
    loop = asyncio.get_running_loop()

    async def upstream_ends(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()  # the node goes away at once

    node = await asyncio.start_server(upstream_ends, "127.0.0.1", 0)
    node_port = node.sockets[0].getsockname()[1]
    try:
        for rounds in range(40):
            route = Route("r", loop, "127.0.0.1")
            await route.open([node_port], rewrite=False)
            _, client = await asyncio.open_connection("127.0.0.1", route.ports[node_port])
            for _ in range(rounds):  # each round reaches a later step of the connection's end
                await asyncio.sleep(0)
            for task in list(route._tasks):  # the close's first cancel, at this step
                task.cancel()
            async with asyncio.timeout(5):
                await route.close()
            assert route._tasks == set()
            client.close()
        route = Route("late", loop, "127.0.0.1")
        await route.open([node_port], rewrite=False)
        _, client = await asyncio.open_connection("127.0.0.1", route.ports[node_port])
        await route.close()  # the accepted connection's task has not started yet
        for _ in range(10):
            await asyncio.sleep(0)
        assert route._tasks == set()
        client.close()
    finally:
        node.close()
