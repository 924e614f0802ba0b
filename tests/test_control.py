"""The control plane: its pure decisions, and its jobs on a real redis-server."""

import argparse
import asyncio
import contextlib
import time

import pytest
from redis.asyncio import Redis

from coordinator.controlplane.control import (
    FORGET_WORKERS_AFTER_MS,
    audit_leases,
    close_context,
    expire_closed,
    job_deserializer,
    job_serializer,
    open_context,
    queue_name,
    run_control,
    trim_streams,
    worker_settings,
)
from coordinator.controlplane.control_core import (
    FORGET_GRACE_MS,
    AuditPlan,
    ControlSchedule,
    RequeueBackoff,
    floor_in_page,
    group_floor,
    parse_id,
    plan_audit,
    safe_min_id,
    session_of_key,
    stream_consumers,
)
from coordinator.launcher.control_cli import add_commands
from coordinator.service import Coordinator
from dataplane.authority import SessionAuthority
from dataplane.readiness import StageModel
from schemas.config import PipelineConfig, Settings, StageConfig, echo_pipeline
from schemas.events import ControlKind, TextPayload, decode_control, decode_input
from schemas.keys import ASSIGN_GROUP, Keys
from tests.pipeline_helpers import collect, fast_settings, outputs_of, running_worker
from tests.redis_server import RedisServer

ECHO = echo_pipeline("echo")

# -- pure decisions ----------------------------------------------------------------------


def test_stream_ids_compare_as_numbers_not_strings():
    ids = ["10-0", "9-5", "9-10", "0-0", "5"]
    assert sorted(ids, key=parse_id) == ["0-0", "5", "9-5", "9-10", "10-0"]


@pytest.mark.parametrize(
    ("reads", "floor", "expected"),
    [
        ([None], "7-0", None),  # a consumer never read: nothing may go
        (["5-0", None], "7-0", None),
        (["5-0"], None, None),  # within retention
        ([], "7-0", "7-0"),  # nobody reads it: retention alone
        (["5-0"], "7-0", "5-0"),  # consumer behind the retention floor
        (["9-0"], "7-0", "7-0"),  # retention keeps more than the consumer needs
        (["10-0", "9-5"], "9-10", "9-5"),  # the slowest consumer wins, numerically
        (["3-0", "8-0"], "5-0", "3-0"),
        (["0-0"], "3-0", None),
    ],
)
def test_safe_min_id(reads, floor, expected):
    assert safe_min_id(reads, floor) == expected


@pytest.mark.parametrize(
    ("to_skip", "stop_at", "expected"),
    [
        (2, None, ("3-0", 2)),
        (0, None, ("1-0", 0)),
        (10, None, (None, 4)),  # keep walking on the next page
        (10, "2-0", ("2-0", 1)),  # a consumer's position comes first
        (10, "2-5", ("3-0", 2)),  # a position between entries
        (1, "3-0", ("2-0", 1)),  # the retention floor comes first
        (10, "99-0", (None, 4)),
    ],
)
def test_floor_in_page(to_skip, stop_at, expected):
    assert floor_in_page(["1-0", "2-0", "3-0", "4-0"], to_skip, stop_at) == expected


def test_stream_consumers_follow_the_pipeline_graph():
    assert stream_consumers(echo_pipeline("a", "b")) == {"session": ("a",), "a": ("b",), "b": ()}
    fan_out = PipelineConfig(stages=(StageConfig(name="a"), StageConfig(name="b", to_client=True)))
    assert stream_consumers(fan_out) == {"session": ("a", "b"), "a": (), "b": ()}


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ([], None),
        ([("w", "0-0", None)], None),
        ([("w", "5-0", None)], "5-0"),
        ([("w", "5-0", "3-0")], "3-0"),  # pending entries stay claimable
        ([("w", "5-0", None), ("x", "4-1", None)], "4-1"),
    ],
)
def test_group_floor(groups, expected):
    assert group_floor(groups) == expected


