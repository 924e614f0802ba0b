"""A stage's new owner continues exactly where its predecessor stopped.

Each test hands a stage over at a chosen point (in-process workers on real
Redis), so the takeover happens at the same place every run.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.service import Coordinator
from schemas.config import PipelineConfig, StageConfig, echo_pipeline
from schemas.events import TextPayload
from tests.pipeline_helpers import collect, fast_settings, outputs_of, running_worker
from workers.backends.echo import EchoBackend

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix)


async def wait_progress(coordinator: Coordinator, sid: str, stage: str, applied: int) -> None:
    progress = coordinator.bus.keys.session(sid).meta
    async with asyncio.timeout(20):
        while int((await coordinator.bus.hmget(progress, [f"{stage}:applied"]))[0] or 0) < applied:
            await asyncio.sleep(0.02)


async def wait_owned(coordinator: Coordinator, sid: str, stage: str) -> None:
    key = coordinator.bus.keys.session(sid).lease(stage)
    async with asyncio.timeout(20):
        while not await coordinator.bus.client.exists(key):
            await asyncio.sleep(0.02)


async def test_downstream_failover_consumes_what_upstream_published_before_it(settings):
    """Cause: the new owner's view started at the new incarnation and dropped the
    upstream outputs written before the failover barrier as ``incarnation``."""
    pipeline = echo_pipeline("thinker", "talker")
    coordinator = Coordinator(settings, pipeline)
    try:
        await coordinator.open("s1")
        # A first talker owns the session, then goes (its hand-back makes the next
        # owner's acquire a failover: incarnation + 1, barrier in every stream).
        async with running_worker(settings, pipeline, "talker"):
            await wait_owned(coordinator, "s1", "talker")
        # The thinker publishes while no talker runs: its outputs precede the barrier.
        async with running_worker(settings, pipeline, "thinker"):
            for i in range(3):
                await coordinator.append("s1", "append_text", TextPayload(f"w{i}"))
            await wait_progress(coordinator, "s1", "thinker", 3)
        async with running_worker(settings, pipeline, "talker"):
            got = outputs_of(await collect(coordinator, 3))
        assert [(o.stage, o.text) for o in got] == [("talker", f"w{i}") for i in range(3)]
        assert got[-1].fence.incarnation == 1
        assert coordinator.reader.dropped.total() == 0
    finally:
        await coordinator.aclose()


class StallingEcho(EchoBackend):
    """Streams its answer in chunks and never gets past the second one: a worker that
    dies mid-answer, after two chunks reached the client."""

    def __init__(self) -> None:
        super().__init__({"chunks": 4})
        self.stuck = asyncio.Event()

    async def handle(self, ctx, event):
        count = 0
        async for draft in super().handle(ctx, event):
            if count == 2:
                self.stuck.set()
                await asyncio.Event().wait()
            count += 1
            yield draft


async def test_a_new_owner_does_not_publish_again_what_its_predecessor_streamed(settings):
    """Cause: chunks published before a crash (streamed without progress) were
    produced and delivered again by the new owner."""
    pipeline = PipelineConfig(
        name="stream", stages=(StageConfig(name="talker", to_client=True,
                                           options={"chunks": 4}),)
    )  # fmt: skip
    coordinator = Coordinator(settings, pipeline)
    try:
        await coordinator.open("s1")
        await coordinator.append("s1", "append_text", TextPayload("abcdefgh"))
        stalling = StallingEcho()
        async with running_worker(settings, pipeline, "talker", backend=stalling):
            await asyncio.wait_for(stalling.stuck.wait(), 20)
            first = outputs_of(await collect(coordinator, 2))
        # The first owner went mid-answer; the next one answers the same input.
        async with running_worker(settings, pipeline, "talker"):
            rest = outputs_of(await collect(coordinator, 2))
            late = outputs_of(await coordinator.outputs(block_ms=300))
        assert [o.text for o in first + rest + late] == ["ab", "cd", "ef", "gh"]
        assert rest[0].fence.incarnation == 1
    finally:
        await coordinator.aclose()


class BrokenStart(EchoBackend):
    """A backend that cannot rebuild this session's state, on any worker."""

    def __init__(self) -> None:
        super().__init__({})
        self.starts = 0

    async def start(self, ctx, inputs, outputs):
        self.starts += 1
        raise RuntimeError("cannot rebuild")


async def test_a_session_that_keeps_failing_is_quarantined_with_an_error(settings):
    """Cause: such a session moved between workers for ever, its client never told."""
    settings = settings.model_copy(update={"max_session_failures": 3})
    pipeline = echo_pipeline("echo")
    coordinator = Coordinator(settings, pipeline)
    broken = BrokenStart()
    try:
        await coordinator.open("s1")
        async with running_worker(settings, pipeline, "echo", backend=broken):
            got = await collect(coordinator, 1, timeout=30)
            async with asyncio.timeout(20):
                while (await coordinator.authority.status("s1"))["status"] != "closed":
                    await asyncio.sleep(0.05)
        (notice,) = outputs_of(got)
        assert '"code":"session_failed"' in notice.text
        assert broken.starts == 3
    finally:
        await coordinator.aclose()


class SlowStart(EchoBackend):
    """Rebuilding takes longer than the lease lasts."""

    def __init__(self, seconds: float) -> None:
        super().__init__({})
        self.seconds = seconds

    async def start(self, ctx, inputs, outputs):
        await asyncio.sleep(self.seconds)


