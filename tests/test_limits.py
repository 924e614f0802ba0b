"""Every per-connection and per-key limit, hit on purpose: the event is refused (or the
connection closed with a clear code) and the session or the server goes on. The rules
themselves are tested without I/O first; then real uvicorn, real Redis, echo workers."""

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys

import pytest
import websockets

from coordinator.limits import InputBudget, TokenBucket, input_bytes
from coordinator.outbound import OVERFLOW_CLOSE_CODE
from schemas.config import Settings, echo_pipeline
from schemas.keys import Keys
from schemas.realtime import client_event_adapter
from tests.pipeline_helpers import fast_settings, running_worker
from tests.processes import ROOT, write_pipeline
from tests.realtime_helpers import Client, serving, streaming_echo, text_turn, until_completed
from tests.redis_server import free_port


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(
        redis_server.url, key_prefix, api_keys=("k1", "k2"), first_event_wait_ms=50
    )


# -- the rules, no I/O -------------------------------------------------------------------


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.5) and not bucket.take(0.5)  # one token per half second
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]  # capped


def test_every_event_costs_at_least_the_minimum_and_is_released_once_applied():
    budget = InputBudget(limit=1000, min_cost=100)
    commit = client_event_adapter.validate_python({"type": "input_audio_buffer.commit"})
    audio = client_event_adapter.validate_python(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0" * 600).decode()}
    )
    assert input_bytes(audio) == 600 and budget.cost(audio) == 600
    assert input_bytes(commit) == 0 and budget.cost(commit) == 100
    budget.charge(1, 600)
    for seq in range(2, 6):
        budget.charge(seq, 100)
    assert budget.pending == 1000 and not budget.fits(100)
    budget.release(2)
    assert budget.pending == 300 and budget.fits(700) and not budget.fits(701)


# -- event rate ----------------------------------------------------------------------------


async def _errors_for(client: Client, ids: set[str], within_s: float = 10) -> dict[str, str]:
    """Read until an error answered each of ``ids``; returns event id -> error code."""
    got: dict[str, str] = {}
    async with asyncio.timeout(within_s):
        while not ids <= set(got):
            event = await client.recv()
            if event["type"] == "error" and event["error"].get("event_id"):
                got[event["error"]["event_id"]] = event["error"]["code"]
    return got


async def test_events_beyond_the_rate_are_refused_and_the_connection_lives(settings):
    settings = settings.model_copy(update={"max_events_per_s": 2.0, "event_burst": 4})
    pipeline = echo_pipeline("echo")
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await client.recv()
        for n in range(10):
            await client.send({"type": "input_audio_buffer.clear", "event_id": f"c{n}"})
        refused = await _errors_for(client, {"c9"})
        assert set(refused.values()) == {"rate_limited"}
        assert len(refused) >= 5  # 4 in the burst, maybe 1 refilled meanwhile
        await asyncio.sleep(1.2)  # the bucket refills; the connection is still served
        for event in text_turn("still here"):
            await client.send(event)
        events = await until_completed(client)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "still here"


# -- input budget ---------------------------------------------------------------------------


async def test_zero_byte_events_count_against_the_input_budget(settings):
    settings = settings.model_copy(
        update={"max_pending_input_bytes": 2048, "min_event_cost_bytes": 256}
    )
    pipeline = echo_pipeline("echo")
    async with serving(settings, pipeline) as base, Client.connect(base) as client:
        await client.recv()
        # No worker applies anything: 8 clears fill the budget, the 9th is refused.
        for n in range(9):
            await client.send({"type": "input_audio_buffer.clear", "event_id": f"c{n}"})
        assert await _errors_for(client, {"c8"}) == {"c8": "input_backpressure"}
        # Control goes before data: a barge-in is counted, never refused.
        await client.send({"type": "duplexq.barge_in", "event_id": "b"})
        await client.send({"type": "input_audio_buffer.clear", "event_id": "c9"})
        assert await _errors_for(client, {"c9"}) == {"c9": "input_backpressure"}
        # Once a worker applies what was accepted, the session takes input again.
        async with running_worker(settings, pipeline, "echo"):
            async with asyncio.timeout(20):
                for attempt in range(200):
                    item = text_turn("flows")[0]
                    await client.send({**item, "event_id": f"t{attempt}"})
                    event = await client.recv()
                    while event["type"] not in ("error", "conversation.item.created"):
                        event = await client.recv()
                    if event["type"] == "conversation.item.created":
                        break
                    assert event["error"]["code"] == "input_backpressure"
                    await asyncio.sleep(0.1)
            await client.send({"type": "response.create"})
            events = await until_completed(client)
    assert "flows" in "".join(e.get("delta", "") for e in events)


