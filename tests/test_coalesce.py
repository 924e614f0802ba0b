"""Coalesced publishing of streamed drafts: the pure rule, then an actor on real Redis.

A streaming backend's flush drafts are published at once for the first of an
answer and then at most once per window or per ``cap`` drafts; every draft
stays its own output, in order, published exactly once; a cancel publishes
nothing that was held for the old epoch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest

from dataplane.authority import SessionAuthority
from dataplane.bus import Entry
from dataplane.metrics import value
from schemas.events import ControlEvent, ControlKind, OutputEvent, OutputKind, decode_output
from schemas.events import encode_event as encode
from schemas.fence import Fence
from tests.actor_helpers import PIPELINE, STAGE, owned_actor, text_input
from workers.actor import SessionActor
from workers.backends.base import NO_HISTORY, OutputDraft, StageContext, StageEvent
from workers.coalesce import CoalescePolicy, Coalescer

# -- the rule (pure) ---------------------------------------------------------------------


def test_first_draft_goes_at_once_then_one_publish_per_window():
    c = Coalescer(CoalescePolicy(window_s=0.02, cap=100))
    assert c.deadline is None
    assert c.hold(1.000)  # the answer's first
    assert c.published(1.000) == [0.0]
    assert not c.hold(1.005) and not c.hold(1.010)
    assert c.held == 2 and c.deadline == pytest.approx(1.020)
    assert c.published(1.020) == pytest.approx([0.015, 0.010])
    assert c.deadline is None  # nothing held, nothing due


def test_the_first_draft_of_each_kind_goes_at_once():
    c = Coalescer(CoalescePolicy(window_s=0.02, cap=100))
    assert c.hold(1.000, "transcript")
    c.published(1.000)
    assert c.hold(1.001, "audio_delta")  # the answer's first audio waits for no window
    c.published(1.001)
    assert not c.hold(1.002, "audio_delta") and not c.hold(1.003, "transcript")


def test_a_stream_slower_than_the_window_waits_for_nothing():
    c = Coalescer(CoalescePolicy(window_s=0.02, cap=100))
    for step in range(5):
        now = step * 0.05
        assert c.hold(now)
        assert c.published(now) == [0.0]


@pytest.mark.parametrize("cap", [1, 2, 16])
def test_the_cap_publishes_before_the_window_ends(cap):
    c = Coalescer(CoalescePolicy(window_s=10.0, cap=cap))
    assert c.hold(0.0)
    c.published(0.0)
    decisions = [c.hold(0.001 * i) for i in range(1, cap + 1)]
    assert decisions == [False] * (cap - 1) + [True]


def test_a_zero_window_publishes_every_draft_at_once():
    c = Coalescer(CoalescePolicy(window_s=0.0, cap=16))
    for _ in range(3):
        assert c.hold(5.0)
        c.published(5.0)


# -- an actor on real Redis ----------------------------------------------------------------


class Streamer:
    """Streams ``count`` flush drafts ``t0``, ``t1``, ... and a ``done``; before draft
    ``pause_at`` it waits for ``gate``."""

    name = "streamer"
    continuous_input = False
    follows_responses = True
    rebuild = NO_HISTORY

    def __init__(self, count: int, pause_at: int | None = None, gap_s: float = 0.0) -> None:
        self.count = count
        self.pause_at = pause_at
        self.gap_s = gap_s
        self.gate = asyncio.Event()
        self.yielded = 0
        self.released: list[Fence] = []

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        return None

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        for index in range(self.count):
            if index == self.pause_at:
                await self.gate.wait()
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
            self.yielded += 1
            yield OutputDraft(OutputKind.TEXT_DELTA, text=f"t{index}", flush=True)
        yield OutputDraft(OutputKind.DONE)

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        return None

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        self.released.append(fence)

    async def stop(self, ctx: StageContext) -> None:
        return None

    async def aclose(self) -> None:
        return None


def count_publishes(actor: SessionActor) -> list[int]:
    """Wrap the actor's publish; the list grows by the outputs each call carried."""
    calls: list[int] = []
    real = actor.ownership.publish

    async def counted(lease, groups, **kwargs):
        calls.append(sum(len(events) for _, events in groups))
        return await real(lease, groups, **kwargs)

    actor.ownership.publish = counted  # type: ignore[method-assign]
    return calls


async def published(actor: SessionActor) -> list[OutputEvent]:
    bus = actor.ownership.bus
    stream = bus.keys.session(actor.session_id).stage_out(STAGE)
    entries = await bus.xrange(stream)
    return [decode_output(entry.fields[b"e"]) for entry in entries if b"e" in entry.fields]


