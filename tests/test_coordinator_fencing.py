"""Coordinators are fenced like workers: a connection that no longer serves its session
changes nothing.

Which connection serves a session is its attachment in Redis (``coordinator.
attachments``); every write a connection makes names its attachment and the script
refuses it once another connection took the session, in the same atomic step as the
write. These tests pause a real coordinator process with SIGSTOP while its client
resumes elsewhere, then wake it with input still buffered in its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
import websockets

from coordinator.service import Coordinator
from schemas.config import echo_pipeline
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import (
    Client,
    coordinator_child,
    serving,
    text_turn,
    until_completed,
)

pytestmark = pytest.mark.timeout(90)

ECHO = echo_pipeline("echo")


async def closed_with(client: Client, within_s: float = 10) -> int | None:
    """Wait for the server to close ``client``'s socket; its close code (None: still
    open after ``within_s``)."""
    with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
        async with asyncio.timeout(within_s):
            while True:
                await client.recv(within_s)
    return client.ws.close_code


def answer(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def test_a_paused_coordinator_that_wakes_appends_nothing_its_socket_had_buffered(
    redis_server, key_prefix, tmp_path
):
    """Cause: the input path never checked which connection serves the session; a
    coordinator woken from SIGSTOP appended the input its old socket had buffered after
    the newer inputs and the cancel its client had sent on another coordinator."""
    # A long attachment TTL: the woken coordinator's own hold check (every third of it)
    # is not due when it wakes, so it reads the buffered input first and only the input
    # path's check stands between that input and the session log. The nemesis suite's
    # pause_coordinator class runs the shipped TTL.
    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",),
                             attach_ttl_ms=30_000)  # fmt: skip
    async with (
        contextlib.AsyncExitStack() as stack,
        coordinator_child(settings, ECHO, tmp_path, log=tmp_path / "old.log") as (old_base, proc),
        serving(settings, ECHO) as new_base,
        running_worker(settings, ECHO, "echo"),
        Client.connect(old_base) as old,
    ):
        created = await old.recv()
        sid = created["session"]["id"]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            for event in text_turn("stale input"):
                await old.send(event)  # waits in the socket: the coordinator is stopped
            new = await stack.enter_async_context(Client.connect(new_base))
            resumed = await new.resume(created["duplexq"]["resume_token"], 0)
            assert resumed["type"] == "duplexq.session.resumed"
            for event in text_turn("fresh input"):
                await new.send(event)
            assert answer(await until_completed(new)) == "fresh input"
            await new.send({"type": "duplexq.barge_in"})
            await new.until("duplexq.response.cancelled")
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert await closed_with(old) == 4000
        for event in text_turn("still served"):
            await new.send(event)
        assert answer(await until_completed(new)) == "still served"
    coordinator = Coordinator(settings, ECHO)
    try:
        log = await coordinator.bus.xrange(coordinator.bus.keys.session(sid).input)
    finally:
        await coordinator.aclose()
    texts = [entry.event for entry in log]
    assert any(b"fresh input" in t for t in texts)
    assert not any(b"stale input" in t for t in texts), "the woken coordinator appended"


class FakeConnection:
    """What the hub's hold round reads of a connection, and whether it was closed."""

    def __init__(self, session_id: str, attachment: str) -> None:
        self.session_id = session_id
        self.attachment = attachment
        self.key_digest = ""
        self.evicted: list[str] = []

    async def evict(self, reason: str) -> None:
        self.evicted.append(reason)


async def test_the_hold_check_closes_only_the_connection_it_checked(redis_server, key_prefix):
    """Cause: the hold round asked Redis about the old connection but closed whichever
    connection was registered for the session when Redis answered: a resume on the same
    coordinator meanwhile was closed with 4000 (which tells a client to give up)."""
    from coordinator.hub import Hub

    settings = fast_settings(redis_server.url, key_prefix)
    hub = Hub(settings, ECHO)
    try:
        await hub.coordinator.open("s1")
        await hub.attachments.attach("s1", "old", "", 0, resume=False, fresh="t0")
        old, fresh = FakeConnection("s1", "old"), FakeConnection("s1", "fresh")
        hub.connections["s1"] = old  # type: ignore[assignment]
        await hub.attachments.attach("s1", "fresh", "", 0, resume=True, token="t0", fresh="t1")
        round_ = asyncio.create_task(hub.hold_once())
        await asyncio.sleep(0)  # the round has asked Redis about "old"
        hub.connections["s1"] = fresh  # type: ignore[assignment]  # and registered
        await round_
        assert old.evicted and not fresh.evicted
    finally:
        await hub.stop()
