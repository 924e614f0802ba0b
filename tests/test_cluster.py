"""The data plane on a real Redis Cluster: slots, and a primary killed under load.

The pipeline and fault tests (``tests/test_pipeline.py``, ``tests/test_faults.py``)
run on a cluster too, through the ``redis_url`` fixture; this module checks what
only a cluster has.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from typing import Any

import pytest
import redis

from coordinator.service import Coordinator
from dataplane.bus import RedisBus
from dataplane.cluster import cluster_client, seed_nodes, stream_read_keys
from schemas.config import echo_pipeline
from schemas.events import TextPayload
from schemas.keys import CLIENT, Keys
from tests.pipeline_helpers import fast_settings, outputs_of, running_worker
from tests.redis_cluster import RedisCluster


def test_a_cluster_url_names_one_seed_node_or_several():
    assert seed_nodes("redis+cluster://h:7000") == ("redis://h:7000", [])
    assert seed_nodes("rediss+cluster://u:secret@a:1,b:2,c:3/0?x=1") == (
        "rediss://u:secret@a:1/0?x=1",
        [("b", 2), ("c", 3)],
    )
    with pytest.raises(ValueError, match="not HOST:PORT"):
        seed_nodes("redis+cluster://a:1,b")


def test_the_nodes_of_a_cluster_get_ports_whose_bus_ports_no_other_node_takes():
    """All six nodes get their ports before any starts: one node's bus port (port +
    10000) must not be another's port (CI once saw a node refused its port so), and
    none may lie where the kernel picks outgoing connections' local ports."""
    from chaos.cluster import BUS_OFFSET, cluster_port, ephemeral_range

    ports = [cluster_port() for _ in range(12)]
    every = ports + [port + BUS_OFFSET for port in ports]
    assert len(set(every)) == len(every)
    low, _ = ephemeral_range()
    if low - BUS_OFFSET > 12_000:  # a machine whose ephemeral range leaves room below it
        assert all(port < low for port in every)


def test_a_sessions_keys_and_its_partitions_bells_share_one_slot(redis_cluster):
    node = redis_cluster.live()
    keys = Keys("slots", cluster=True)
    with redis.Redis(port=node.port) as client:
        primaries: set[str] = set()
        for i in range(40):
            sk = keys.session(f"session-{i}")
            names = [sk.meta, sk.input, sk.control, sk.client, sk.progress,
                     sk.stage_out("a"), sk.lease("a"), sk.bell("a"), sk.bell(CLIENT)]  # fmt: skip
            slots = {client.execute_command("CLUSTER", "KEYSLOT", name) for name in names}
            assert len(slots) == 1
            primaries.add(redis_cluster.primary_of(sk.meta).port)
    # Sessions spread over every primary: the cluster shares the load.
    assert len(primaries) == 3


def test_a_stream_reads_keys_are_told_from_its_options():
    assert stream_read_keys(("COUNT", 5, "BLOCK", 100, "STREAMS", "a", "b", "0", "$")) == [
        "a",
        "b",
    ]
    # A group named like the STREAMS keyword is still a group.
    assert stream_read_keys((b"GROUP", b"streams", b"c", b"NOACK", b"STREAMS", b"k", b">")) == [
        b"k"
    ]
    assert stream_read_keys(("UNKNOWN", "STREAMS", "k", "0")) == []


def _command_calls(cluster: RedisCluster) -> dict[str, int]:
    """Each command's calls since the last reset, summed over every node."""
    calls: dict[str, int] = {}
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as client:
            for name, stats in client.info("commandstats").items():
                calls[name] = calls.get(name, 0) + int(stats["calls"])
    return calls


def _reset_command_calls(cluster: RedisCluster) -> None:
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as client:
            client.config_resetstat()