# -- live sessions, per key and in total ----------------------------------------------------


async def _refused(base: str, key: str = "k1") -> bool:
    """Whether opening a session is refused with ``session_limit`` and close code 1013."""
    async with Client.connect(base, key=key) as client:
        event = await client.recv()
        if event["type"] == "session.created":
            return False
        assert event["error"]["code"] == "session_limit"
        await client.ws.wait_closed()
        assert client.ws.close_code == 1013
        return True


async def test_sessions_count_per_key_attached_or_not_until_their_grace_ends(settings):
    settings = settings.model_copy(
        update={"max_sessions_per_key": 2, "resume_grace_s": 1, "attach_ttl_ms": 300}
    )
    async with serving(settings, echo_pipeline("echo")) as base:
        async with Client.connect(base) as first, Client.connect(base) as second:
            assert (await first.recv())["type"] == "session.created"
            assert (await second.recv())["type"] == "session.created"
            assert await _refused(base)
            assert not await _refused(base, key="k2")  # another key has its own count
        # Both detached: within their resume grace they still count.
        assert await _refused(base)
        await asyncio.sleep(1.6)  # the grace ran out: closed, counted no more
        async with Client.connect(base) as again:
            assert (await again.recv())["type"] == "session.created"


async def test_sessions_of_a_crashed_coordinator_stop_counting(settings, tmp_path):
    """The total counts sessions on every coordinator; one killed with SIGKILL stops
    renewing its sessions, which leave the count once their grace could have closed
    them, with nothing run for them."""
    settings = settings.model_copy(
        update={"max_sessions_total": 2, "resume_grace_s": 1, "attach_ttl_ms": 300}
    )
    pipeline = echo_pipeline("echo")
    port = free_port()
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "coordinator.launcher.cli", "coordinator",
            "--pipeline", str(write_pipeline(tmp_path, pipeline)), "--port", str(port)]  # fmt: skip
    crashed = subprocess.Popen(args, cwd=ROOT, env=env)
    try:
        other = f"ws://127.0.0.1:{port}"
        async with asyncio.timeout(30):
            while True:
                try:
                    async with Client.connect(other) as client:
                        assert (await client.recv())["type"] == "session.created"
                        crashed.send_signal(signal.SIGKILL)
                        crashed.wait(10)
                    break
                except OSError:
                    await asyncio.sleep(0.1)
    finally:
        if crashed.poll() is None:
            crashed.kill()
            crashed.wait(10)
    async with serving(settings, pipeline) as base, Client.connect(base) as mine:
        assert (await mine.recv())["type"] == "session.created"
        # The first coordinator's session (and the refused attempt's none) still counts.
        assert await _refused(base, key="k2")
        await asyncio.sleep(1.6)  # its attachment lapsed and its grace ran out
        assert not await _refused(base, key="k2")


# -- outbound queue ------------------------------------------------------------------------