async def test_the_lease_is_renewed_while_a_takeover_rebuilds(settings):
    """Cause: the lease was only renewed once the rebuild was done, so a long one let it
    expire and the session moved between workers."""
    pipeline = echo_pipeline("echo")
    coordinator = Coordinator(settings, pipeline)
    try:
        await coordinator.open("s1")
        slow = SlowStart(seconds=3 * settings.lease_ttl_ms / 1000)
        async with running_worker(settings, pipeline, "echo", backend=slow):
            await wait_owned(coordinator, "s1", "echo")  # taken; now rebuilding, slowly
            async with running_worker(settings, pipeline, "echo"):  # takes expired leases
                await coordinator.append("s1", "append_text", TextPayload("patience"))
                (answer,) = outputs_of(await collect(coordinator, 1, timeout=30))
        assert answer.text == "patience"
        assert answer.fence.incarnation == 0  # nobody else ever took the session
    finally:
        await coordinator.aclose()


async def test_an_undecodable_control_entry_is_logged_counted_and_skipped(settings, caplog):
    pipeline = echo_pipeline("echo")
    coordinator = Coordinator(settings, pipeline)
    bus = coordinator.bus
    try:
        await coordinator.open("s1")
        async with running_worker(settings, pipeline, "echo"):
            await wait_owned(coordinator, "s1", "echo")
            await bus.client.xadd(bus.keys.session("s1").control, {"c": b"\xc1not msgpack"})
            await coordinator.append("s1", "append_text", TextPayload("still served"))
            (answer,) = outputs_of(await collect(coordinator, 1))
            async with asyncio.timeout(10):
                while not await bus.client.hget(
                    bus.keys.metrics, "dropped:echo:undecodable_control"
                ):
                    await asyncio.sleep(0.05)
        assert answer.text == "still served"
        assert any("skipping control entry" in r.getMessage() for r in caplog.records)
    finally:
        await coordinator.aclose()


async def test_a_stage_whose_outputs_live_in_the_journal_rebuilds_from_its_own_there(
    redis_server, key_prefix
):
    """A client-facing stage that no stage reads keeps its outputs in the client journal
    only, beside other stages' outputs and the coordinator's notices: its takeover reads
    its own outputs back from there, and what it published for inputs not yet applied."""
    from dataplane.authority import SessionAuthority
    from dataplane.bus import RedisBus
    from schemas.events import OutputEvent, OutputKind
    from schemas.keys import Keys
    from workers.backends.base import ALL_HISTORY
    from workers.ownership import StageOwnership
    from workers.rebuild import load_takeover

    chain = echo_pipeline("thinker", "talker")
    thinker, talker = chain.stages
    pipeline = chain.model_copy(
        update={"stages": (thinker.model_copy(update={"to_client": True}), talker)}
    )
    assert pipeline.outputs_in_journal("talker") and not pipeline.outputs_in_journal("thinker")
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        authority = SessionAuthority(bus, pipeline)
        await authority.open("s1")
        owners = {
            name: StageOwnership(bus, pipeline, name, "w1", 5000) for name in ("thinker", "talker")
        }
        leases = {name: (await o.acquire("s1", 0))[1] for name, o in owners.items()}

        async def publish(stage: str, seq: int, source: int, applied: int) -> None:
            lease = leases[stage]
            assert lease is not None
            out = OutputEvent(
                lease.fence, stage, OutputKind.TEXT_DELTA, seq, source, text=f"{stage}{seq}"
            )
            result = await owners[stage].publish(
                lease, [(lease.fence, [out])], applied_seq=applied, read_id="0-1", out_seq=seq
            )
            assert result.status == "ok"

        await publish("thinker", 1, 1, 1)
        await publish("talker", 1, 1, 1)
        await authority.journal("s1", {"type": "note"})
        await publish("thinker", 2, 2, 2)
        await publish("talker", 2, 2, 1)  # streamed for input 2, not yet applied
        await publish("talker", 3, 2, 1)
        sk = bus.keys.session("s1")
        assert await bus.xlen(sk.stage_out("talker")) == 0  # stored once, in the journal
        takeover = await load_takeover(
            bus, sk.stage_out("thinker"), sk.client, read_id="0-0", applied_seq=1,
            window=ALL_HISTORY, stage="talker",
        )  # fmt: skip
        assert [o.text for o in takeover.outputs] == ["talker1", "talker2", "talker3"]
        assert takeover.published == {2: 2}
    finally:
        await bus.aclose()


async def test_a_stage_whose_progress_is_in_the_old_progress_hash_resumes_where_it_was(
    redis_server, key_prefix
):
    """Sessions opened before a stage's progress moved into the meta hash keep it in the
    prog hash: the stage's next acquire takes it from there (and moves it), so nothing
    applied is applied again after an upgrade."""
    from dataplane.authority import SessionAuthority
    from dataplane.bus import RedisBus
    from schemas.keys import Keys
    from workers.ownership import StageOwnership

    pipeline = echo_pipeline("echo")
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        await SessionAuthority(bus, pipeline).open("s1")
        sk = bus.keys.session("s1")
        old = {"echo:applied": 7, "echo:read": "5-1", "echo:oseq": 9, "echo:owners": 1}
        await bus.client.hset(sk.progress, mapping=old)
        owner = StageOwnership(bus, pipeline, "echo", "w1", 5000)
        _, lease = await owner.acquire("s1", 0)
        assert lease is not None
        assert (lease.applied_seq, lease.read_id, lease.out_seq) == (7, "5-1", 9)
        assert lease.failover and lease.fence.incarnation == 1  # it had an owner before
        moved = await bus.hmget(sk.meta, list(old))
        assert moved == [b"7", b"5-1", b"9", b"2"]  # and one owner more
    finally:
        await bus.aclose()
