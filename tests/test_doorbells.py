"""Rings go to the worker that holds the session, and only to it.

A script that writes a stage's input rings the bell of the worker holding the
session's lease on that stage (``dataplane.scripts``), so the other workers of
the stage never wake for it. Each test runs on one Redis and on a Redis
Cluster (the ``redis_url`` fixture), where a bell lives in the session's
partition.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from coordinator.controlplane.control import ControlState, _forget_dead_workers
from coordinator.service import Coordinator
from dataplane.authority import SessionAuthority
from dataplane.bells import rings_of
from dataplane.bus import RedisBus
from dataplane.readiness import withdraw
from schemas.config import echo_pipeline
from schemas.events import OutputEvent, OutputKind, TextPayload
from schemas.keys import CLIENT, Keys, worker_bell
from tests.bell_tap import BellTap, stored_rings
from tests.pipeline_helpers import fast_settings, outputs_of, read_until, running_worker
from workers.ownership import StageOwnership

PIPELINE = echo_pipeline("echo", "next")  # echo reads the input, next reads echo


async def test_an_append_rings_the_holder_only(redis_url, key_prefix):
    bus = RedisBus(redis_url, Keys(key_prefix))
    try:
        async with BellTap(
            bus, [worker_bell("echo", "w1"), worker_bell("echo", "w2"), "echo"]
        ) as tap:
            authority = SessionAuthority(bus, PIPELINE)
            await authority.open("s1")
            await authority.append("s1", "append_text", TextPayload("before anyone holds it"))
            assert await tap.rings(worker_bell("echo", "w1")) == []  # nobody to tell
            assert await tap.rings("echo") == []  # the stage's own bell is never rung

            _, lease = await StageOwnership(bus, PIPELINE, "echo", "w1", 5000).acquire("s1", 0)
            assert lease is not None
            await authority.append("s1", "append_text", TextPayload("hello"))
            await authority.cancel("s1", reason="barge_in")
            assert await tap.rings(worker_bell("echo", "w1")) == [("s1", "d"), ("s1", "c")]
            assert await tap.rings(worker_bell("echo", "w2")) == []
            assert await tap.rings("echo") == []
    finally:
        await bus.aclose()


async def test_a_worker_whose_id_has_spaces_is_rung_on_its_own_bell(redis_url, key_prefix):
    # Acquire records the worker's bell from its id as given, and the lease's value is
    # "<worker> <token> <incarnation>": a worker id may hold spaces of its own.
    bus = RedisBus(redis_url, Keys(key_prefix))
    try:
        async with BellTap(
            bus, [*(worker_bell("echo", w) for w in ("host a 1", "host a", "host"))]
        ) as tap:
            authority = SessionAuthority(bus, PIPELINE)
            await authority.open("s1")
            owner = StageOwnership(bus, PIPELINE, "echo", "host a 1", 5000)
            _, lease = await owner.acquire("s1", 0)
            assert lease is not None
            await authority.append("s1", "append_text", TextPayload("hello"))
            assert await tap.rings(worker_bell("echo", "host a 1")) == [("s1", "d")]
            assert await tap.rings(worker_bell("echo", "host a")) == []
            assert await tap.rings(worker_bell("echo", "host")) == []
            out = OutputEvent(lease.fence, "echo", OutputKind.TEXT_DELTA, 1, 1, text="hi")
            published = await owner.publish(
                lease, [(lease.fence, [out])], applied_seq=1, read_id="1-0", out_seq=1
            )
            assert published.status == "ok"  # the lease holds: its token is found in the value
    finally:
        await bus.aclose()


async def test_rings_follow_the_lease_from_holder_to_holder(redis_url, key_prefix):
    # Acquire records whom to ring in the session's meta hash; release removes it, and the
    # next acquire replaces it.
    bus = RedisBus(redis_url, Keys(key_prefix))
    try:
        async with BellTap(bus, [*(worker_bell("echo", w) for w in ("w1", "w2", "w3"))]) as tap:
            authority = SessionAuthority(bus, PIPELINE)
            await authority.open("s1")
            first = StageOwnership(bus, PIPELINE, "echo", "w1", 5000)
            _, lease = await first.acquire("s1", 0)
            assert lease is not None
            await first.release(lease, hand_back=False)
            await authority.append("s1", "append_text", TextPayload("nobody holds it"))
            assert await tap.rings(worker_bell("echo", "w1")) == []

            _, lease = await StageOwnership(bus, PIPELINE, "echo", "w2", 5000).acquire("s1", 0)
            assert lease is not None
            await bus.client.delete(bus.keys.session("s1").lease("echo"))  # w2's lease expired
            _, lease = await StageOwnership(bus, PIPELINE, "echo", "w3", 5000).acquire("s1", 0)
            assert lease is not None
            await authority.append("s1", "append_text", TextPayload("w3 holds it"))
            await authority.cancel("s1", reason="barge_in")
            assert await tap.rings(worker_bell("echo", "w3")) == [("s1", "d"), ("s1", "c")]
            assert await tap.rings(worker_bell("echo", "w2")) == [("s1", "c")]  # w3's failover
            assert await tap.rings(worker_bell("echo", "w1")) == []
    finally:
        await bus.aclose()


async def test_a_publish_rings_the_next_stages_holder_and_the_coordinators(redis_url, key_prefix):
    bus = RedisBus(redis_url, Keys(key_prefix))
    try:
        async with BellTap(
            bus, [worker_bell("next", "w7"), worker_bell("next", "w1"), "next", CLIENT]
        ) as tap:
            await SessionAuthority(bus, PIPELINE).open("s1")
            echo = StageOwnership(bus, PIPELINE, "echo", "w1", 5000)
            _, lease = await echo.acquire("s1", 0)
            assert lease is not None
            _, held = await StageOwnership(bus, PIPELINE, "next", "w7", 5000).acquire("s1", 0)
            assert held is not None
            out = OutputEvent(lease.fence, "echo", OutputKind.TEXT_DELTA, 1, 1, text="hi")
            await echo.publish(
                lease, [(lease.fence, [out])], applied_seq=1, read_id="1-0", out_seq=1
            )
            assert await tap.rings(worker_bell("next", "w7")) == [("s1", "d")]
            assert await tap.rings(worker_bell("next", "w1")) == []
            assert await tap.rings("next") == []
            assert await tap.rings(CLIENT) == []  # echo is not client-facing

            nxt = StageOwnership(bus, PIPELINE, "next", "w7", 5000)
            reply = OutputEvent(held.fence, "next", OutputKind.TEXT_DELTA, 1, 1, text="hi")
            await nxt.publish(
                held, [(held.fence, [reply])], applied_seq=1, read_id="1-0", out_seq=1
            )
            assert await tap.rings(CLIENT) == [("s1", "d")]
    finally:
        await bus.aclose()


async def test_the_appends_of_one_batch_ring_each_bell_once(redis_server, key_prefix):
    """Appends sent together run as one multi (``dataplane.batching``): each worker's bell
    gets one entry naming every session of the batch it holds, and no other bell one."""
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        authority = SessionAuthority(bus, PIPELINE)
        holders = {"s1": "w1", "s2": "w1", "s3": "w2", "s4": None}
        for sid, worker in holders.items():
            await authority.open(sid)
            if worker:
                ownership = StageOwnership(bus, PIPELINE, "echo", worker, 5000)
                assert (await ownership.acquire(sid, 0))[1] is not None
        await asyncio.gather(
            *(authority.append(sid, "append_text", TextPayload("x")) for sid in holders)
        )
        for worker, held in (("w1", {"s1", "s2"}), ("w2", {"s3"})):
            entries = [e for b in bus.keys.bells(worker_bell("echo", worker))
                       for e in await bus.xrange(b)]  # fmt: skip
            assert len(entries) == 1
            assert sorted(rings_of(entries[0].fields)) == [(sid, "d") for sid in sorted(held)]
    finally:
        await bus.aclose()


async def test_rings_of_one_call_and_of_a_batch_name_their_sessions_and_kinds(
    redis_server, key_prefix
):
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        authority = SessionAuthority(bus, PIPELINE)
        long_id = "é" * 60 + "s"  # 121 bytes
        sessions = ["s1", "a b", long_id]
        for sid in sessions:
            await authority.open(sid)
            _, lease = await StageOwnership(bus, PIPELINE, "echo", "w1", 5000).acquire(sid, 0)
            assert lease is not None
        await authority.append(long_id, "append_text", TextPayload("alone"))  # one call
        await asyncio.gather(*(authority.cancel(sid, reason="barge_in") for sid in sessions))
        await asyncio.gather(
            *(authority.append(sid, "append_text", TextPayload("x")) for sid in sessions)
        )
        entries = [e for b in bus.keys.bells(worker_bell("echo", "w1"))
                   for e in await bus.xrange(b)]  # fmt: skip
        assert [sorted(rings_of(e.fields)) for e in entries] == [
            [(long_id, "d")],
            sorted((sid, "c") for sid in sessions),
            sorted((sid, "d") for sid in sessions),
        ]
    finally:
        await bus.aclose()


def test_a_ring_entry_reads_in_every_form():
    packed = msgspec.msgpack.encode
    assert rings_of({b"d": packed(["s1", "a b"]), b"c": packed(["s2"])}) == [
        ("s1", "d"), ("a b", "d"), ("s2", "c")
    ]  # fmt: skip
    assert rings_of({b"c": packed(["s2"])}) == [("s2", "c")]
    # As written before: a field per session, or one session and its kind.
    assert rings_of({b":a b": b"d", b":s": b"c"}) == [("a b", "d"), ("s", "c")]
    assert rings_of({b"s": b"s1", b"k": b"c"}) == [("s1", "c")]  # as written before
    assert rings_of({b"s": b"s1"}) == [("s1", "d")]


@pytest.mark.parametrize("together", [False, True], ids=["one by one", "together"])
async def test_a_stage_of_two_workers_answers_every_session_without_sweeps(
    redis_url, key_prefix, together
):
    """With sweeps ten minutes apart, every answer below comes from a ring reaching the
    worker that holds the session: a ring sent elsewhere would leave it unanswered.
    Appends sent together share a batch and its rings (one entry per bell)."""
    pipeline = echo_pipeline("echo")
    settings = fast_settings(redis_url, key_prefix, sweep_ms=600_000, worker_capacity=3)
    coordinator = Coordinator(settings, pipeline)
    sessions = [f"s{i}" for i in range(6)]
    try:
        async with (
            running_worker(settings, pipeline, "echo", worker_id="w1") as w1,
            running_worker(settings, pipeline, "echo", worker_id="w2") as w2,
        ):
            for sid in sessions:
                await coordinator.open(sid)
            for sid in sessions:  # each session's first input: taken, read once
                await coordinator.append(sid, "append_text", TextPayload("one"))
            await read_until(coordinator, lambda d: len(outputs_of(d)) >= len(sessions))
            assert len(w1.actors) == len(w2.actors) == 3
            for round_ in range(3):  # later inputs reach their holders by rings alone
                more = [(sid, "append_text", TextPayload(f"more {round_}")) for sid in sessions]
                if together:
                    await asyncio.gather(*(coordinator.append(*each) for each in more))
                else:
                    for each in more:
                        await coordinator.append(*each)
                got = await read_until(
                    coordinator, lambda d: len(outputs_of(d)) >= len(sessions), timeout=10
                )
                assert {o.fence.session_id for o in outputs_of(got)} == set(sessions)
    finally:
        await coordinator.aclose()


async def test_a_stopping_worker_deletes_its_bells_and_the_audit_those_of_the_dead(
    redis_url, key_prefix
):
    bus = RedisBus(redis_url, Keys(key_prefix))
    settings = fast_settings(redis_url, key_prefix)
    try:
        for worker in ("w1", "w2"):
            for bell in bus.keys.bells(worker_bell("echo", worker)):
                await bus.client.xadd(bell, {"s": "s1", "k": "d"})
        await withdraw(bus, "echo", "w1")  # w1 stops
        assert await stored_rings(bus, worker_bell("echo", "w1")) == []
        assert await stored_rings(bus, worker_bell("echo", "w2"))

        # w2 was killed: silent for longer than the audit waits, it is forgotten.
        long_ago = time.time() * 1000 - 3_600_000
        await bus.client.zadd(bus.keys.workers("echo"), {"w2": long_ago})
        state = ControlState(settings, PIPELINE, bus)
        assert await _forget_dead_workers(state, "echo", int(time.time() * 1000)) == 1
        assert await stored_rings(bus, worker_bell("echo", "w2")) == []
    finally:
        await bus.aclose()