def _map_slot_to_another_primary(bus: RedisBus, key: str, owner: int) -> tuple[Any, int]:
    """Make the bus's slot map name a primary other than ``owner`` (a port) for
    ``key``'s slot, as a map out of date after a failover does; the map and the slot."""
    manager = bus.client.nodes_manager  # type: ignore[attr-defined]
    slot = bus.client.keyslot(key)  # type: ignore[attr-defined]
    wrong = next(
        node for node in manager.nodes_cache.values()
        if node.server_type == "primary" and node.port != owner
    )  # fmt: skip
    manager.slots_cache[slot] = [wrong]
    return manager, slot


async def test_stream_reads_on_a_cluster_go_to_their_node_without_asking_for_keys(
    redis_cluster,
):
    """redis-py asks a node for the keys of a command whose keys can move (``COMMAND
    GETKEYS``) before sending it; the data plane's stream reads find their slot
    themselves (``ClusterClient._determine_slot``), one round trip each."""
    bus = RedisBus(redis_cluster.url)
    try:
        streams = [f"{{reads-{i}}}s" for i in range(6)]
        for stream in streams:
            await bus.client.xadd(stream, {"f": "v"})
        reader = bus.reader(100)
        await bus.xread(reader, {streams[0]: "0"}, 10, 50)  # connects
        _reset_command_calls(redis_cluster)
        for stream in streams:
            assert len(await bus.xread(reader, {stream: "0"}, 10, 50)) == 1
        assert len(await bus.xread_now(dict.fromkeys(streams, "0"), 10)) == 6
        calls = _command_calls(redis_cluster)
        assert calls["cmdstat_xread"] >= 7
        assert not any(name.startswith("cmdstat_command") for name in calls)
    finally:
        await bus.aclose()


async def test_reads_of_many_streams_go_to_each_primary_as_one_xread_per_slot(redis_cluster):
    """``RedisBus.xread_now`` on a cluster reads each slot's streams with one XREAD, sent
    over a lane per primary (``dataplane.node_lanes``): no slot lookup (``COMMAND
    GETKEYS``, ``CLUSTER SLOTS``), whichever primary serves them."""
    bus = RedisBus(redis_cluster.url)
    try:
        streams = [f"{{lanes-{i}}}s" for i in range(30)]
        for stream in streams:
            await bus.client.xadd(stream, {"f": stream})
        assert len({redis_cluster.primary_of(s).port for s in streams}) == 3
        await bus.xread_now(dict.fromkeys(streams, "0"), 10)  # connects
        _reset_command_calls(redis_cluster)
        entries = await bus.xread_now(dict.fromkeys(streams, "0"), 10)
        assert sorted((e.stream, e.fields[b"f"].decode()) for e in entries) == sorted(
            (s, s) for s in streams
        )
        calls = _command_calls(redis_cluster)
        assert calls["cmdstat_xread"] == 30
        assert not any(name.startswith(("cmdstat_command", "cmdstat_cluster")) for name in calls)
    finally:
        await bus.aclose()


async def test_a_read_sent_to_a_node_that_no_longer_serves_its_slot_follows_the_redirection(
    redis_cluster,
):
    """A lane's read that a node answers with MOVED (the client's slot map is out of
    date, as after a failover or a slot's move) is read again through redis-py's
    client, which follows the redirection and learns where the slot is."""
    bus = RedisBus(redis_cluster.url)
    try:
        moved, stays = "{moved-0}s", "{stays-0}s"
        for stream in (moved, stays):
            await bus.client.xadd(stream, {"f": stream})
        owner = redis_cluster.primary_of(moved)
        manager, slot = _map_slot_to_another_primary(bus, moved, owner.port)
        entries = await bus.xread_now({moved: "0", stays: "0"}, 10)
        assert sorted(e.stream for e in entries) == [moved, stays]
        assert manager.get_node_from_slot(slot).port == owner.port
    finally:
        await bus.aclose()


