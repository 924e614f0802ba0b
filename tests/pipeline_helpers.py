"""Helpers for data-plane tests: settings, in-process workers, collecting outputs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from coordinator.output_reader import Delivery
from coordinator.service import Coordinator
from schemas.config import PipelineConfig, Settings
from schemas.events import OutputEvent, OutputKind
from workers.runtime import Worker


def fast_settings(url: str, prefix: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "redis_url": url,
        "key_prefix": prefix,
        "lease_ttl_ms": 1000,
        "heartbeat_ms": 200,
        "block_ms": 100,
        "orphan_scan_ms": 100,
        "assign_claim_idle_ms": 1000,
    }
    values.update(overrides)
    return Settings.model_validate(values)


@contextlib.asynccontextmanager
async def running_worker(
    settings: Settings, pipeline: PipelineConfig, stage: str, **kwargs: object
) -> AsyncIterator[Worker]:
    worker = Worker(settings, pipeline, stage, **kwargs)  # type: ignore[arg-type]
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 20)


async def collect(
    coordinator: Coordinator,
    count: int,
    *,
    timeout: float = 20.0,
    until_text: str | None = None,
) -> list[Delivery]:
    """Read deliveries until ``count`` outputs (controls not counted), or with
    ``until_text`` until the delivered text ends with it; fails on timeout."""
    got: list[Delivery] = []

    def done() -> bool:
        outputs = [d.event for d in got if isinstance(d.event, OutputEvent)]
        if until_text is not None:
            return "".join(o.text for o in outputs).endswith(until_text)
        return len(outputs) >= count

    async with asyncio.timeout(timeout):
        while not done():
            got.extend(await coordinator.outputs(block_ms=100))
    return got


def outputs_of(
    deliveries: list[Delivery], kind: OutputKind | None = None, session: str | None = None
) -> list[OutputEvent]:
    """The outputs among ``deliveries``, optionally of one kind and one session."""
    return [
        d.event
        for d in deliveries
        if isinstance(d.event, OutputEvent)
        and (kind is None or d.event.kind is kind)
        and (session is None or d.event.fence.session_id == session)
    ]


def delta_tokens(deliveries: list[Delivery]) -> int:
    """How many tokens the text deltas among ``deliveries`` carry (a delta may carry
    several: vLLM merges the steps a busy consumer has not taken yet)."""
    return sum(len(o.token_ids) for o in outputs_of(deliveries, OutputKind.TEXT_DELTA))


def _shown(event: object) -> tuple[object, ...]:
    """A delivery in a timeout message: kind, fence (incarnation, epoch, turn,
    response) and text."""
    kind, fence = getattr(event, "kind", None), getattr(event, "fence", None)
    where = (fence.incarnation, fence.epoch, fence.turn_id, fence.response_seq) if fence else ()
    return (getattr(kind, "value", type(event).__name__), where, getattr(event, "text", ""))


async def read_until(
    coordinator: Coordinator, done: Callable[[list[Delivery]], bool], *, timeout: float = 30.0
) -> list[Delivery]:
    """Deliveries until ``done(deliveries)`` holds; on timeout, fail showing what came."""
    got: list[Delivery] = []
    try:
        async with asyncio.timeout(timeout):
            while not done(got):
                got.extend(await coordinator.outputs(block_ms=100))
    except TimeoutError:
        # Each delivery with its fence: a timeout after a second failover or a cancel
        # shows which fence the awaited output came under.
        seen = [_shown(d.event) for d in got]
        raise AssertionError(f"timed out; outputs so far: {seen}") from None
    return got
