"""Calls of one script in several slots of one primary go as one EVALSHA of its
cross-slot form (``dataplane.multi``), whose keys Redis does not route.

While a reshard moves a slot, its keys are split between two nodes for a while. A call
naming keys of that slot must then write nothing where it runs, or it would write part
of its effects on the old node and the rest, sent again, on the new one. The
cross-slot form probes each call's keys before the call's own part; a call that fails
the probe is sent again on its own with declared keys, which waits out the migration
(``TRYAGAIN``, then ``MOVED``) and lands on the new node once.
"""

from __future__ import annotations

import asyncio

import redis

from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from dataplane.multi import multi_script
from dataplane.scripts import ALLOW_OOM
from schemas.config import echo_pipeline
from schemas.events import TextPayload
from schemas.keys import Keys
from tests.redis_cluster import RedisCluster, SlotMove, another_slot_of, cluster_state, slot_of
from tests.redis_server import RedisServer

INCR_BOTH = "redis.call('INCR', KEYS[1]) return redis.call('INCR', KEYS[2])"


def two_slots_of_one_primary(
    cluster: RedisCluster, key_of: dict[str, str]
) -> tuple[str, str, RedisServer]:
    """Two names whose keys (``key_of``) are in different slots of one primary, and it."""
    seen: dict[int, tuple[str, int]] = {}
    for name, key in key_of.items():
        port, slot = cluster.primary_of(key).port, slot_of(cluster, key)
        if port in seen and seen[port][1] != slot:
            return seen[port][0], name, cluster.primary_of(key)
        seen.setdefault(port, (name, slot))
    raise LookupError("no two slots of one primary")


def exists_calls(node: RedisServer) -> int:
    """EXISTS commands ``node`` ran or refused (the cross-slot form's probes: the scripts
    here make none of their own)."""
    with redis.Redis(port=node.port) as client:
        stats = client.info("commandstats").get("cmdstat_exists", {})
        return int(stats.get("calls", 0)) + int(stats.get("rejected_calls", 0))


async def test_a_call_finding_its_keys_split_by_a_reshard_writes_nothing_until_it_lands(
    own_cluster,
):
    """Without the probe the moving call would increment its first key on the old node,
    fail on its second, and, sent again, increment both on the new one: 3 and 2."""
    bus = RedisBus(own_cluster.url, Keys("split"))
    try:
        both = bus.register(INCR_BOTH)
        tags = {f"t{i}": f"{{t{i}}}a" for i in range(200)}
        moving, staying, source = two_slots_of_one_primary(own_cluster, tags)
        moving_keys, staying_keys = (
            [f"{{{moving}}}{k}" for k in "ab"],
            [f"{{{staying}}}{k}" for k in "ab"],
        )
        first = await asyncio.gather(
            bus.run(both, moving_keys, []), bus.run(both, staying_keys, [])
        )
        assert first == [[1], [1]]
        target = next(node for node in own_cluster.nodes if node.port != source.port)
        move = SlotMove(source, target, own_cluster.nodes, slot_of(own_cluster, moving_keys[0]))
        move.begin().migrate(moving_keys[1])  # the slot's keys now split between two nodes
        probes = exists_calls(source)
        calls = [asyncio.ensure_future(bus.run(both, keys, []))
                 for keys in (moving_keys, staying_keys)]  # fmt: skip
        assert await calls[1] == [2]  # the other slot's call, in the same script call, ran
        assert exists_calls(source) >= probes + 2  # both went in the cross-slot form
        await asyncio.sleep(0.5)  # the moving call is sent again meanwhile: TRYAGAIN
        assert not calls[0].done()
        with redis.Redis(port=source.port) as old:
            assert old.get(moving_keys[0]) == b"1"  # nothing written where it failed
        move.finish()
        assert await asyncio.wait_for(calls[0], 30) == [2]
        with redis.Redis(port=target.port) as new:
            assert [new.get(key) for key in moving_keys] == [b"2", b"2"]
    finally:
        await bus.aclose()