async def test_script_calls_of_one_turn_reach_each_primary_in_one_round_trip(redis_cluster):
    """Calls made together are sent to each primary as one batch closed by one ``WAIT 1``
    (``dataplane.replicated``): a round trip and a replica acknowledgement per primary,
    not per call, over a lane to it; and a script's calls there, of many slots, as one
    EVALSHA of its cross-slot form (``dataplane.multi``). Each call still gets its own
    reply, an error reply only its own."""
    bus = RedisBus(redis_cluster.url)
    try:
        incr = bus.register("return redis.call('INCR', KEYS[1])")
        refuse = bus.register("return redis.error_reply('refused ' .. KEYS[1])")
        names = [f"{{batched-{i}}}n" for i in range(40)]
        # First calls: each node is refused them (NOSCRIPT), loads the script and runs
        # them again.
        first = await asyncio.gather(
            *(bus.run(incr, [k], []) for k in names),
            *(bus.run(refuse, [k], []) for k in names),
            return_exceptions=True,
        )
        assert first[:40] == [[1]] * 40
        assert all(isinstance(reply, redis.ResponseError) for reply in first[40:])
        _reset_command_calls(redis_cluster)
        replies = await asyncio.gather(
            *(bus.run(incr, [k], []) for k in names),
            bus.run(refuse, ["{batched-0}x"], []),
            return_exceptions=True,
        )
        assert replies[:-1] == [[2]] * 40
        assert isinstance(replies[-1], redis.ResponseError)
        assert "refused {batched-0}x" in str(replies[-1])
        calls = _command_calls(redis_cluster)
        assert calls["cmdstat_evalsha"] == 4  # the INCRs: one per primary; the refusal
        assert calls["cmdstat_wait"] == 3  # one per primary: the keys spread over all three
        # They went over lanes (replies parsed by hiredis), one per batch in flight.
        runner = bus._replicated
        assert runner is not None and runner.pool is not None
        assert {lane.where for lane in runner.pool.open} == {
            f"{node.host}:{node.port}" for node in bus.client.get_primaries()
        }
    finally:
        await bus.aclose()


async def test_calls_of_one_script_in_one_slot_go_as_one_call_of_its_multi_form(redis_cluster):
    """Calls of one script whose keys share a slot run as one EVALSHA of the script's
    multi form (``dataplane.batching``), as on one Redis: a script call's fixed cost,
    and its bells' rings, once per group. Each call keeps its own reply, an error only
    its own; a node that lost its scripts gets the multi again."""
    bus = RedisBus(redis_cluster.url)
    try:
        incr = bus.register(
            "if ARGV[1] == 'no' then return redis.error_reply('refused ' .. KEYS[1]) end "
            "return redis.call('INCR', KEYS[1])"
        )
        names = [f"{{grouped}}n{i}" for i in range(10)]
        await bus.run(incr, ["{grouped}warm"], ["yes"])  # the plain script, loaded
        _reset_command_calls(redis_cluster)
        replies = await asyncio.gather(
            *(bus.run(incr, [k], ["yes"]) for k in names),
            bus.run(incr, ["{grouped}x"], ["no"]),
            return_exceptions=True,
        )
        assert replies[:-1] == [[1]] * 10
        assert isinstance(replies[-1], redis.ResponseError)
        assert "refused {grouped}x" in str(replies[-1])
        calls = _command_calls(redis_cluster)
        assert calls["cmdstat_evalsha"] == 1  # the 11 calls as one multi
        assert calls["cmdstat_script|load"] == 1  # the multi, ahead of it
        for node in redis_cluster.nodes:
            with redis.Redis(port=node.port) as client:
                client.script_flush()
        again = await asyncio.gather(*(bus.run(incr, [k], ["yes"]) for k in names))
        assert again == [[2]] * 10
    finally:
        await bus.aclose()