async def test_a_client_that_stops_reading_is_disconnected_and_resumes_losing_nothing(
    settings, redis_client
):
    settings = Settings.model_validate(
        {**settings.model_dump(), "max_outbound_events": 32, "read_batch": 8}
    )
    pipeline = streaming_echo(chunks=64, step_ms=0)
    # Twelve answers of 180 kB each (a text part holds at most 32768 characters),
    # uncompressed: more than the kernel's socket buffers hold.
    parts = [[f"<{n}.{p}>" + "x" * 30_000 for p in range(6)] for n in range(12)]
    texts = ["".join(p) for p in parts]
    keys = Keys(settings.key_prefix)
    roomy = Settings.model_validate({**settings.model_dump(), "max_outbound_events": 4096})
    async with (
        serving(settings, pipeline) as base,
        serving(roomy, pipeline) as other,
        running_worker(settings, pipeline, "echo"),
    ):
        # A socket with a small receive window, and a client that buffers one message:
        # once it stops reading, the server's writes block and its queue fills.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        sock.setblocking(False)
        headers = {"Authorization": "Bearer k1"}
        async with websockets.connect(
            f"{base}/v1/realtime", additional_headers=headers, sock=sock, max_queue=1,
            max_size=None, compression=None,
        ) as ws:  # fmt: skip
            client = Client(ws)
            created = await client.recv()
            token, meta = (
                created["duplexq"]["resume_token"],
                keys.session(created["session"]["id"]).meta,
            )
            for answer in parts:
                content = [{"type": "input_text", "text": part} for part in answer]
                await client.send({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": content}})  # fmt: skip
                await client.send({"type": "response.create"})
            # The coordinator closes the connection: the session is detached, not closed.
            async with asyncio.timeout(30):
                while await redis_client.hget(meta, "att") != b"":
                    await asyncio.sleep(0.05)
            assert await redis_client.hget(meta, "status") == b"open"
            # The client reads again: what was sent, then the end of the connection. The
            # coordinator closed it with 4008; when the client's unread input was still
            # in flight, the close frame can be lost to a TCP reset.
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                while True:
                    await client.recv()
            assert closed.value.rcvd is None or closed.value.rcvd.code == OVERFLOW_CLOSE_CODE
        # The client resumes (on a coordinator whose queues hold its backlog).
        last = max(e["duplexq"]["seq"] for e in client.seen)
        async with Client.connect(other) as resumed:
            assert (await resumed.resume(token, last))["type"] == "duplexq.session.resumed"
            # Inputs the closed connection had not read were never accepted; one more
            # turn marks the end of what was.
            for event in text_turn("<end>"):
                await resumed.send(event)
            async with asyncio.timeout(30):
                while not _text(resumed.seen).endswith("<end>"):
                    await resumed.recv()
                await resumed.until("response.done")
    events = client.seen + resumed.seen
    accepted = sum(e["type"] == "conversation.item.created" for e in events) - 1
    assert accepted >= 1
    # Every delta of every accepted input exactly once, in order.
    assert _text(events) == "".join(texts[:accepted]) + "<end>"


def _text(events):
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


# -- error journaling ----------------------------------------------------------------------


async def test_errors_beyond_the_journaling_allowance_go_to_the_socket_only(settings):
    settings = settings.model_copy(
        update={"journaled_error_burst": 3, "journaled_errors_per_s": 0.01}
    )
    pipeline = echo_pipeline("echo")
    async with serving(settings, pipeline) as base, running_worker(settings, pipeline, "echo"):
        async with Client.connect(base) as client:
            token = (await client.recv())["duplexq"]["resume_token"]
            for n in range(10):
                await client.send({"type": "no.such.event", "event_id": f"e{n}"})
            answered = await _errors_for(client, {f"e{n}" for n in range(10)})
            assert set(answered.values()) == {"unknown_event"}
            # The three journaled errors have their places in the session; the socket-only
            # ones none (with the last event's seq, a client would drop them as seen).
            errors = [e for e in client.seen if e["type"] == "error"]
            seqs = [e["duplexq"]["seq"] for e in errors if "seq" in e.get("duplexq", {})]
            assert len(seqs) == 3 and seqs == sorted(set(seqs))
            assert sum("seq" not in e.get("duplexq", {}) for e in errors) == 7
        # A resume replays the journal: only the first three errors are in it.
        async with Client.connect(base) as resumed:
            assert (await resumed.resume(token, 0))["type"] == "duplexq.session.resumed"
            for event in text_turn("after errors"):
                await resumed.send(event)
            events = await until_completed(resumed)
    replayed = [e["error"]["event_id"] for e in events if e["type"] == "error"]
    assert replayed == ["e0", "e1", "e2"]
    assert "after errors" in "".join(e.get("delta", "") for e in events)