def test_plan_audit():
    leased = {"a": True, "b": False}
    assert plan_audit("open", leased, 0) == AuditPlan(requeue=("b",))
    assert plan_audit("open", {"a": True}, 0) == AuditPlan()
    assert plan_audit("closed", leased, 0) == AuditPlan(forget=True)
    # No meta yet: it may be being opened right now, unless it has been a while.
    assert plan_audit(None, leased, 10) == AuditPlan()
    assert plan_audit(None, leased, FORGET_GRACE_MS) == AuditPlan(forget=True)


def test_session_of_key():
    keys = Keys("dq")
    for sid in ("s1", "a}:b", "x:st:y", "q:lease:r:meta"):
        sk = keys.session(sid)
        for key in (sk.meta, sk.input, sk.client, sk.stage_out("x"), sk.lease("y")):
            assert session_of_key("dq", key) == sid
    assert session_of_key("dq", "dq:assign:x") is None
    assert session_of_key("dq", keys.bells("x")[0]) is None
    assert session_of_key("dq", Keys("dq", cluster=True).bells("x")[3]) is None
    assert session_of_key("dq", "dqx:{p1}:s1:meta") is None
    assert session_of_key("dq", "dq:{p1}:s1:other") is None


def test_requeue_backoff_doubles_and_resets():
    backoff = RequeueBackoff(1000, 4000)
    key = ("s1", "a")
    assert backoff.take(key, 0)
    assert not backoff.take(key, 999)
    assert backoff.take(key, 1000)  # gap 1000 -> 2000
    assert not backoff.take(key, 2999)
    assert backoff.take(key, 3000)  # -> 4000 (cap)
    assert not backoff.take(key, 6999)
    assert backoff.take(key, 7000)
    assert not backoff.take(key, 10_999)  # capped at 4000
    assert backoff.take(("s1", "b"), 7000)  # per stage
    backoff.clear("s1", "a")
    assert backoff.take(key, 7001)
    backoff.clear("s1")
    assert backoff.take(key, 7002) and backoff.take(("s1", "b"), 7002)


def test_schedule_seconds():
    schedule = ControlSchedule()
    assert schedule.seconds(2) == set(range(0, 60, 2))
    assert schedule.seconds(60) == {0}
    with pytest.raises(ValueError, match=r"1\.\.60"):
        schedule.seconds(0)


def test_jobs_are_msgpack_not_pickle():
    data = {"t": 1, "f": "replay", "a": ("s", "t"), "k": {}, "et": 5, "r": ValueError("boom")}
    raw = job_serializer(data)
    assert b"pickle" not in raw and not raw.startswith(b"\x80")
    back = job_deserializer(raw)
    assert back["a"] == ["s", "t"] and back["r"] == "ValueError: boom"
    with pytest.raises(ValueError, match="map"):
        job_deserializer(job_serializer([1]))  # type: ignore[arg-type]


def test_worker_settings_keep_deployments_apart():
    settings = fast_settings("redis://127.0.0.1:1/0", "pfx")
    cls = worker_settings(settings, ECHO)
    assert cls.queue_name == queue_name(settings) == "pfx:arq:queue"
    assert {cron.name for cron in cls.cron_jobs} == {
        "pfx:audit_leases",
        "pfx:trim_streams",
        "pfx:expire_closed",
    }
    assert {f.name for f in cls.functions} >= {"audit_leases", "replay"}
    assert worker_settings(settings, ECHO, burst=True).cron_jobs == []


def test_control_command_is_registered():
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["control", "--burst", "--redis-url", "redis://x"])
    assert args.burst and args.redis_url == "redis://x" and callable(args.func)


# -- jobs on Redis -------------------------------------------------------------------------


@pytest.fixture
def settings(redis_url, redis_server, key_prefix):
    """The jobs run on one Redis and on a Redis Cluster data plane (whose job queue then
    lives on a plain Redis, as arq needs)."""
    queue = redis_server.url if redis_url.startswith("redis+cluster") else ""
    return fast_settings(
        redis_url, key_prefix, input_retention=100, output_retention=100, closed_ttl_s=100,
        control_redis_url=queue,
    )  # fmt: skip


@pytest.fixture
async def coordinator(settings):
    coordinator = Coordinator(settings, ECHO)
    yield coordinator
    await coordinator.aclose()


@pytest.fixture
async def ctx(settings):
    ctx = await open_context(settings, ECHO)
    yield ctx
    await close_context(ctx)