async def test_calls_refused_while_the_cluster_is_down_wait_for_it_and_land_once(
    own_cluster,
):
    """While a slot has no primary the cluster is down, and Redis refuses a cross-slot
    call at its probe ("cluster is down": a command with declared keys is refused with
    ``CLUSTERDOWN`` before it runs). The calls wrote nothing and wait, sent again alone,
    until the cluster is up, as through a failover; each then lands once. A slot taken
    from its primary (``CLUSTER DELSLOTS``) makes that primary see the cluster down."""
    bus = RedisBus(own_cluster.url, Keys("down"))
    try:
        both = bus.register(INCR_BOTH)
        tags = {f"t{i}": f"{{t{i}}}a" for i in range(200)}
        one, other, primary = two_slots_of_one_primary(own_cluster, tags)
        key_sets = [[f"{{{tag}}}{k}" for k in "ab"] for tag in (one, other)]
        assert await asyncio.gather(*(bus.run(both, keys, []) for keys in key_sets)) == [
            [1],
            [1],
        ]
        lost = another_slot_of(primary, *(slot_of(own_cluster, k[0]) for k in key_sets))
        with redis.Redis(port=primary.port) as client:
            client.execute_command("CLUSTER", "DELSLOTS", lost)
        assert cluster_state(primary) == "cluster_state:fail"
        probes = exists_calls(primary)
        calls = [asyncio.ensure_future(bus.run(both, keys, [])) for keys in key_sets]
        await asyncio.sleep(0.5)
        assert exists_calls(primary) >= probes + 2  # both went in the cross-slot form
        assert not any(call.done() for call in calls)  # waiting, not failed
        with redis.Redis(port=primary.port) as client:
            client.execute_command("CLUSTER", "ADDSLOTS", lost)
        assert await asyncio.wait_for(asyncio.gather(*calls), 30) == [[2], [2]]
        with redis.Redis(port=primary.port) as client:  # nothing written while down
            assert [client.get(key) for keys in key_sets for key in keys] == [b"2"] * 4
    finally:
        await bus.aclose()


async def test_appends_to_sessions_of_one_primary_land_once_through_a_reshard(own_cluster):
    """The product's own appends, two sessions of two slots of one primary appended
    together (one cross-slot call), one session's slot migrating with its input log
    already on the new node: the other's append is answered at once, the moving one's
    once the slot has moved, each with the next seq and one entry in its log."""
    bus = RedisBus(own_cluster.url, Keys("resharded"))
    authority = SessionAuthority(bus, echo_pipeline("echo"))
    try:
        metas = {f"s{i}": bus.keys.session(f"s{i}").meta for i in range(400)}
        moving, staying, source = two_slots_of_one_primary(own_cluster, metas)
        for sid in (moving, staying):
            await authority.open(sid)
        await asyncio.gather(*(authority.append(sid, "append_text", TextPayload("one"))
                               for sid in (moving, staying)))  # fmt: skip
        target = next(node for node in own_cluster.nodes if node.port != source.port)
        log = bus.keys.session(moving).input
        move = SlotMove(source, target, own_cluster.nodes, slot_of(own_cluster, log))
        move.begin().migrate(log)
        appends = [asyncio.ensure_future(authority.append(sid, "append_text", TextPayload("two")))
                   for sid in (moving, staying)]  # fmt: skip
        assert (await appends[1]).seq == 2
        await asyncio.sleep(0.5)
        assert not appends[0].done()
        move.finish()
        assert (await asyncio.wait_for(appends[0], 30)).seq == 2
        with redis.Redis(port=target.port) as new:
            assert new.xlen(log) == 2
            assert new.hget(metas[moving], "seq") == b"2"
    finally:
        await bus.aclose()


def test_the_cross_slot_form_adds_its_flag_to_a_scripts_flags():
    """Redis reads a script's flags on its first line only: the cross-slot form keeps the
    script's own (a renewal runs on a full Redis) beside ``allow-cross-slot-keys``."""
    bus = RedisBus("redis://127.0.0.1:1/0")  # not connected: only the scripts' texts
    renew = multi_script(bus.renew_script.script, cross_slot=True).script
    assert renew.startswith("#!lua flags=allow-cross-slot-keys,allow-oom\n")
    assert bus.renew_script.script.startswith(ALLOW_OOM)
    append = multi_script(bus.append_script.script, cross_slot=True).script
    assert append.startswith("#!lua flags=allow-cross-slot-keys\n")
