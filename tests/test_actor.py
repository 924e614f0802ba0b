"""One session actor on real Redis, driven step by step.

These tests place a control event at an exact point of the actor's work by
the event loop's own ordering (a task created now takes its first step after
the tasks already ready), so each reproduces its race every time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from coordinator.authority import SessionAuthority
from coordinator.bus import RedisBus
from schemas.config import echo_pipeline
from schemas.events import (
    ControlEvent,
    ControlKind,
    InputEvent,
    InputMode,
    OutputKind,
    TextPayload,
)
from schemas.keys import Keys
from workers.actor import SessionActor
from workers.backends.base import StageContext
from workers.backends.echo import EchoBackend
from workers.ownership import StageOwnership

STAGE = "echo"


@contextlib.asynccontextmanager
async def owned_actor(redis_server, key_prefix, sid: str = "s1") -> AsyncIterator[SessionActor]:
    """An echo actor holding the lease of a freshly opened session."""
    pipeline = echo_pipeline(STAGE)
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        await SessionAuthority(bus, pipeline).open(sid)
        ownership = StageOwnership(bus, pipeline, STAGE, "w1", 5000)
        _, lease = await ownership.acquire(sid, 0)
        assert lease is not None
        ctx = StageContext(sid, STAGE, lease.fence, {})
        yield SessionActor(lease, ownership, EchoBackend({}), ctx)
    finally:
        await bus.aclose()


def text_input(actor: SessionActor, seq: int, text: str) -> InputEvent:
    return InputEvent(
        fence=actor.ctx.fence,
        seq=seq,
        turn_seq=seq,
        mode=InputMode.APPEND_TEXT,
        payload=TextPayload(text),
        ts_ms=0,
    )


def cancel_of(actor: SessionActor) -> ControlEvent:
    fence = actor.ctx.fence
    return ControlEvent(
        kind=ControlKind.CANCEL,
        fence=fence.replace(epoch=fence.epoch + 1),
        cancelled=fence,
        reason="barge_in",
        ts_ms=0,
    )


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
