"""Resume: one connection serves a session, the journal is judged once, clients who
left are closed for good.

The journal cases build a session's journal with the real scripts, step by
step, then resume it; the connection cases drive two sockets (on one or two
coordinators) at the same session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import websockets

from coordinator.attachments import Attachments
from coordinator.controlplane.control import audit_leases, close_context, open_context
from coordinator.realtime import SEQ_STRIDE, ServerEventTranslator
from coordinator.resume import replay_journal
from coordinator.service import Coordinator
from schemas.config import echo_pipeline
from schemas.events import OutputEvent, OutputKind
from schemas.fence import Fence
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import Client, serving, text_turn, until_completed
from workers.ownership import Lease, StageOwnership

pytestmark = pytest.mark.timeout(60)

ECHO = echo_pipeline("echo")


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(
        redis_server.url,
        key_prefix,
        api_keys=("k1", "k2"),
        first_event_wait_ms=50,
        resume_grace_s=1,
        attach_ttl_ms=600,
    )


# -- one connection per session ------------------------------------------------------


async def resume(client: Client, token: str, last: int = 0) -> dict:
    await client.send(
        {"type": "duplexq.session.resume", "resume_token": token, "last_received_seq": last}
    )
    return await client.recv()


async def closed_with(client: Client) -> int | None:
    """Wait for the server to close ``client``'s socket; its close code."""
    with contextlib.suppress(websockets.ConnectionClosed):
        async with asyncio.timeout(10):
            while True:
                await client.recv(10)
    return client.ws.close_code


@contextlib.asynccontextmanager
async def two_coordinators(settings, *, same: bool) -> AsyncIterator[tuple[str, str]]:
    async with serving(settings, ECHO) as first:
        if same:
            yield first, first
        else:
            async with serving(settings, ECHO) as second:
                yield first, second


@pytest.mark.parametrize("same", [True, False], ids=["same coordinator", "another coordinator"])
async def test_a_resume_while_the_old_socket_is_open_replaces_it(settings, same):
    """Cause: the old socket's clean-up removed the new connection's queue and its
    grace timer then closed the live session."""
    async with (
        two_coordinators(settings, same=same) as (base_a, base_b),
        running_worker(settings, ECHO, "echo"),
        Client.connect(base_a) as old,
    ):
        created = await old.recv()
        async with Client.connect(base_b) as new:
            assert (await resume(new, created["duplexq"]["resume_token"]))[
                "type"
            ] == "duplexq.session.resumed"
            assert await closed_with(old) == 4000
            # Longer than the grace period after the old socket went: still served.
            await asyncio.sleep(settings.resume_grace_s + 1)
            for event in text_turn("still here"):
                await new.send(event)
            events = await until_completed(new)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "still here"


async def test_the_resume_token_rotates_and_is_bound_to_the_api_key(settings):
    """Each resume hands out a new token; the one presented stays good until a token
    handed out for it is used, and so does every token handed out for it. Causes: the
    presented token was deleted before the new one reached the client, so a resume whose
    reply was lost (the socket or the coordinator died in between) left a live session
    that no token could resume; then a resume the client had given up on (its
    coordinator paused with the request in its socket, as the nemesis's hosts run did)
    was taken after the client's later resume was answered, and dropped the token the
    client held: six sessions dead in one run."""

    async def resumed_with(token: str) -> dict:
        async with Client.connect(base, key="k1") as client:
            return await resume(client, token)

    def resumed(reply: dict) -> str:
        assert reply["type"] == "duplexq.session.resumed", reply
        return str(reply["resume_token"])

    async with serving(settings, ECHO) as base:
        async with Client.connect(base, key="k1") as first:
            t0 = (await first.recv())["duplexq"]["resume_token"]
        async with Client.connect(base, key="k2") as thief:
            assert (await resume(thief, t0))["error"]["code"] == "resume_failed"
        lost = resumed(await resumed_with(t0))  # its reply never reached the client
        held = resumed(await resumed_with(t0))  # so it resumes again with the token it has
        late = resumed(await resumed_with(t0))  # one it gave up on, taken late
        assert len({t0, lost, held, late}) == 4
        t3 = resumed(await resumed_with(held))  # the late one did not cost it its token
        # Using ``held`` proved the client got it: every other token is no longer good.
        for stale in (t0, lost, late):
            assert (await resumed_with(stale))["error"]["code"] == "resume_failed"
        # ``held`` (presented last) still resumes until a token handed out for it is
        # used; at most four such tokens are good at once, the oldest dropped.
        more = [resumed(await resumed_with(held)) for _ in range(4)]
        assert (await resumed_with(t3))["error"]["code"] == "resume_failed"
        resumed(await resumed_with(more[0]))


# -- the client whose coordinator died -------------------------------------------------


async def test_the_control_plane_closes_a_session_whose_client_is_gone(settings):
    """Cause: the grace timer lived only in the coordinator's process; after a crash
    the session stayed open for ever, leasing every stage."""
    coordinator = Coordinator(settings, ECHO)
    ctx = await open_context(settings, ECHO)
    attachments = Attachments(coordinator.bus, settings.attach_ttl_ms)
    try:
        for sid in ("gone", "held", "api"):
            await coordinator.open(sid)
        now = time.time_ns() // 1_000_000
        # "gone": its coordinator died 2 s ago (the hold was never renewed after).
        await attachments.attach("gone", "a1", "", now - 2000 - settings.attach_ttl_ms,
                                 resume=False)  # fmt: skip
        # "held": a live coordinator holds it.
        await attachments.attach("held", "a2", "", now, resume=False)
        # "api": opened through the API with no client connection: not ours to close.
        counts = await audit_leases(ctx)
        status = {
            sid: (await coordinator.authority.status(sid))["status"]
            for sid in ("gone", "held", "api")
        }
        assert status == {"gone": "closed", "held": "open", "api": "open"}
        assert counts.get("closed") == 1
    finally:
        await close_context(ctx)
        await coordinator.aclose()


