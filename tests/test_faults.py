"""Fault injection with real worker processes: kill -9, a zombie, many workers."""

import asyncio
import contextlib
import signal

import pytest

from coordinator.output_reader import Delivery
from coordinator.service import Coordinator
from schemas.config import PipelineConfig, StageConfig, echo_pipeline
from schemas.events import ControlEvent, ControlKind, OutputEvent, TextPayload
from tests.pipeline_helpers import collect, fast_settings, outputs_of
from tests.processes import WorkerProcess, wait_for_file, write_pipeline


@pytest.fixture
def settings(redis_url, key_prefix):
    """Every test here runs on one Redis and on a Redis Cluster."""
    return fast_settings(redis_url, key_prefix)


@contextlib.contextmanager
def workers(*procs: WorkerProcess):
    try:
        for proc in procs:
            proc.start()
        yield procs
    finally:
        for proc in procs:
            proc.terminate()


async def holder(coordinator: Coordinator, session_id: str, stage: str) -> str | None:
    raw = await coordinator.bus.client.get(coordinator.bus.keys.session(session_id).lease(stage))
    return raw.decode().split()[0] if raw else None


async def eventually(check, timeout: float = 20.0, step: float = 0.05):
    async with asyncio.timeout(timeout):
        while not (result := await check()):
            await asyncio.sleep(step)
    return result


def capped(pipeline: PipelineConfig, capacity: int) -> PipelineConfig:
    stages = tuple(s.model_copy(update={"capacity": capacity}) for s in pipeline.stages)
    return pipeline.model_copy(update={"stages": stages})


