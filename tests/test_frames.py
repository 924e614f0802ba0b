"""The WebSocket itself, on every stack uvicorn serves it with: a binary frame and an
oversized event are answered with an error and the connection goes on; a client that
stops reading is closed with 4008 (or dropped, if it never reads again) and its session
stays resumable; the keep-alive waits longer than that. Real uvicorn, real Redis, echo
workers."""

import asyncio
import contextlib
import socket

import pytest
import websockets

from coordinator.outbound import OVERFLOW_CLOSE_CODE
from coordinator.server_options import PING_TIMEOUT_S, websocket_options
from schemas.config import Settings
from schemas.keys import Keys
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import Client, serving, streaming_echo, text_turn, until_completed

STACKS = [
    # uvicorn's default with websockets installed.
    "websockets-sansio",
    # The legacy stack (``--ws websockets``) warns that it is deprecated; it still serves.
    pytest.param(
        "websockets",
        marks=[
            pytest.mark.filterwarnings("ignore::DeprecationWarning"),
            pytest.mark.filterwarnings("ignore::uvicorn.config.UvicornDeprecationWarning"),
        ],
    ),
]


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)


def test_the_server_options_leave_a_stalled_client_to_the_4008_close():
    defaults = Settings()
    options = websocket_options(defaults)
    assert PING_TIMEOUT_S == 60 and options["ws_ping_timeout"] == PING_TIMEOUT_S
    assert options["ws_max_size"] == 4 * defaults.max_event_bytes
    assert (defaults.client_send_timeout_ms, defaults.client_close_wait_ms) == (5000, 10_000)
    # A client that stops reading is let go before the keep-alive would drop it.
    stall_s = (defaults.client_send_timeout_ms + defaults.client_close_wait_ms) / 1000
    assert stall_s < options["ws_ping_interval"] + PING_TIMEOUT_S


async def _answered(client: Client, event_id: str) -> dict:
    async with asyncio.timeout(10):
        while True:
            event = await client.recv()
            if event["type"] == "error" and event["error"].get("event_id") == event_id:
                return event


@pytest.mark.parametrize("stack", STACKS)
async def test_a_binary_frame_gets_invalid_event_and_the_connection_goes_on(settings, stack):
    pipeline = streaming_echo(chunks=2, step_ms=0)
    async with (
        serving(settings, pipeline, ws=stack) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        assert (await client.recv())["type"] == "session.created"
        await client.ws.send(b'{"type": "response.create", "event_id": "bin1"}')
        error = (await _answered(client, "bin1"))["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_event"
        assert "binary" in error["message"]
        for event in text_turn("still here"):
            await client.send(event)
        await until_completed(client)


@pytest.mark.parametrize("stack", STACKS)
async def test_an_oversized_event_gets_event_too_large_and_the_connection_goes_on(settings, stack):
    pipeline = streaming_echo(chunks=2, step_ms=0)
    limit = settings.max_event_bytes
    async with (
        serving(settings, pipeline, ws=stack) as base,
        running_worker(settings, pipeline, "echo"),
    ):
        async with Client.connect(base) as client:
            assert (await client.recv())["type"] == "session.created"
            big = '{"type": "response.create", "event_id": "big1", "pad": "%s"}'
            await client.send(big % ("x" * (3 * limit)))
            error = (await _answered(client, "big1"))["error"]
            assert error["code"] == "event_too_large"
            for event in text_turn("still here"):
                await client.send(event)
            await until_completed(client)
        # Beyond four times the limit the server refuses the frame itself: close 1009.
        async with Client.connect(base) as client:
            await client.recv()
            await client.send(big % ("x" * (4 * limit)))
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                while True:
                    await client.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


@contextlib.asynccontextmanager
async def _stalled_client(base: str, settings: Settings):
    """A client that stops reading while twelve long answers stream to it: its socket
    has a small receive window and its library buffers one message, so the server's
    writes wait once their buffers are full. Yields the client and its session's meta
    key."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    sock.setblocking(False)
    async with websockets.connect(
        f"{base}/v1/realtime", additional_headers={"Authorization": "Bearer k1"}, sock=sock,
        max_queue=1, max_size=None, compression=None,
    ) as ws:  # fmt: skip
        client = Client(ws)
        created = await client.recv()
        meta = Keys(settings.key_prefix).session(created["session"]["id"]).meta
        for n in range(12):
            content = [{"type": "input_text", "text": f"<{n}.{p}>" + "x" * 30_000}
                       for p in range(6)]  # fmt: skip
            await client.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": content}})  # fmt: skip
            await client.send({"type": "response.create"})
        yield client, meta


@pytest.mark.parametrize("stack", STACKS)
async def test_a_client_that_stops_reading_gets_4008_when_it_reads_again(
    settings, redis_client, stack
):
    # A short send timeout: the test waits it out. The defaults are asserted above.
    settings = settings.model_copy(update={"client_send_timeout_ms": 500})
    pipeline = streaming_echo(chunks=64, step_ms=0)
    async with (
        serving(settings, pipeline, ws=stack) as base,
        running_worker(settings, pipeline, "echo"),
        _stalled_client(base, settings) as (client, meta),
    ):
        await asyncio.sleep(3)  # the answers stream, the server's send times out
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            while True:
                await client.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == OVERFLOW_CLOSE_CODE
        async with asyncio.timeout(10):
            while await redis_client.hget(meta, "att") != b"":
                await asyncio.sleep(0.05)
        assert await redis_client.hget(meta, "status") == b"open"  # resumable


@pytest.mark.parametrize("stack", STACKS)
async def test_a_client_that_never_reads_again_is_dropped_and_its_session_kept(
    settings, redis_client, stack
):
    # Short timeouts so that the test need not wait the defaults (asserted above) out.
    settings = settings.model_copy(
        update={"client_send_timeout_ms": 500, "client_close_wait_ms": 1000}
    )
    pipeline = streaming_echo(chunks=64, step_ms=0)
    async with (
        serving(settings, pipeline, ws=stack) as base,
        running_worker(settings, pipeline, "echo"),
        _stalled_client(base, settings) as (client, meta),
    ):
        # Detached well before the keep-alive (20 s + 60 s) could drop it.
        async with asyncio.timeout(15):
            while await redis_client.hget(meta, "att") != b"":
                await asyncio.sleep(0.05)
        assert await redis_client.hget(meta, "status") == b"open"
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            while True:
                await client.recv()
        assert closed.value.rcvd is None or closed.value.rcvd.code == OVERFLOW_CLOSE_CODE
