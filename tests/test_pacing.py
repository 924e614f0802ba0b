"""Linger: a round that would follow the previous one too closely waits out the rest.

The pacer is checked on a clock the test moves; the script batcher on a real
redis-server, counting the pipelines it sends.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from dataplane import pacing
from dataplane.batching import RedisPyPipe, ScriptBatcher
from dataplane.pacing import Pacer
from schemas.config import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(pacing.time, "monotonic", clock)
    return clock


def test_a_round_close_behind_a_full_one_waits_out_the_linger(clock):
    pacer = Pacer(2.0)
    assert pacer.due_in() == 0  # the first round never waits
    pacer.started()
    pacer.carried(5)
    clock.now += 0.0005
    assert pacer.due_in() == pytest.approx(0.0015)
    clock.now += 0.0015
    assert pacer.due_in() == 0


def test_a_round_behind_one_that_carried_a_single_item_never_waits(clock):
    """A lone caller (one call in flight at a time) is never delayed."""
    pacer = Pacer(2.0)
    for items in (1, 0):
        pacer.started()
        pacer.carried(items)
        clock.now += 0.0001
        assert pacer.due_in() == 0


def test_a_round_long_after_the_last_never_waits(clock):
    pacer = Pacer(2.0)
    pacer.started()
    pacer.carried(5)
    clock.now += 5.0  # an idle loop
    assert pacer.due_in() == 0


def test_zero_linger_never_waits(clock):
    pacer = Pacer(0)
    pacer.started()
    pacer.carried(5)
    assert pacer.due_in() == 0


async def test_pace_sleeps_the_rest_and_counts_the_round(clock, monkeypatch):
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(pacing.asyncio, "sleep", sleep)
    pacer = Pacer(1.0)
    await pacer.pace()
    pacer.carried(3)
    clock.now += 0.0004
    await pacer.pace()
    assert slept == [pytest.approx(0.0006)]
    assert pacer.due_in() == pytest.approx(0.001)  # spaced from the second round


def test_the_shipped_linger_is_one_millisecond_and_bounded():
    assert Settings().linger_ms == 1.0
    with pytest.raises(ValueError):
        Settings(linger_ms=-1)
    with pytest.raises(ValueError):
        Settings(linger_ms=101)


class CountingClient:
    """A real Redis client that counts the pipelines sent through it."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.pipelines = 0

    def start(self, commands: Any) -> Any:
        self.pipelines += 1
        return commands

    async def replies(self, started: Any) -> list[Any]:
        return await RedisPyPipe(self.client).pipeline(started)

    async def load(self, script: str) -> None:
        await self.client.script_load(script)


class Script:
    def __init__(self, client: aioredis.Redis, body: str) -> None:
        self.script = body
        self.sha = ""
        self.client = client

    async def load(self) -> Script:
        self.sha = await self.client.script_load(self.script)
        return self


async def test_calls_within_the_linger_of_a_full_batch_join_the_next_one(redis_client, key_prefix):
    counting = CountingClient(redis_client)
    batcher = ScriptBatcher(counting, linger_ms=1000)
    incr = await Script(redis_client, "return redis.call('INCR', KEYS[1])").load()
    key = f"{key_prefix}:n"

    # Two concurrent callers: their calls go at once, in one batch.
    first = await asyncio.gather(batcher.run(incr, [key], []), batcher.run(incr, [key], []))
    assert sorted(first) == [1, 2] and counting.pipelines == 1
    # Two calls made one after the other, well within the linger of that full batch:
    # they wait for it and go together.
    second = asyncio.create_task(batcher.run(incr, [key], []))
    await asyncio.sleep(0.02)
    third = asyncio.create_task(batcher.run(incr, [key], []))
    assert sorted(await asyncio.gather(second, third)) == [3, 4]
    assert counting.pipelines == 2


async def test_a_lone_caller_is_never_delayed(redis_client, key_prefix):
    """One call in flight at a time (a replay's appends): each batch carries one call,
    so none lingers, however long the linger."""
    counting = CountingClient(redis_client)
    batcher = ScriptBatcher(counting, linger_ms=60_000)
    incr = await Script(redis_client, "return redis.call('INCR', KEYS[1])").load()
    key = f"{key_prefix}:n"
    async with asyncio.timeout(30):  # a single linger would take a minute
        for n in range(1, 21):
            assert await batcher.run(incr, [key], []) == n
    assert counting.pipelines == 20


async def test_without_linger_each_loop_turn_is_its_own_batch(redis_client, key_prefix):
    counting = CountingClient(redis_client)
    batcher = ScriptBatcher(counting)
    incr = await Script(redis_client, "return redis.call('INCR', KEYS[1])").load()
    key = f"{key_prefix}:n"
    assert await batcher.run(incr, [key], []) == 1
    second = asyncio.create_task(batcher.run(incr, [key], []))
    await asyncio.sleep(0.02)
    third = asyncio.create_task(batcher.run(incr, [key], []))
    assert sorted(await asyncio.gather(second, third)) == [2, 3]
    assert counting.pipelines == 3