async def _append(coordinator, session_id, texts):
    for text in texts:
        await coordinator.append(session_id, "append_text", TextPayload(text))


async def _keys(bus, session_id):
    """Every key of a session (SCAN visits every primary of a cluster)."""
    pattern = f"{bus.keys.session(session_id).tag}:*"
    return [key async for key in bus.client.scan_iter(match=pattern)]


async def _seqs(bus, stream):
    return [decode_input(e.event).seq for e in await bus.xrange(stream)]


async def test_trim_keeps_an_unread_backlog_and_trims_after_catch_up(settings, coordinator, ctx):
    bus, sk = coordinator.bus, coordinator.bus.keys.session("s1")
    await coordinator.open("s1")
    texts = [f"m{i}" for i in range(250)]
    await _append(coordinator, "s1", texts)
    await trim_streams(ctx)
    assert await bus.xlen(sk.input) == 250  # no worker has read anything yet
    async with running_worker(settings, ECHO, "echo"):
        got = outputs_of(await collect(coordinator, 250))
        assert [o.text for o in got] == texts
        result = await trim_streams(ctx)
        assert await _seqs(bus, sk.input) == list(range(151, 251))
        # The echo stage is client-facing and no stage reads it: its outputs are kept
        # in the journal only.
        assert await bus.xlen(sk.stage_out("echo")) == 0
        kept = await bus.xlen(sk.client)
        assert 100 <= kept < 250  # MAXLEN ~ drops whole nodes
        assert result["removed"] == 150 + (250 - kept)
        # The trimmed session carries on.
        await _append(coordinator, "s1", ["after"])
        assert [o.text for o in outputs_of(await collect(coordinator, 1))] == ["after"]


async def test_trim_stops_at_the_slowest_consumer(settings, coordinator, ctx):
    bus, sk = coordinator.bus, coordinator.bus.keys.session("s1")
    await coordinator.open("s1")
    await _append(coordinator, "s1", [f"m{i}" for i in range(250)])
    ids = [e.id for e in await bus.xrange(sk.input)]
    await bus.client.hset(sk.meta, "echo:read", ids[49])
    await trim_streams(ctx)
    assert [e.id for e in await bus.xrange(sk.input)] == ids[49:]


async def test_trim_waits_for_every_consumer_of_a_stream(settings, ctx):
    fan_out = PipelineConfig(stages=(StageConfig(name="a"), StageConfig(name="b", to_client=True)))
    fan_ctx = await open_context(settings, fan_out)
    coordinator = Coordinator(settings, fan_out)
    try:
        sk = coordinator.bus.keys.session("s1")
        await coordinator.open("s1")
        await _append(coordinator, "s1", [f"m{i}" for i in range(250)])
        last = await coordinator.bus.last_id(sk.input)
        await coordinator.bus.client.hset(sk.meta, "a:read", last)
        await trim_streams(fan_ctx)
        assert await coordinator.bus.xlen(sk.input) == 250  # b has read nothing
        await coordinator.bus.client.hset(sk.meta, "b:read", last)
        await trim_streams(fan_ctx)
        assert await coordinator.bus.xlen(sk.input) == 100
    finally:
        await close_context(fan_ctx)
        await coordinator.aclose()


async def test_trim_never_breaks_a_stage_whose_reader_is_down(settings):
    chain = echo_pipeline("thinker", "talker")
    chain_ctx = await open_context(settings, chain)
    coordinator = Coordinator(settings, chain)
    bus, sk = coordinator.bus, coordinator.bus.keys.session("s1")
    texts = [f"w{i}" for i in range(250)]
    try:
        await coordinator.open("s1")
        await _append(coordinator, "s1", texts)
        async with running_worker(settings, chain, "thinker"), asyncio.timeout(20):
            while await bus.client.hget(sk.meta, "thinker:applied") != b"250":
                await asyncio.sleep(0.05)
        await trim_streams(chain_ctx)
        assert await bus.xlen(sk.input) == 100
        assert await bus.xlen(sk.stage_out("thinker")) == 250  # the talker never read it
        async with running_worker(settings, chain, "talker"):
            got = outputs_of(await collect(coordinator, 250))
            assert [(o.stage, o.text) for o in got] == [("talker", t) for t in texts]
            await trim_streams(chain_ctx)
            assert await bus.xlen(sk.stage_out("thinker")) == 100
    finally:
        await close_context(chain_ctx)
        await coordinator.aclose()


