"""The Redis session authority, on a real redis-server."""

import asyncio

import msgspec
import pytest

from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from dataplane.scripts import BODY_MARK, META_LAYOUT, PRELUDE
from dataplane.sessions import fence_mismatch
from schemas.config import echo_pipeline
from schemas.errors import (
    FenceMismatchError,
    SessionClosedError,
    SessionExistsError,
    SessionNotFoundError,
    UnsupportedModeError,
)
from schemas.events import (
    ControlKind,
    InputMode,
    TextPayload,
    TokensPayload,
    decode_control,
    decode_input,
)
from schemas.fence import Fence
from schemas.keys import Keys
from tests.test_fence import CUR

PIPELINE = echo_pipeline("a", "b")


@pytest.fixture
def authority(bus):
    return SessionAuthority(bus, PIPELINE)


async def test_open_append_counts_and_log(authority, bus):
    fence = await authority.open("s1")
    assert fence == Fence("s1")
    got = [await authority.append("s1", "append_text", TextPayload(f"t{i}")) for i in range(3)]
    assert [(r.seq, r.turn_seq, r.turn_id) for r in got] == [(1, 1, 0), (2, 2, 0), (3, 3, 0)]
    entries = await bus.xrange(bus.keys.session("s1").input)
    events = [decode_input(e.event) for e in entries]
    assert [e.seq for e in events] == [1, 2, 3]
    assert events[1].payload == TextPayload("t1") and events[1].fence == fence
    assert [e.id for e in entries] == [r.entry_id for r in got]
    # The client's part of the event is stored as it came (field x), not copied onto
    # the rest in Lua; the entry's event joins them.
    tail = msgspec.msgpack.decode(b"\x83" + entries[1].fields[b"x"], type=dict)  # 3 entries
    assert set(tail) == {"mode", "payload", "ts_ms"}
    assert entries[1].event == entries[1].fields[b"e"] + entries[1].fields[b"x"]
    # Both stages were handed the new session.
    for stage in PIPELINE.stage_names:
        assign = await bus.xrange(bus.keys.assign(stage))
        assert [e.fields[b"sid"] for e in assign] == [b"s1"]


async def test_duplicate_open_and_missing_session(authority):
    await authority.open("s1")
    with pytest.raises(SessionExistsError):
        await authority.open("s1")
    with pytest.raises(SessionNotFoundError):
        await authority.append("nope", "append_text", TextPayload("x"))


async def test_turn_seq_restarts_on_new_turn(authority):
    fence = await authority.open("s1")
    await authority.append("s1", InputMode.APPEND_TEXT, TextPayload("a"))
    turn1 = fence.next_turn()
    await authority.accept(turn1)
    r = await authority.append("s1", InputMode.APPEND_TEXT, TextPayload("b"))
    assert (r.seq, r.turn_seq, r.turn_id) == (2, 1, 1)
    r = await authority.append("s1", InputMode.APPEND_TEXT, TextPayload("c"), fence=turn1)
    assert (r.seq, r.turn_seq, r.turn_id) == (3, 2, 1)


@pytest.mark.parametrize(
    "candidate",
    [
        CUR,
        Fence("s1", 1, 3, 4, 5),
        Fence("s1", 3, 3, 4, 5),
        Fence("s1", 2, 2, 9, 9),
        Fence("s1", 2, 3, 3, 9),
        Fence("s1", 2, 3, 4, 4),
        Fence("s1", 2, 3, 9, 4),
        Fence("s1", 2, 4, 0, 0),
        Fence("s1", 2, 3, 5, 5),
        Fence("s1", 2, 3, 4, 6),
    ],
)
async def test_lua_applies_the_same_fence_rule_as_the_core(authority, candidate):
    await authority.open("s1", incarnation=2)
    await authority.accept(CUR)
    reason = fence_mismatch(CUR, candidate)
    if reason is None:
        receipt = await authority.append("s1", "append_text", TextPayload("x"), fence=candidate)
        assert receipt.fence == candidate
        assert await authority.current("s1") == candidate
    else:
        with pytest.raises(FenceMismatchError, match="fence mismatch") as info:
            await authority.append("s1", "append_text", TextPayload("x"), fence=candidate)
        assert info.value.reason == reason.value
        assert await authority.current("s1") == CUR