async def test_a_client_whose_last_refresh_failed_still_closes_every_connection(
    redis_cluster,
):
    """``ClusterClient.refresh`` marks the client uninitialised when no node answered,
    and so does an error inside a command; its nodes keep their connections meanwhile.
    Closing it closes them all (redis-py's own close skips a client so marked)."""
    client = cluster_client(redis_cluster.url)
    for i in range(10):
        await client.set(f"{{close-{i}}}k", i)
    nodes = list(client.nodes_manager.nodes_cache.values())
    assert any(conn.is_connected for node in nodes for conn in node._connections)
    client._initialize = True  # as refresh() leaves it when no node answered
    await client.aclose()
    assert not any(conn.is_connected for node in nodes for conn in node._connections)


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_acknowledged_inputs_survive_a_primary_killed_with_sigkill(tmp_path, tls):
    """Clients append while the primary serving their sessions is killed with SIGKILL;
    the cluster promotes its replica. No append fails: each waits through the
    failover (``dataplane.cluster``). Every input is in the log and answered once, in
    order. Over plain TCP and over TLS (``rediss+cluster://``: redis-py's connections
    instead of lanes, for the scripts, the reads and the bells)."""
    cluster = RedisCluster(tmp_path / "cluster", tls=tls)
    cluster.start()
    try:
        settings = fast_settings(cluster.url, "kill")
        pipeline = echo_pipeline("echo")
        coordinator = Coordinator(settings, pipeline)
        keys = coordinator.bus.keys
        victim = cluster.primary_of(keys.session("s0").meta)
        sessions = [f"s{i}" for i in range(12)]
        on_victim = [s for s in sessions if cluster.primary_of(keys.session(s).meta) is victim]
        acked: dict[str, list[str]] = {sid: [] for sid in sessions}
        try:
            async with running_worker(settings, pipeline, "echo"):
                for sid in sessions:
                    await coordinator.open(sid)

                async def client(sid: str) -> None:
                    for i in range(60):
                        text = f"{sid}-{i}"
                        # No retry here: the data plane rides out the failover itself.
                        await coordinator.append(sid, "append_text", TextPayload(text))
                        acked[sid].append(text)
                        await asyncio.sleep(0.01)

                # A task group: one client failing stops the others before the
                # coordinator closes, so none outlives this test into the next.
                async with asyncio.TaskGroup() as clients:
                    for sid in sessions:
                        clients.create_task(client(sid))
                    await asyncio.sleep(0.3)
                    victim.stop(signal.SIGKILL)
                    killed_at = time.monotonic()
                got: dict[str, list[str]] = {sid: [] for sid in sessions}
                async with asyncio.timeout(60):
                    while any(len(got[s]) < len(acked[s]) for s in sessions):
                        for out in outputs_of(await coordinator.outputs(block_ms=200)):
                            got[out.fence.session_id].append(out.text)
        finally:
            await coordinator.aclose()
        assert on_victim, "no session lived on the killed primary"
        assert time.monotonic() - killed_at < 60
        for sid in sessions:
            # Each input is answered once (an append retried inside the data plane
            # after its reply was lost is recognised and written once).
            assert got[sid] == acked[sid], sid
    finally:
        cluster.stop()
        gc.collect()  # a socket left unclosed by a dropped node object fails this test


async def test_a_process_starts_while_the_first_node_it_names_is_dead(tmp_path):
    """A ``redis+cluster://`` URL may name several nodes: a process started after the
    first one died (its replica promoted) learns the cluster from the next one and
    serves, where a URL naming only the dead node could not reach the cluster."""
    cluster = RedisCluster(tmp_path / "cluster")
    cluster.start()
    try:
        first = cluster.nodes[0]
        first.stop(signal.SIGKILL)
        cluster.wait_ok()
        assert cluster.url.split("://", 1)[1].split(",")[0] == f"127.0.0.1:{first.port}"
        settings = fast_settings(cluster.url, "seeds")
        pipeline = echo_pipeline("echo")
        coordinator = Coordinator(settings, pipeline)
        try:
            async with running_worker(settings, pipeline, "echo"):
                sessions = [f"s{i}" for i in range(6)]
                for sid in sessions:
                    await coordinator.open(sid)
                    await coordinator.append(sid, "append_text", TextPayload(f"hi {sid}"))
                got: set[str] = set()
                async with asyncio.timeout(30):
                    while len(got) < len(sessions):
                        for out in outputs_of(await coordinator.outputs(block_ms=200)):
                            got.add(out.fence.session_id)
        finally:
            await coordinator.aclose()
        assert got == set(sessions)
    finally:
        cluster.stop()
        gc.collect()