async def test_trim_assignment_streams_up_to_what_was_acked(settings, coordinator, ctx):
    bus = coordinator.bus
    stream = bus.keys.assign("echo")
    for sid in ("s1", "s2", "s3"):
        await coordinator.open(sid)
    await trim_streams(ctx)
    assert await bus.xlen(stream) == 3  # no group has read them yet
    async with running_worker(settings, ECHO, "echo") as worker, asyncio.timeout(20):
        while len(worker.actors) < 3:
            await asyncio.sleep(0.05)
        await trim_streams(ctx)
        assert await bus.xlen(stream) == 1  # the last delivered entry stays
        groups = await bus.client.xinfo_groups(stream)
        assert [g["lag"] for g in groups if g["name"] == ASSIGN_GROUP.encode()] == [0]


async def _crash(worker):
    """Stop ``worker`` without handing anything back, and lose its lease and index entry
    (what an expired lease whose orphan signal went missing looks like)."""

    async def no_release(lease, *, hand_back):
        return None

    worker.ownership.release = no_release
    worker.request_stop()


async def _lose_lease(bus, session_id, stage="echo"):
    await bus.client.delete(bus.keys.session(session_id).lease(stage))
    await bus.client.zrem(bus.keys.lease_index(stage), session_id)


async def _failovers(bus, session_id):
    entries = await bus.xrange(bus.keys.session(session_id).control)
    kinds = [decode_control(e.fields[b"c"]).kind for e in entries]
    return kinds.count(ControlKind.FAILOVER)


async def test_audit_hands_a_dead_workers_session_to_another(settings, coordinator, ctx):
    bus = coordinator.bus
    await coordinator.open("s1")
    await _append(coordinator, "s1", [f"m{i}" for i in range(5)])
    async with running_worker(settings, ECHO, "echo", worker_id="a") as a:
        await collect(coordinator, 5)
        await _crash(a)
    await _lose_lease(bus, "s1")
    await _append(coordinator, "s1", ["m5", "m6", "m7"])
    result = await audit_leases(ctx)
    # No live worker: the lease index is what a starting worker will find.
    assert result.get("orphans") == 1 and result.get("requeued", 0) == 0
    async with running_worker(settings, ECHO, "echo", worker_id="b"):
        got = outputs_of(await collect(coordinator, 3))
    assert [o.text for o in got] == ["m5", "m6", "m7"]
    assert {o.fence.incarnation for o in got} == {1}
    assert (await coordinator.authority.current("s1")).incarnation == 1
    journal = [e for e in await bus.xrange(bus.keys.session("s1").client) if b"e" in e.fields]
    assert len(journal) == 8  # nothing applied twice
    assert await _failovers(bus, "s1") == 1


async def test_racing_audits_cause_one_takeover(settings, coordinator, ctx):
    bus = coordinator.bus
    await coordinator.open("s1")
    await _append(coordinator, "s1", ["m0"])
    async with running_worker(settings, ECHO, "echo", worker_id="a") as a:
        await collect(coordinator, 1)
        await _crash(a)
    await _lose_lease(bus, "s1")
    other = await open_context(settings, ECHO)
    try:
        # Both audits must read the session as unleased: with b and c already taking
        # assignments, the first offer can be taken before the second audit reads the
        # lease, and then only one audit offers (right, but not the race under test).
        # So the audits see b and c registered as live, as their heartbeats would
        # write, and the workers start with both offers waiting for them.
        live = dict.fromkeys(("b", "c"), int(time.time() * 1000))
        await bus.client.zadd(bus.keys.workers("echo"), live)
        results = await asyncio.gather(audit_leases(ctx), audit_leases(other))
        assert [r.get("requeued") for r in results] == [1, 1]  # two detectors, two offers
        # b and c hold leases as shipped (TTL 3 s, renewed every 750 ms): they share this
        # test's event loop with the coordinator, and under a loaded machine the fast
        # settings' 1 s TTL lapsed between two renewals, a second takeover that is not
        # the race under test (nothing here waits for a lease to expire).
        shipped = {k: Settings.model_fields[k].default for k in ("lease_ttl_ms", "heartbeat_ms")}
        leases = settings.model_copy(update=shipped)
        async with (
            running_worker(leases, ECHO, "echo", worker_id="b") as b,
            running_worker(leases, ECHO, "echo", worker_id="c") as c,
        ):
            await _append(coordinator, "s1", ["m1", "m2"])
            got = outputs_of(await collect(coordinator, 2))
            assert [o.text for o in got] == ["m1", "m2"]
            assert ("s1" in b.actors) != ("s1" in c.actors)
            # Checked before the workers stop: a graceful hand-back is a takeover too.
            assert (await coordinator.authority.current("s1")).incarnation == 1
            assert await _failovers(bus, "s1") == 1
            assert await bus.client.hget(bus.keys.metrics, "failovers:echo") == b"1"
    finally:
        await close_context(other)