async def test_capabilities_are_enforced(authority):
    await authority.open("s1", {InputMode.APPEND_TEXT})
    with pytest.raises(UnsupportedModeError, match="not supported"):
        await authority.append("s1", "append_tokens", TokensPayload((1,)))
    with pytest.raises(UnsupportedModeError, match="not supported"):
        await authority.append("s1", "append_smell", TextPayload("x"))
    assert (await authority.append("s1", "append_text", TextPayload("x"))).seq == 1


async def test_cancel_bumps_epoch_once_and_writes_barriers(authority, bus):
    await authority.open("s1")
    first, second = await asyncio.gather(
        authority.cancel("s1", expect_epoch=0), authority.cancel("s1", expect_epoch=0)
    )
    assert sorted([first.applied, second.applied]) == [False, True]
    assert await authority.current("s1") == Fence("s1", 0, 1)
    sk = bus.keys.session("s1")
    for stream in (sk.control, sk.client, sk.stage_out("a"), sk.stage_out("b")):
        entries = await bus.xrange(stream)
        controls = [decode_control(e.fields[b"c"]) for e in entries if b"c" in e.fields]
        cancels = [c for c in controls if c.kind is ControlKind.CANCEL]
        assert len(cancels) == 1
        assert cancels[0].fence == Fence("s1", 0, 1) and cancels[0].cancelled == Fence("s1")
    with pytest.raises(FenceMismatchError, match="epoch"):
        await authority.append("s1", "append_text", TextPayload("x"), fence=Fence("s1"))


async def test_close_expires_keys_and_reopen_needs_higher_incarnation(authority, bus):
    await authority.open("s1")
    await authority.append("s1", "append_text", TextPayload("x"))
    await authority.close("s1", ttl_s=100)
    sk = bus.keys.session("s1")
    assert 0 < await bus.client.ttl(sk.meta) <= 100
    assert 0 < await bus.client.ttl(sk.input) <= 100
    with pytest.raises(SessionClosedError):
        await authority.append("s1", "append_text", TextPayload("x"))
    with pytest.raises(FenceMismatchError, match="incarnation"):
        await authority.open("s1", incarnation=0)
    fence = await authority.open("s1")
    assert fence == Fence("s1", 1)
    assert await bus.client.ttl(sk.meta) == -1
    assert await bus.client.xlen(sk.input) == 0  # the new life starts with an empty log
    with pytest.raises(FenceMismatchError, match="incarnation"):
        await authority.append("s1", "append_text", TextPayload("x"), fence=Fence("s1"))
    assert (await authority.append("s1", "append_text", TextPayload("x"), fence=fence)).seq == 1


async def test_two_coordinators_never_share_a_seq(redis_server, key_prefix):
    buses = [RedisBus(redis_server.url, Keys(key_prefix)) for _ in range(2)]
    try:
        authorities = [SessionAuthority(b, PIPELINE) for b in buses]
        await authorities[0].open("s1")

        async def writer(auth: SessionAuthority, name: str) -> list[int]:
            return [
                (await auth.append("s1", "append_text", TextPayload(f"{name}{i}"))).seq
                for i in range(100)
            ]

        a, b = await asyncio.gather(writer(authorities[0], "a"), writer(authorities[1], "b"))
        assert sorted(a + b) == list(range(1, 201))
        entries = await buses[0].xrange(buses[0].keys.session("s1").input)
        assert [decode_input(e.event).seq for e in entries] == list(range(1, 201))
    finally:
        for b in buses:
            await b.aclose()