@pytest.mark.parametrize("n_workers", [2, 4])
async def test_order_and_exactly_once_across_worker_processes(settings, tmp_path, n_workers):
    sessions, per_session = 8, 30
    pipeline = capped(echo_pipeline("echo"), capacity=sessions // n_workers)
    path = write_pipeline(tmp_path, pipeline)
    coordinator = Coordinator(settings, pipeline)
    procs = [WorkerProcess(settings, path, "echo", f"w{i}", tmp_path) for i in range(n_workers)]
    try:
        with workers(*procs):
            ids = [f"s{i}" for i in range(sessions)]
            for sid in ids:
                await coordinator.open(sid)
            for n in range(per_session):
                for sid in ids:
                    await coordinator.append(sid, "append_text", TextPayload(f"{sid}-{n}"))
            got = outputs_of(await collect(coordinator, sessions * per_session, timeout=60))
            owners = {await holder(coordinator, sid, "echo") for sid in ids}
        for sid in ids:
            mine = [o for o in got if o.fence.session_id == sid]
            assert [o.source_seq for o in mine] == list(range(1, per_session + 1))
            assert [o.text for o in mine] == [f"{sid}-{n}" for n in range(per_session)]
        # Capacity forces the sessions to spread over every worker.
        assert owners == {f"w{i}" for i in range(n_workers)}
    finally:
        await coordinator.aclose()


def _after_failover(deliveries: list[Delivery]) -> list[OutputEvent]:
    seen_barrier = False
    late: list[OutputEvent] = []
    for d in deliveries:
        if isinstance(d.event, ControlEvent) and d.event.kind is ControlKind.FAILOVER:
            seen_barrier = True
        elif seen_barrier and isinstance(d.event, OutputEvent):
            late.append(d.event)
    assert seen_barrier, "no failover barrier reached the client journal"
    return late


@pytest.mark.parametrize("point", ["after_read", "before_publish", "after_publish"])
async def test_kill_9_mid_turn_hands_the_session_over(settings, tmp_path, point):
    pipeline = echo_pipeline("echo")
    path = write_pipeline(tmp_path, pipeline)
    marker = tmp_path / "marker"
    env = {"DUPLEXQ_FAILPOINT": f"{point}:5", "DUPLEXQ_FAILPOINT_MARKER": str(marker)}
    first = WorkerProcess(settings, path, "echo", "first", tmp_path, env=env)
    second = WorkerProcess(settings, path, "echo", "second", tmp_path)
    coordinator = Coordinator(settings, pipeline)
    try:
        with workers(first):
            await coordinator.open("s1")
            await eventually(lambda: holder(coordinator, "s1", "echo"))
            with workers(second):
                for n in range(10):
                    await coordinator.append("s1", "append_text", TextPayload(f"m{n}"))
                await asyncio.to_thread(wait_for_file, marker)
                first.kill()
                for n in range(10, 15):
                    await coordinator.append("s1", "append_text", TextPayload(f"m{n}"))
                deliveries = await collect(coordinator, 15, timeout=30)
                assert await holder(coordinator, "s1", "echo") == "second"
        got = outputs_of(deliveries)
        assert sorted(o.source_seq for o in got) == list(range(1, 16))
        assert [o.text for o in got] == [f"m{n}" for n in range(15)]
        assert all(o.fence.incarnation == 1 for o in _after_failover(deliveries))
    finally:
        await coordinator.aclose()


async def test_zombie_publishes_nothing_that_is_delivered(settings, tmp_path):
    pipeline = echo_pipeline("echo")
    path = write_pipeline(tmp_path, pipeline)
    marker = tmp_path / "marker"
    env = {"DUPLEXQ_FAILPOINT": "before_publish:3:1.5", "DUPLEXQ_FAILPOINT_MARKER": str(marker)}
    zombie = WorkerProcess(settings, path, "echo", "zombie", tmp_path, env=env)
    heir = WorkerProcess(settings, path, "echo", "heir", tmp_path)
    coordinator = Coordinator(settings, pipeline)
    metrics = coordinator.bus.keys.metrics
    try:
        with workers(zombie):
            await coordinator.open("s1")
            await eventually(lambda: holder(coordinator, "s1", "echo"))
            for n in range(3):
                await coordinator.append("s1", "append_text", TextPayload(f"m{n}"))
            await asyncio.to_thread(wait_for_file, marker)
            zombie.signal(signal.SIGSTOP)
            with workers(heir):
                await eventually(lambda: _is(holder(coordinator, "s1", "echo"), "heir"))
                deliveries = await collect(coordinator, 3, timeout=30)
                zombie.signal(signal.SIGCONT)
                dropped = await eventually(
                    lambda: coordinator.bus.client.hget(metrics, "dropped:echo:zombie")
                )
                for n in range(3, 6):
                    await coordinator.append("s1", "append_text", TextPayload(f"m{n}"))
                deliveries += await collect(coordinator, 3, timeout=30)
        assert int(dropped) >= 1
        got = outputs_of(deliveries)
        assert [o.text for o in got] == [f"m{n}" for n in range(6)]
        assert all(o.fence.incarnation == 1 for o in _after_failover(deliveries))
        # The journal itself holds nothing of the zombie's after the barrier.
        sk = coordinator.bus.keys.session("s1")
        entries = await coordinator.bus.xrange(sk.client)
        assert sum(b"e" in e.fields for e in entries) == 6
    finally:
        await coordinator.aclose()


async def _is(value_coro, expected):
    return (await value_coro) == expected


def test_stage_config_capacity_bounds():
    with pytest.raises(ValueError):
        StageConfig(name="x", capacity=0)


async def test_sigterm_hands_sessions_back_at_once(redis_server, key_prefix, tmp_path):
    # A lease TTL far longer than the test: only a hand-back can move the session.
    settings = fast_settings(redis_server.url, key_prefix, lease_ttl_ms=120_000)
    pipeline = echo_pipeline("echo")
    path = write_pipeline(tmp_path, pipeline)
    leaving = WorkerProcess(settings, path, "echo", "leaving", tmp_path)
    staying = WorkerProcess(settings, path, "echo", "staying", tmp_path)
    coordinator = Coordinator(settings, pipeline)
    try:
        with workers(leaving):
            await coordinator.open("s1")
            await coordinator.append("s1", "append_text", TextPayload("before"))
            await collect(coordinator, 1)
            assert await holder(coordinator, "s1", "echo") == "leaving"
            assert leaving.terminate() == 0
            assert await holder(coordinator, "s1", "echo") is None
        with workers(staying):
            await coordinator.append("s1", "append_text", TextPayload("after"))
            got = outputs_of(await collect(coordinator, 1))
            assert await holder(coordinator, "s1", "echo") == "staying"
        assert [o.text for o in got] == ["after"]
        assert got[0].fence.incarnation == 1
    finally:
        await coordinator.aclose()
