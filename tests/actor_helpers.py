"""One session actor holding a real lease on real Redis, for step-by-step tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from schemas.config import echo_pipeline
from schemas.events import ControlEvent, ControlKind, InputEvent, InputMode, TextPayload
from schemas.keys import Keys
from workers.actor import SessionActor
from workers.backends.base import StageBackend, StageContext, StageEvent
from workers.backends.echo import EchoBackend
from workers.ownership import StageOwnership

STAGE = "echo"
NEXT = "next"
PIPELINE = echo_pipeline(STAGE, NEXT)


class StreamingEcho(EchoBackend):
    """Echo answering every event through ``handle``, run in a task as a model stage's
    is (never at once): the path the actor's races are about."""

    def answer_now(self, ctx: StageContext, event: StageEvent) -> None:
        return None


@contextlib.asynccontextmanager
async def owned_actor(
    redis_server, key_prefix, sid: str = "s1", backend: StageBackend | None = None
) -> AsyncIterator[SessionActor]:
    """An actor of the first stage of ``echo -> next`` (``StreamingEcho`` unless
    ``backend``) holding the lease of a freshly opened session."""
    pipeline = PIPELINE
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        await SessionAuthority(bus, pipeline).open(sid)
        ownership = StageOwnership(bus, pipeline, STAGE, "w1", 5000)
        _, lease = await ownership.acquire(sid, 0)
        assert lease is not None
        ctx = StageContext(sid, STAGE, lease.fence, {})
        yield SessionActor(lease, ownership, backend or StreamingEcho({}), ctx)
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


async def fail_over(actor: SessionActor, stage: str = NEXT) -> None:
    """Make ``stage``'s ownership change hands (incarnation + 1), as a failover does."""
    bus = actor.ownership.bus
    ownership = StageOwnership(bus, PIPELINE, stage, "other", 5000)
    key = bus.keys.session(actor.session_id).lease(stage)
    await bus.client.delete(key)
    _, lease = await ownership.acquire(actor.session_id, 0)
    assert lease is not None
    if not lease.failover:  # the stage's first owner: the next acquire is the failover
        await ownership.release(lease, hand_back=False)
        _, lease = await ownership.acquire(actor.session_id, 0)
        assert lease is not None and lease.failover