async def test_concurrent_calls_on_a_session_go_one_at_a_time_in_the_order_made(authority, bus):
    """The callers of one session take turns in the order they called, a caller that
    gives up while waiting leaves the others their turn, and once every call is done the
    authority keeps nothing for the session (no state grows with the sessions served)."""
    await authority.open("s1")
    await authority.open("s2")
    calls = [
        asyncio.create_task(authority.append("s1", "append_text", TextPayload(f"t{i}")))
        for i in range(20)
    ]
    other = asyncio.create_task(authority.append("s2", "append_text", TextPayload("o")))
    await asyncio.sleep(0)  # every call has started: the first holds s1, the rest wait
    calls[5].cancel()
    done = await asyncio.gather(*calls, other, return_exceptions=True)
    assert isinstance(done[5], asyncio.CancelledError)
    seqs = [r.seq for i, r in enumerate(done[:20]) if i != 5]
    assert seqs == list(range(1, 20))
    entries = await bus.xrange(bus.keys.session("s1").input)
    texts = [decode_input(e.event).payload.text for e in entries]
    assert texts == [f"t{i}" for i in range(20) if i != 5]
    assert done[20].seq == 1
    assert authority._serial == {}


async def test_the_scripts_pack_integers_as_msgpack_does(redis_client):
    # The append writes its event's numbers with the prelude's own msgpack writer: each
    # size class, at its edges, must be what msgpack (and so msgspec's decoder) reads.
    numbers = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 4_294_967_295, 2**40]
    script = PRELUDE.replace(BODY_MARK, "") + "local out = {}\n"
    script += "for i = 1, #ARGV do out[i] = uint(tonumber(ARGV[i])) end\nreturn out\n"
    packed = await redis_client.eval(script, 0, *numbers)
    assert packed == [msgspec.msgpack.encode(n) for n in numbers]


@pytest.mark.parametrize("length", [1, 31, 32, 100, 128])
async def test_an_input_of_a_long_session_id_is_logged_under_its_fence(authority, bus, length):
    # Session ids of up to 31 bytes are packed as a fixstr, longer ones as a str8; a
    # multibyte character counts its bytes.
    session_id = ("é" * length)[: length // 2] + "s" * (length - 2 * (length // 2))
    assert len(session_id.encode()) == length
    fence = await authority.open(session_id)
    for turn in range(3):  # numbers past one byte are packed too
        await authority.append(session_id, "append_text", TextPayload(f"t{turn}"))
    entries = await bus.xrange(bus.keys.session(session_id).input)
    events = [decode_input(e.event) for e in entries]
    assert [e.fence for e in events] == [fence] * 3
    assert [(e.seq, e.turn_seq) for e in events] == [(1, 1), (2, 2), (3, 3)]


async def test_inputs_logged_past_each_integer_size_carry_their_seq(authority, bus):
    await authority.open("s1")
    meta = bus.keys.session("s1").meta
    seqs = []
    for before in (126, 254, 65_534, 4_294_967_294):
        await bus.client.hset(meta, "seq", before)  # as if that many inputs came before
        for _ in range(3):
            seqs.append((await authority.append("s1", "append_text", TextPayload("x"))).seq)
    entries = await bus.xrange(bus.keys.session("s1").input)
    assert [decode_input(e.event).seq for e in entries] == seqs
    assert seqs == [b + k for b in (126, 254, 65_534, 4_294_967_294) for k in (1, 2, 3)]
    assert [decode_input(e.event).turn_seq for e in entries] == list(range(1, 13))


async def test_a_sessions_meta_hash_is_kept_as_a_hash_table(authority, bus, redis_client):
    # An append reads ten of its fields and writes three: in Redis's flat-list layout each
    # is a scan from the start.
    meta = bus.keys.session("s1").meta
    await authority.open("s1")
    await authority.append("s1", "append_text", TextPayload("x"))
    assert await redis_client.object("ENCODING", meta) == b"hashtable"
    assert len(META_LAYOUT) > 64  # Redis's default hash-max-listpack-value
    await authority.close("s1")
    await authority.open("s1")  # a new life starts from a new hash, laid out the same way
    assert await redis_client.object("ENCODING", meta) == b"hashtable"