async def test_audit_forgets_closed_and_vanished_sessions(settings, coordinator, ctx):
    bus = coordinator.bus
    for sid in ("open1", "closed1"):
        await coordinator.open(sid)
    await coordinator.close("closed1")
    now = int(time.time() * 1000)
    await bus.client.zadd(bus.keys.sessions, {"closed1": now, "ghost": now - FORGET_GRACE_MS})
    await bus.client.zadd(bus.keys.sessions, {"opening": now})
    result = await audit_leases(ctx)
    assert result["forgotten"] == 2
    members = {m.decode() for m in await bus.client.zrange(bus.keys.sessions, 0, -1)}
    assert members == {"open1", "opening"}
    # open1 has no lease: it is in the lease index, expired, for any worker's orphan scan.
    score = await bus.client.zscore(bus.keys.lease_index("echo"), "open1")
    assert score is not None and score <= time.time() * 1000
    assert await bus.xlen(bus.keys.assign("echo")) == 2  # only the opens: no worker is alive


async def test_expire_closed_is_a_safety_net(settings, coordinator, ctx):
    bus, client = coordinator.bus, coordinator.bus.client
    await coordinator.open("live")
    await coordinator.open("done")
    await _append(coordinator, "live", ["x"])
    await _append(coordinator, "done", ["y"])
    await coordinator.close("done")
    done_keys = await _keys(bus, "done")
    assert len(done_keys) >= 4
    for key in done_keys:
        await client.persist(key)  # the close's EXPIRE got lost
    kept = bus.keys.session("done").input
    await client.expire(kept, 5000)  # a TTL already set is left alone
    await client.zadd(bus.keys.sessions, {"done": 1})
    leftover = bus.keys.session("leftover").input
    await client.xadd(leftover, {"e": b"x"})  # no meta at all
    result = await expire_closed(ctx)
    assert result["forgotten"] == 1
    assert result["keys_expired"] == len(done_keys)  # all but one, plus the leftover
    for key in done_keys:
        ttl = await client.ttl(key)
        assert (ttl > 100) if key.decode() == kept else (0 < ttl <= 100)
    assert 0 < await client.ttl(leftover) <= 100
    for key in await _keys(bus, "live"):
        assert await client.ttl(key) == -1
    assert await client.zscore(bus.keys.sessions, "done") is None
    assert await client.zscore(bus.keys.sessions, "live") is not None


async def test_burst_runs_each_periodic_job_once(settings, coordinator):
    bus = coordinator.bus
    await coordinator.open("s1")
    await coordinator.close("s1")
    keys = await _keys(bus, "s1")
    assert keys
    for key in keys:
        await bus.client.persist(key)
    worker = await run_control(settings, ECHO, burst=True, handle_signals=False)
    assert (worker.jobs_complete, worker.jobs_failed) == (3, 0)
    assert all([await bus.client.ttl(key) > 0 for key in keys])
    queue = Redis.from_url(settings.queue_redis_url)
    assert await queue.zcard(queue_name(settings)) == 0
    await queue.aclose()
    assert (await SessionAuthority(bus, ECHO).status("s1"))["status"] == "closed"