def input_entry(actor: SessionActor, seq: int) -> Entry:
    return Entry("in", f"{seq}-0", {b"e": encode(text_input(actor, seq, "go"))})


async def until(condition: Callable[[], Awaitable[bool]], within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while not await condition():
            await asyncio.sleep(0.002)


def texts(outputs: list[OutputEvent]) -> list[str]:
    return [o.text for o in outputs if o.kind is OutputKind.TEXT_DELTA]


@pytest.mark.parametrize("gap_s", [0.0, 0.001])
async def test_a_fast_stream_is_published_in_few_calls_each_draft_once_in_order(
    redis_server, key_prefix, gap_s
):
    backend = Streamer(50, gap_s=gap_s)
    async with owned_actor(redis_server, key_prefix, backend=backend) as actor:
        calls = count_publishes(actor)
        await actor.apply([input_entry(actor, 1)])
        outputs = await published(actor)
    assert texts(outputs) == [f"t{i}" for i in range(50)]
    assert [o.kind for o in outputs][-1] is OutputKind.DONE
    seqs = [o.seq for o in outputs]
    assert seqs == list(range(seqs[0], seqs[0] + 51))  # one output each, none lost
    assert calls[0] == 1  # the first token went out alone, at once
    assert sum(calls) == 51
    assert len(calls) <= 50 // 4, calls  # far fewer publishes than drafts


async def test_coalescing_off_publishes_every_draft_at_once(redis_server, key_prefix):
    backend = Streamer(20)
    async with owned_actor(redis_server, key_prefix, backend=backend) as actor:
        actor.coalesce = CoalescePolicy(window_s=0.0, cap=16)
        calls = count_publishes(actor)
        await actor.apply([input_entry(actor, 1)])
        assert texts(await published(actor)) == [f"t{i}" for i in range(20)]
    assert calls[:20] == [1] * 20  # then the done with the progress


async def test_the_first_draft_does_not_wait_and_held_ones_go_out_when_the_window_ends(
    redis_server, key_prefix
):
    backend = Streamer(6, pause_at=3)
    async with owned_actor(redis_server, key_prefix, backend=backend) as actor:
        actor.coalesce = CoalescePolicy(window_s=0.2, cap=100)
        applying = asyncio.create_task(actor.apply([input_entry(actor, 1)]))
        loop = asyncio.get_running_loop()
        started = loop.time()
        # t0 is out long before the window ends; t1 and t2 are held meanwhile.
        await until(lambda: _has(actor, 1), within_s=0.15)
        assert texts(await published(actor)) == ["t0"]
        # The producer is stalled (gate shut): the window's end alone publishes t1, t2.
        await until(lambda: _has(actor, 3), within_s=2)
        assert loop.time() - started >= 0.19
        assert texts(await published(actor)) == ["t0", "t1", "t2"]
        backend.gate.set()
        await asyncio.wait_for(applying, 5)
        assert texts(await published(actor)) == [f"t{i}" for i in range(6)]


async def _has(actor: SessionActor, count: int) -> bool:
    return len(await published(actor)) >= count


async def test_a_cancel_publishes_nothing_held_for_the_old_epoch(redis_server, key_prefix):
    backend = Streamer(10, pause_at=4)
    async with owned_actor(redis_server, key_prefix, backend=backend) as actor:
        actor.coalesce = CoalescePolicy(window_s=30.0, cap=100)
        before = actor.ctx.fence
        dropped = value("duplexq_dropped_stale_total")
        handling = asyncio.create_task(actor._handle(text_input(actor, 1, "go")))
        await until(lambda: _yielded(backend, 4))
        await asyncio.sleep(0.01)  # t1..t3 staged and held behind t0
        assert texts(await published(actor)) == ["t0"]
        # The cancel lands in Redis, then its control reaches the actor.
        result = await SessionAuthority(actor.ownership.bus, PIPELINE).cancel(actor.session_id)
        await actor.on_control(
            ControlEvent(ControlKind.CANCEL, result.fence, cancelled=before, reason="cancel")
        )
        await asyncio.wait_for(handling, 5)
        await actor._flush()
        assert texts(await published(actor)) == ["t0"]  # t1..t3 were discarded, counted
        assert value("duplexq_dropped_stale_total") - dropped == 3
        assert backend.released == [before]
        assert not actor._pending and actor.active
        # The next answer, at the new epoch, streams as usual.
        backend.count, backend.pause_at = 3, None
        await actor._handle(text_input(actor, 2, "again"))
        await actor._flush()
        after = [o for o in await published(actor) if o.fence.epoch == result.fence.epoch]
        assert texts(after) == ["t0", "t1", "t2"]


async def _yielded(backend: Streamer, count: int) -> bool:
    return backend.yielded >= count
