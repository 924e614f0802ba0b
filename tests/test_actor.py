"""One session actor on real Redis, driven step by step.

These tests place a control event at an exact point of the actor's work by
the event loop's own ordering (a task created now takes its first step after
the tasks already ready), so each reproduces its race every time.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas.events import OutputKind, TextPayload
from tests.actor_helpers import STAGE, StreamingEcho, cancel_of, owned_actor, text_input


async def test_a_cancel_before_the_producer_ran_does_not_wedge_the_actor(redis_server, key_prefix):
    async with owned_actor(redis_server, key_prefix) as actor:
        handling = asyncio.create_task(actor._handle(text_input(actor, 1, "hello")))
        # One yield: ``handling`` creates the producer task and waits on its drafts;
        # we run next, before the producer's first step, and cancel it there.
        await asyncio.sleep(0)
        assert actor._producer is not None and not actor._producer.done()
        await actor.on_control(cancel_of(actor))
        # The relay must see the producer end although its body never ran.
        await asyncio.wait_for(handling, 5)
        assert actor._producer is None and actor.active
        # The actor goes on serving the next event of the new epoch.
        await actor._handle(text_input(actor, 2, "again"))
        assert [e.kind for e in actor._pending] == [OutputKind.TEXT_DELTA]
        assert actor._pending[-1].text == "again"


@pytest.mark.parametrize("steps", [0, 1, 2])
async def test_a_cancel_at_any_step_of_the_producer_ends_the_relay(redis_server, key_prefix, steps):
    async with owned_actor(redis_server, key_prefix) as actor:
        handling = asyncio.create_task(actor._handle(text_input(actor, 1, "hello")))
        for _ in range(steps + 1):
            await asyncio.sleep(0)
        await actor.on_control(cancel_of(actor))
        await asyncio.wait_for(handling, 5)
        assert actor.active


async def test_drafts_emitted_while_a_publish_is_under_way_are_published(redis_server, key_prefix):
    """Cause: a draft a backend emitted (a proactive remark's last chunk) while the
    actor was publishing waited, unpublished, until the session's next input."""
    from schemas.events import decode_output
    from tests.actor_helpers import STAGE
    from workers.backends.base import OutputDraft

    async with owned_actor(redis_server, key_prefix) as actor:
        real_publish = actor.ownership.publish
        calls = 0

        async def publish_and_emit(*args, **kwargs):
            nonlocal calls
            calls += 1
            result = await real_publish(*args, **kwargs)
            if calls == 1:  # the backend speaks on while this publish is in flight
                actor.emit(OutputDraft(OutputKind.DONE, meta={"last": True}))
            return result

        actor.ownership.publish = publish_and_emit  # type: ignore[method-assign]
        actor.emit(OutputDraft(OutputKind.TEXT_DELTA, text="remark"))
        await actor.apply(await actor.queue.get())
        bus = actor.ownership.bus
        stream = bus.keys.session(actor.session_id).stage_out(STAGE)
        published = [decode_output(e.fields[b"e"]) for e in await bus.xrange(stream)]
        assert [o.kind for o in published] == [OutputKind.TEXT_DELTA, OutputKind.DONE]
        assert actor.idle.is_set() and not actor._pending


async def test_a_cancel_seen_first_by_a_refused_publish_releases_once(redis_server, key_prefix):
    """Cause: a flush refused for the old epoch released the producer's fence, and the
    cancel's control, read a moment later, released it again."""
    from dataplane.authority import SessionAuthority
    from schemas.events import ControlEvent, ControlKind
    from tests.actor_helpers import PIPELINE
    from workers.backends.echo import EchoBackend

    backend = EchoBackend({"chunks": 4, "step_ms": 10_000})
    async with owned_actor(redis_server, key_prefix, backend=backend) as actor:
        before = actor.ctx.fence
        # The cancel lands in Redis; its control has not reached the actor yet.
        result = await SessionAuthority(actor.ownership.bus, PIPELINE).cancel(actor.session_id)
        handling = asyncio.create_task(actor._handle(text_input(actor, 1, "abcdefgh")))
        async with asyncio.timeout(5):
            while actor.ctx.fence.epoch == before.epoch:  # the refused flush taught it
                await asyncio.sleep(0.01)
        await actor.on_control(
            ControlEvent(ControlKind.CANCEL, result.fence, cancelled=before, reason="cancel")
        )
        await asyncio.wait_for(handling, 5)
        assert backend.released == [before]


async def test_an_answer_given_at_once_is_staged_without_a_producer_task(redis_server, key_prefix):
    """Echo answers an unstreamed event at once (``answer_now``): no task runs ``handle``,
    and the answer waits for the batch's publish, with the progress."""
    from workers.backends.echo import EchoBackend

    async with owned_actor(redis_server, key_prefix, backend=EchoBackend({})) as actor:
        tasks_before = len(asyncio.all_tasks())
        handling = actor._handle(text_input(actor, 1, "hello"))
        await handling
        assert len(asyncio.all_tasks()) == tasks_before and actor._producer is None
        assert [(e.kind, e.text, e.source_seq) for e in actor._pending] == [
            (OutputKind.TEXT_DELTA, "hello", 1)
        ]


async def test_an_answer_given_at_once_skips_what_the_previous_owner_published(
    redis_server, key_prefix
):
    from workers.actor import SessionActor
    from workers.backends.echo import EchoBackend

    async with owned_actor(redis_server, key_prefix, backend=EchoBackend({})) as actor:
        heir = SessionActor(actor.lease, actor.ownership, actor.backend, actor.ctx, {1: 1})
        await heir._handle(text_input(heir, 1, "hello"))
        await heir._handle(text_input(heir, 2, "again"))
        assert [e.text for e in heir._pending] == ["again"]


async def test_an_answer_at_once_that_raises_becomes_the_events_error(redis_server, key_prefix):
    from workers.backends.echo import EchoBackend

    class Failing(EchoBackend):
        def answer_now(self, ctx, event):
            raise ValueError("no answer")

    async with owned_actor(redis_server, key_prefix, backend=Failing({})) as actor:
        await actor._handle(text_input(actor, 1, "hello"))
        assert actor.active
        assert [(e.kind, e.text, e.meta) for e in actor._pending] == [
            (OutputKind.ERROR, "no answer", {"code": "backend_error"})
        ]


async def test_batches_queued_meanwhile_are_applied_together_with_one_publish(
    redis_server, key_prefix
):
    """Under load batches queue up while the one before is published: the next apply
    takes them all, in order, and publishes once."""
    from dataplane.authority import SessionAuthority
    from schemas.events import decode_output
    from tests.actor_helpers import PIPELINE, STAGE
    from workers.backends.echo import EchoBackend

    async with owned_actor(redis_server, key_prefix, backend=EchoBackend({})) as actor:
        bus = actor.ownership.bus
        authority = SessionAuthority(bus, PIPELINE)
        for text in ("a", "b", "c", "d"):
            await authority.append(actor.session_id, "append_text", TextPayload(text))
        log = await bus.xrange(bus.keys.session(actor.session_id).input)
        actor.enqueue(log[:1])
        actor.enqueue(log[1:3])
        actor.enqueue([])  # a wake-up (a proactive draft, an end) in between
        actor.enqueue(log[3:])
        publishes = 0
        real_publish = actor.ownership.publish

        async def counted(*args, **kwargs):
            nonlocal publishes
            publishes += 1
            return await real_publish(*args, **kwargs)

        actor.ownership.publish = counted  # type: ignore[method-assign]
        batch = await actor.next_batch()
        assert [e.id for e in batch] == [e.id for e in log] and actor.queue.empty()
        assert actor.pending(0)[0] == 4
        await actor.apply(batch)
        assert publishes == 1 and actor.pending(0) == (0, 0.0) and actor.applied_seq == 4
        stream = bus.keys.session(actor.session_id).stage_out(STAGE)
        published = [decode_output(e.fields[b"e"]).text for e in await bus.xrange(stream)]
        assert published == ["a", "b", "c", "d"]


async def test_drafts_of_work_released_meanwhile_are_dropped_and_counted(redis_server, key_prefix):
    """A barge-in that lands while a backend is still answering (its producer not
    cancelled: nothing was read from the control stream) releases the answer: the
    drafts still coming are never published, and each is counted as an epoch drop."""
    from dataplane.metrics import value
    from workers.backends.base import OutputDraft

    class BargesIn(StreamingEcho):
        async def handle(self, ctx, event):
            ctx.stage_fence.on_interrupt(ctx.fence.replace(epoch=ctx.fence.epoch + 1))
            for text in ("a", "b"):
                yield OutputDraft(OutputKind.TEXT_DELTA, text=text)

    async with owned_actor(redis_server, key_prefix, backend=BargesIn({})) as actor:
        before = value("duplexq_dropped_stale_total", stage=STAGE, reason="epoch")
        await actor._handle(text_input(actor, 1, "hello"))
        assert actor._pending == []
        after = value("duplexq_dropped_stale_total", stage=STAGE, reason="epoch")
        assert after - before == 2
        shared = await actor.ownership.bus.client.hget(
            actor.ownership.bus.keys.metrics, f"dropped:{STAGE}:epoch"
        )
        assert int(shared) == 2


async def test_drafts_released_before_the_relay_is_cancelled_are_counted(redis_server, key_prefix):
    """The relay of an answer whose drafts were released, cancelled before the answer
    ended (its actor stopping): the drafts it dropped until then are counted, in the
    process at once and in the shared metrics as it stops. It counted them only at the
    answer's end, so a cancel lost them."""
    from dataplane.metrics import value
    from workers.backends.base import OutputDraft

    class BargesInThenHangs(StreamingEcho):
        async def handle(self, ctx, event):
            ctx.stage_fence.on_interrupt(ctx.fence.replace(epoch=ctx.fence.epoch + 1))
            for text in ("a", "b"):
                yield OutputDraft(OutputKind.TEXT_DELTA, text=text)
            await asyncio.Event().wait()  # the answer never ends on its own

    async with owned_actor(redis_server, key_prefix, backend=BargesInThenHangs({})) as actor:
        before = value("duplexq_dropped_stale_total", stage=STAGE, reason="epoch")
        handling = asyncio.create_task(actor._handle(text_input(actor, 1, "hello")))
        for _ in range(500):  # both drafts reach the relay, with no I/O in between
            if value("duplexq_dropped_stale_total", stage=STAGE, reason="epoch") - before == 2:
                break
            await asyncio.sleep(0.001)
        assert value("duplexq_dropped_stale_total", stage=STAGE, reason="epoch") - before == 2
        assert not handling.done()
        handling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handling
        assert actor._pending == []
        shared = await actor.ownership.bus.client.hget(
            actor.ownership.bus.keys.metrics, f"dropped:{STAGE}:epoch"
        )
        assert int(shared) == 2
