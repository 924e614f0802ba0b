"""A lost reply never makes a retried write happen twice.

A fault-injecting proxy sits between the bus and a real redis-server and cuts
the connection right after Redis ran one script, before its reply comes back.
The bus retries the call on a new connection; each script must recognise the
repeat (the caller's producer id and call number) and answer as the first
time, changing nothing more.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from schemas.config import echo_pipeline
from schemas.events import TextPayload, decode_control
from schemas.keys import Keys
from tests.tcp_proxy import FaultyProxy, faulty_proxy
from workers.ownership import AcquireStatus, StageOwnership

PIPELINE = echo_pipeline("echo")


class Rig:
    def __init__(self, proxy: FaultyProxy, bus: RedisBus) -> None:
        self.proxy = proxy
        self.bus = bus
        self.authority = SessionAuthority(bus, PIPELINE)
        self.sk = bus.keys.session("s1")

    def drop_next(self, script) -> None:
        self.proxy.drop_reply_after(script.sha.encode())

    async def meta(self, field: str) -> int:
        return int((await self.bus.hmget(self.sk.meta, [field]))[0] or 0)


@pytest.fixture
async def rig(redis_server, key_prefix) -> AsyncIterator[Rig]:
    async with faulty_proxy(redis_server.port) as proxy:
        bus = RedisBus(proxy.url, Keys(key_prefix))
        # Scripts loaded beforehand: the dropped reply is the script's, not a NOSCRIPT.
        for name in ("open", "append", "cancel", "close", "journal", "reserve", "acquire"):
            await bus.client.script_load(getattr(bus, f"{name}_script").script)
        try:
            yield Rig(proxy, bus)
        finally:
            await bus.aclose()


async def test_a_retried_open_opens_once(rig):
    rig.drop_next(rig.bus.open_script)
    fence = await rig.authority.open("s1")
    assert rig.proxy.dropped == 1
    assert fence.incarnation == 0 and await rig.meta("inc") == 0
    assert await rig.bus.xlen(rig.sk.control) == 1


async def test_a_retried_append_appends_once(rig):
    await rig.authority.open("s1")
    rig.drop_next(rig.bus.append_script)
    receipt = await rig.authority.append("s1", "append_text", TextPayload("hello"))
    assert rig.proxy.dropped == 1
    assert receipt.seq == 1 and await rig.meta("seq") == 1
    assert await rig.bus.xlen(rig.sk.input) == 1
    # The next call is a new one and gets the next seq.
    assert (await rig.authority.append("s1", "append_text", TextPayload("next"))).seq == 2


async def test_a_retried_append_under_a_given_fence_answers_as_the_first_time(rig):
    """An append that moves the fence (a later turn and response) recorded its reply; the
    retry gets that reply again, fence included, and appends nothing more."""
    from schemas.fence import Fence

    await rig.authority.open("s1")
    await rig.authority.append("s1", "append_text", TextPayload("first"))
    rig.drop_next(rig.bus.append_script)
    ahead = Fence("s1", 0, 0, 2, 3)
    receipt = await rig.authority.append("s1", "append_text", TextPayload("x"), fence=ahead)
    assert rig.proxy.dropped == 1
    assert (receipt.seq, receipt.turn_seq, receipt.fence) == (2, 1, ahead)
    assert await rig.bus.xlen(rig.sk.input) == 2
    assert (await rig.meta("turn"), await rig.meta("resp")) == (2, 3)
    then = await rig.authority.append("s1", "append_text", TextPayload("y"))
    assert (then.seq, then.turn_seq, then.fence) == (3, 2, ahead)


async def test_a_retried_cancel_bumps_the_epoch_once(rig):
    await rig.authority.open("s1")
    rig.drop_next(rig.bus.cancel_script)
    result = await rig.authority.cancel("s1")
    assert rig.proxy.dropped == 1
    assert result.applied and result.fence.epoch == 1 and await rig.meta("epoch") == 1
    controls = [decode_control(e.fields[b"c"]) for e in await rig.bus.xrange(rig.sk.control)]
    assert [c.kind.value for c in controls] == ["open", "cancel"]


async def test_a_retried_reserve_reserves_once(rig):
    await rig.authority.open("s1")
    rig.drop_next(rig.bus.reserve_script)
    fence = await rig.authority.reserve_response("s1")
    assert rig.proxy.dropped == 1
    assert fence.response_seq == 1 and await rig.meta("resp") == 1


async def test_a_retried_journal_notice_is_journaled_once(rig):
    await rig.authority.open("s1")
    rig.drop_next(rig.bus.journal_script)
    seq = await rig.authority.journal("s1", {"type": "notice"})
    assert rig.proxy.dropped == 1
    assert seq == 1 and await rig.bus.xlen(rig.sk.client) == 1


async def test_a_retried_close_closes_once(rig):
    await rig.authority.open("s1")
    rig.drop_next(rig.bus.close_script)
    fence = await rig.authority.close("s1")
    assert rig.proxy.dropped == 1
    assert fence.incarnation == 0
    controls = [decode_control(e.fields[b"c"]) for e in await rig.bus.xrange(rig.sk.control)]
    assert [c.kind.value for c in controls] == ["open", "close"]


async def test_a_retried_acquire_grants_the_lease_it_took(rig):
    await rig.authority.open("s1")
    ownership = StageOwnership(rig.bus, PIPELINE, "echo", "w1", 5000)
    rig.drop_next(rig.bus.acquire_script)
    status, lease = await ownership.acquire("s1", 0)
    assert rig.proxy.dropped == 1
    assert status is AcquireStatus.OK and lease is not None and not lease.failover
    owners = await rig.bus.hmget(rig.sk.meta, ["echo:owners"])
    assert owners == [b"1"]


async def test_a_connection_reset_during_its_handshake_is_retried(redis_server, key_prefix):
    """Cause: redis-py connects a pooled connection when it is checked out, before its
    command retry starts, so a reset during the handshake (Redis restarting) escaped
    to the caller and a worker failed its sessions over."""
    async with faulty_proxy(redis_server.port) as proxy:
        bus = RedisBus(proxy.url, Keys(key_prefix))
        try:
            proxy.drop_reply_after(b"SETINFO")  # the first connection dies in its handshake
            assert await bus.client.ping()
            assert proxy.dropped == 1
        finally:
            await bus.aclose()


async def test_call_numbers_are_compared_as_numbers_across_every_digit_count(rig):
    """The scripts compare a call's number with the one kept as text (no number is
    parsed): a longer number is a later call, one as long compares digit by digit. A
    producer's id lives as long as its process, so what an earlier version kept is
    never read by a producer of this one."""
    from dataplane.authority import encode_tail
    from schemas.events import InputMode

    await rig.authority.open("s1")
    tail = encode_tail(InputMode.APPEND_TEXT, TextPayload("hello"), 0)

    async def call(number: int) -> list:
        args = ["s1", "append_text", tail, "", "0", "p1", number]
        return await rig.bus.run(rig.bus.append_script, [rig.sk.meta, rig.sk.input], args)

    seqs = []
    for number in (9, 10, 99, 100, 999, 1000):
        first = await call(number)
        assert first[0] == "ok"
        assert await call(number) == first  # a retry: its reply again
        seqs.append(first[1])
    assert seqs == [1, 2, 3, 4, 5, 6] and await rig.bus.xlen(rig.sk.input) == 6
    assert (await call(999))[1] == 6  # not above the last: the last call's reply
    assert (await call(1001))[1] == 7
