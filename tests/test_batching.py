"""Script calls batched on a real redis-server through the hot path's lane: several
calls of one script go as one call of its multi form, each with its own reply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
from redis.exceptions import ResponseError

from dataplane.batching import ScriptBatcher
from dataplane.lane import Lane, Started


class Recording:
    """The lane, recording every command it is given."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.commands: list[tuple[Any, ...]] = []
        self.on_start: Callable[[int], None] = lambda _count: None
        """Called with each batch's number of commands as it is started."""

    def start(self, commands: Sequence[Sequence[Any]]) -> Started:
        self.commands += [tuple(c) for c in commands]
        self.on_start(len(commands))
        return self.lane.start(commands)

    async def replies(self, started: Started) -> list[Any]:
        return await self.lane.replies(started)

    async def load(self, script: str) -> None:
        await self.lane.load(script)

    def evalshas(self) -> list[tuple[Any, ...]]:
        return [c for c in self.commands if c[0] == "EVALSHA"]


class Script:
    def __init__(self, body: str) -> None:
        self.script = body
        self.sha = ""

    async def load(self, lane: Lane) -> Script:
        self.sha = (await lane.execute("SCRIPT", "LOAD", self.script)).decode()
        return self


INCR_BY = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
CHECKED = """
if ARGV[1] == 'refuse' then return redis.error_reply('REFUSED by the script') end
if ARGV[1] == 'raise' then error('the script failed') end
return {ARGV[1], redis.call('INCR', KEYS[1])}
"""


@pytest.fixture
async def recording(redis_server) -> AsyncIterator[Recording]:
    lane = Lane(redis_server.url, timeout_s=5, connect_timeout_s=5)
    try:
        yield Recording(lane)
    finally:
        await lane.aclose()


async def test_calls_of_one_script_go_as_one_multi_call_each_with_its_reply(recording, key_prefix):
    batcher = ScriptBatcher(recording)
    incr = await Script(INCR_BY).load(recording.lane)
    keys = [f"{key_prefix}:{i % 3}" for i in range(9)]
    replies = await asyncio.gather(*(batcher.run(incr, [k], [i + 1]) for i, k in enumerate(keys)))
    # Key 0 got 1, 4, 7 added in call order; key 1 got 2, 5, 8; key 2 got 3, 6, 9.
    assert replies == [1, 2, 3, 5, 7, 9, 12, 15, 18]
    (sent,) = recording.evalshas()
    assert sent[1] != incr.sha and sent[2] == 9  # the multi form, the nine calls' keys
    # A lone call is the script itself.
    assert await batcher.run(incr, [keys[0]], [100]) == 112
    assert recording.evalshas()[-1][1] == incr.sha


SHAPE = "return {#KEYS, #ARGV, KEYS[#KEYS], ARGV[#ARGV]}"


async def test_each_call_of_a_multi_sees_its_own_keys_and_args(recording, key_prefix):
    batcher = ScriptBatcher(recording)
    shape = await Script(SHAPE).load(recording.lane)
    # Alike calls: their numbers of keys and args go once, ahead of the calls' args.
    alike = [([f"{key_prefix}:{i}"], ["x", f"a{i}"]) for i in range(4)]
    replies = await asyncio.gather(*(batcher.run(shape, k, a) for k, a in alike))
    assert replies == [[1, 2, f"{key_prefix}:{i}".encode(), f"a{i}".encode()] for i in range(4)]
    (sent,) = recording.evalshas()
    assert sent[2:10] == (4, *(k[0] for k, _ in alike), -4, 1, 2)  # -4 calls: 1 key, 2 args
    # Calls of other shapes in one batch: each call's numbers go with it.
    a, b, c, d = (f"{key_prefix}:{name}" for name in "abcd")
    mixed = [([a], ["1"]), ([b, c], ["1", "2", "3"]), ([d], ["1", "2"])]
    replies = await asyncio.gather(*(batcher.run(shape, k, a) for k, a in mixed))
    assert [r[:2] for r in replies] == [[1, 1], [2, 3], [1, 2]]
    assert [r[2:] for r in replies] == [[k[-1].encode(), a[-1].encode()] for k, a in mixed]
    assert recording.evalshas()[-1][2 + 4 + 1] == 3  # 4 keys, then the number of calls


async def test_an_error_in_one_call_of_a_multi_is_that_calls_error_only(recording, key_prefix):
    batcher = ScriptBatcher(recording)
    checked = await Script(CHECKED).load(recording.lane)
    key = f"{key_prefix}:n"
    results = await asyncio.gather(
        batcher.run(checked, [key], ["a"]),
        batcher.run(checked, [key], ["refuse"]),
        batcher.run(checked, [key], ["raise"]),
        batcher.run(checked, [key], ["b"]),
        return_exceptions=True,
    )
    assert results[0] == [b"a", 1] and results[3] == [b"b", 2]
    assert isinstance(results[1], ResponseError) and "REFUSED by the script" in str(results[1])
    assert isinstance(results[2], ResponseError) and "the script failed" in str(results[2])
    assert len(recording.evalshas()) == 1


async def test_a_multi_form_is_loaded_again_after_the_script_cache_is_lost(recording, key_prefix):
    """A restarted Redis has no scripts: the multi form's NOSCRIPT loads it (and the
    script) again, and the calls are answered."""
    batcher = ScriptBatcher(recording)
    incr = await Script(INCR_BY).load(recording.lane)
    key = f"{key_prefix}:n"
    assert await asyncio.gather(*(batcher.run(incr, [key], [1]) for _ in range(3))) == [1, 2, 3]
    await recording.lane.execute("SCRIPT", "FLUSH")
    assert await asyncio.gather(*(batcher.run(incr, [key], [1]) for _ in range(3))) == [4, 5, 6]


async def test_a_full_batch_goes_to_redis_while_the_turn_goes_on(recording, key_prefix):
    """With a batch size, the calls of one turn go in batches of that size, each started
    (on the socket, for a connected lane) as it fills, before the turn's later calls are
    even made; the rest go at the end of the turn. Replies keep the calls' order."""
    batcher = ScriptBatcher(recording, batch_size=4)
    incr = await Script(INCR_BY).load(recording.lane)
    key = f"{key_prefix}:n"
    made = 0
    started: list[tuple[int, int]] = []
    recording.on_start = lambda count: started.append((made, count))

    async def call() -> int:
        nonlocal made
        made += 1
        return int(await batcher.run(incr, [key], [1]))

    assert await asyncio.gather(*(call() for _ in range(10))) == list(range(1, 11))
    # (calls made when the batch started, its commands): one multi call per batch, the
    # first led by the loading of the multi form
    assert started == [(4, 2), (8, 1), (10, 1)]
    assert [c[2] for c in recording.evalshas()] == [4, 4, 2]


async def test_without_a_batch_size_a_turn_goes_as_one_batch(recording, key_prefix):
    batcher = ScriptBatcher(recording)
    incr = await Script(INCR_BY).load(recording.lane)
    key = f"{key_prefix}:n"
    assert await asyncio.gather(*(batcher.run(incr, [key], [1]) for _ in range(10))) == list(
        range(1, 11)
    )
    assert [c[2] for c in recording.evalshas()] == [10]
