"""The session meta hash's reader (``dataplane.session_meta``), on a real redis-server:
what it reads is what the scripts wrote."""

from dataplane import session_meta
from dataplane.authority import SessionAuthority
from schemas.config import echo_pipeline
from schemas.events import InputMode, TextPayload
from schemas.fence import Fence
from schemas.realtime import SessionConfig

PIPELINE = echo_pipeline("a", "b")


async def test_a_session_never_opened_has_no_status_fence_or_snapshot(bus):
    assert await session_meta.status(bus, "nobody") is None
    assert await session_meta.fence(bus, "nobody") is None
    assert await session_meta.snapshot(bus, "nobody") is None
    assert await session_meta.config(bus, "nobody") == SessionConfig()


async def test_what_the_scripts_wrote_is_read_back(bus):
    authority = SessionAuthority(bus, PIPELINE)
    await authority.open("s1", [InputMode.APPEND_TEXT, InputMode.TURN_COMMIT_ONLY])
    for i in range(3):
        await authority.append("s1", InputMode.APPEND_TEXT, TextPayload(f"t{i}"))
    reserved = await authority.reserve_response("s1")
    assert await session_meta.status(bus, "s1") == "open"
    assert await session_meta.fence(bus, "s1") == reserved
    assert await session_meta.reserved_response(bus, "s1") == reserved.response_seq > 0
    assert await session_meta.capabilities(bus, "s1") == ["append_text", "turn_commit_only"]
    snapshot = await session_meta.snapshot(bus, "s1")
    assert snapshot is not None
    assert (snapshot.status, snapshot.fence, snapshot.seq) == ("open", reserved, 3)
    assert snapshot.applied("a") == 0 and snapshot.read("a") is None
    await authority.close("s1")
    assert await session_meta.status(bus, "s1") == "closed"


async def test_a_stored_config_is_read_back(bus):
    await SessionAuthority(bus, PIPELINE).open("s2")
    stored = SessionConfig(instructions="be brief")
    await session_meta.store_config(bus, "s2", stored)
    assert await session_meta.config(bus, "s2") == stored
    assert await session_meta.config_json(bus, "s2") == stored.model_dump_json().encode()


async def test_failures_count_in_a_row_at_the_same_progress(bus):
    await SessionAuthority(bus, PIPELINE).open("s3")
    assert [await session_meta.note_failure(bus, "s3", "a") for _ in range(3)] == [1, 2, 3]
    await bus.hset(bus.keys.session("s3").meta, {"a:applied": 5})  # the stage moved on
    assert await session_meta.note_failure(bus, "s3", "a") == 1
    assert await session_meta.applied(bus, "s3", ["a", "b"]) == [5, 0]
    assert await session_meta.applied_by_many(bus, ["s3", "nobody"], "a") == [5, 0]


async def test_the_attachment_read_decodes_status_and_lapse(bus):
    await SessionAuthority(bus, PIPELINE).open("s4")
    async with bus.client.pipeline(transaction=False) as pipe:
        session_meta.queue_attachment_read(pipe, bus, "s4")
        session_meta.queue_attachment_read(pipe, bus, "nobody")
        opened, unknown = await pipe.execute()
    assert session_meta.attachment_of(opened) == ("open", None)
    assert session_meta.attachment_of(unknown) == (None, None)
    assert Fence("s4") == await session_meta.fence(bus, "s4")