async def test_the_control_plane_outlives_a_redis_restart(tmp_path):
    """Cause: arq's worker ends on its first connection error, and so did the control
    plane, for good."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    settings = fast_settings(server.url, "cp", lease_ttl_ms=1000)
    schedule = ControlSchedule(audit_every_s=1)
    control = asyncio.create_task(run_control(settings, ECHO, handle_signals=False,
                                              schedule=schedule))  # fmt: skip
    coordinator = Coordinator(settings, ECHO)
    try:
        await asyncio.sleep(1.5)
        await asyncio.to_thread(server.restart)  # kill -9, then start on its AOF
        await asyncio.sleep(1)
        assert not control.done(), control
        # The restarted control plane still does its work: an unowned session is
        # put in the lease index by the next audit.
        await coordinator.open("orphan")
        index = coordinator.bus.keys.lease_index("echo")
        async with asyncio.timeout(20):
            while await coordinator.bus.client.zscore(index, "orphan") is None:
                await asyncio.sleep(0.1)
    finally:
        control.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await control
        await coordinator.aclose()
        server.stop()


async def test_time_retention_trims_old_entries_but_never_unapplied_ones(settings):
    settings = settings.model_copy(update={"retention_s": 1})
    coordinator = Coordinator(settings, ECHO)
    ctx = await open_context(settings, ECHO)
    bus, sk = coordinator.bus, coordinator.bus.keys.session("s1")
    try:
        await coordinator.open("s1")
        await _append(coordinator, "s1", ["old1", "old2"])
        await asyncio.sleep(1.2)
        await trim_streams(ctx)
        assert await bus.xlen(sk.input) == 2  # old, but no worker applied them yet
        async with running_worker(settings, ECHO, "echo"):
            await collect(coordinator, 2)
            await asyncio.sleep(1.2)  # their answers grow old too
            await _append(coordinator, "s1", ["new"])
            await collect(coordinator, 1)
            await trim_streams(ctx)
        # Within the counts (100) but older than a second: gone, from every stream.
        assert await _seqs(bus, sk.input) == [3]
        journal = [e for e in await bus.xrange(sk.client) if b"e" in e.fields]
        assert len(journal) == 1
    finally:
        await close_context(ctx)
        await coordinator.aclose()


async def test_audit_forgets_workers_long_dead_and_their_model_records(coordinator, ctx):
    bus = coordinator.bus
    now = int(time.time() * 1000)
    workers, models = bus.keys.workers("echo"), bus.keys.stage_models("echo")
    await bus.client.zadd(workers, {"killed": now - FORGET_WORKERS_AFTER_MS - 1000, "live": now})
    await bus.hset(models, {"killed": StageModel("m").to_json(), "live": StageModel("m").to_json()})
    result = await audit_leases(ctx)
    assert result.get("workers_forgotten") == 1
    assert [w.decode() for w in await bus.client.zrange(workers, 0, -1)] == ["live"]
    assert set(await bus.hgetall(models)) == {"live"}
    assert "workers_forgotten" not in await audit_leases(ctx)  # nothing more to forget


@pytest.mark.parametrize("after_s", [0.5, 4.0], ids=["starting", "restarting"])
def test_the_control_plane_stops_on_sigterm_while_redis_refuses_its_writes(tmp_path, after_s):
    """A full Redis (noeviction) refuses the job queue's writes, so arq's worker fails
    at once and is started again and again; SIGTERM still stops the process promptly,
    whether it comes while a worker starts or between two of them."""
    import os
    import signal
    import subprocess
    import sys

    import redis

    from tests.processes import ROOT
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis", appendonly=False, extra=["--maxmemory", "2mb"])
    server.start()
    try:
        with redis.Redis(port=server.port) as client, contextlib.suppress(redis.OutOfMemoryError):
            for i in range(10_000):
                client.set(f"filler:{i}", b"x" * 10_000)
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.launcher.cli", "control"],
            cwd=ROOT,
            # This Redis runs without AOF (a full Redis is the point here, not what it
            # keeps): relaxed, or the control plane would refuse it at start.
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "DUPLEXQ_REDIS_URL": server.url,
                "DUPLEXQ_REDIS_DURABILITY": "relaxed",
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(after_s)
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if after_s > 2:
            assert "restarting" in err  # it was failing over and over, as Redis is full
    finally:
        server.stop()