# -- the journal judge -------------------------------------------------------------------


class JournalBuilder:
    """Writes a session's journal through the real scripts, as a client-facing stage."""

    def __init__(self, coordinator: Coordinator, sid: str) -> None:
        self.coordinator = coordinator
        self.sid = sid
        self.ownership = StageOwnership(coordinator.bus, ECHO, "echo", "w1", 60_000)
        self.lease: Lease | None = None
        self.seq = 0

    async def acquire(self) -> Fence:
        if self.lease is not None:
            await self.ownership.release(self.lease, hand_back=False)
        _, self.lease = await self.ownership.acquire(self.sid, 0)
        assert self.lease is not None
        return self.lease.fence

    async def delta(self, text: str, fence: Fence) -> None:
        assert self.lease is not None
        self.seq += 1
        out = OutputEvent(fence, "echo", OutputKind.TEXT_DELTA, self.seq, text=text)
        result = await self.ownership.publish(
            self.lease, [(fence, [out])], applied_seq=0, read_id="0-0", out_seq=self.seq
        )
        assert result.status.value == "ok", result


async def resumed_deltas(coordinator: Coordinator, sid: str, after_seq: int) -> list[str]:
    replay = await replay_journal(coordinator, sid, after_seq, ServerEventTranslator(["echo"]))
    return [e["delta"] for e in replay.events if e["type"] == "response.output_text.delta"]


async def test_a_resume_sends_nothing_cancelled_and_everything_still_owed(settings):
    """Cause: the epoch floor moved after the first resent event (a delta of a
    cancelled response came after its cancel), and the move to the current response
    dropped an older response of the current epoch still owed."""
    coordinator = Coordinator(settings, ECHO)
    journal = JournalBuilder(coordinator, "s1")
    auth = coordinator.authority
    try:
        await auth.open("s1")
        await journal.acquire()
        first = await auth.reserve_response("s1")
        await journal.delta("a", first)  # the client received this one (journal seq 1)
        await journal.delta("b", first)  # not received; its epoch is cancelled below
        cancel = await auth.cancel("s1")
        second = await auth.reserve_response("s1")
        await journal.delta("x", second)  # owed
        third = await auth.reserve_response("s1")
        await journal.delta("y", third)  # owed
        assert cancel.fence.epoch == 1
        # response.created, output_item.added, conversation.item.added,
        # content_part.added, then the delta "a": the fifth event of journal entry 1.
        received = 1 * SEQ_STRIDE + 4
        assert await resumed_deltas(coordinator, "s1", received) == ["x", "y"]
        assert await resumed_deltas(coordinator, "s1", 0) == ["x", "y"]
    finally:
        await coordinator.aclose()


async def test_a_resume_after_the_journal_was_trimmed_past_a_failover(settings):
    """Cause: the judge started at the session's first incarnation and, with the
    failover's barrier trimmed away, refused every output after it."""
    coordinator = Coordinator(settings, ECHO)
    journal = JournalBuilder(coordinator, "s1")
    try:
        await coordinator.authority.open("s1")
        await journal.delta("a", await journal.acquire())
        heir = await journal.acquire()  # the stage changed hands: incarnation 1
        assert heir.incarnation == 1
        await journal.delta("b", heir)
        sk = coordinator.bus.keys.session("s1")
        entries = await coordinator.bus.xrange(sk.client)
        await coordinator.bus.trim_before(sk.client, entries[-1].id)  # only "b" is left
        # The client received "a" (journal seq 1) and the failover's notice (2).
        assert await resumed_deltas(coordinator, "s1", 2 * SEQ_STRIDE) == ["b"]
    finally:
        await coordinator.aclose()


async def test_a_notice_keeps_its_seq_whatever_a_reader_delivered_before_it(settings):
    """A fence barrier's events are numbered by the barrier's own place in the journal.
    Cause: they continued the numbering of the last output the reader had delivered, so
    a live reader that had not delivered an output (judged it by an older view, or got
    it twice around a resume) numbered a failover notice lower than the resume's
    replay did, and the resume sent the client a notice it had already received."""
    from coordinator.output_reader import JournalFollower

    coordinator = Coordinator(settings, ECHO)
    journal = JournalBuilder(coordinator, "s1")
    auth = coordinator.authority
    try:
        await auth.open("s1")
        await journal.acquire()
        await journal.delta("a", await auth.reserve_response("s1"))
        await journal.delta("b", await auth.reserve_response("s1"))
        await journal.acquire()  # the stage changed hands: a failover notice
        entries = await coordinator.bus.xrange(coordinator.bus.keys.session("s1").client)

        def notice_seqs(skip: set[int]) -> list[int]:
            follower = JournalFollower("s1", Fence("s1"), metrics=False)
            translator = ServerEventTranslator(["echo"])
            seqs = []
            for index, entry in enumerate(entries):
                delivery = follower.judge(entry)
                if delivery is None or index in skip:
                    continue
                for event in translator.translate(delivery.event, delivery.server_event_seq):
                    if event["type"] == "duplexq.session.failover":
                        seqs.append(event["duplexq"]["seq"])
            return seqs

        [every] = notice_seqs(set())
        assert notice_seqs({1}) == [every]  # "b" not delivered by this reader
        # Resumed by a client that received the notice: it is not sent again.
        replay = await replay_journal(coordinator, "s1", every, ServerEventTranslator(["echo"]))
        assert [e["type"] for e in replay.events] == []
    finally:
        await coordinator.aclose()
