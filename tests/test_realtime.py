"""The realtime WebSocket API end to end: real uvicorn, real Redis, echo workers."""

import base64
import io
import json

import pytest
import websockets
from PIL import Image

from schemas.config import echo_pipeline
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import Client, serving, text_turn


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)


def _deltas(events):
    return "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")


async def test_text_turn(settings):
    pipeline = echo_pipeline("echo")
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        created = await client.recv()
        assert created["type"] == "session.created"
        assert len(created["resume_token"]) >= 22  # >= 128 bits
        for event in text_turn("hello there"):
            await client.send(event)
        events = await client.until("response.done")
    types = [e["type"] for e in events]
    assert "response.created" in types
    assert _deltas(events) == "hello there"
    assert events[-1]["response"]["status"] == "completed"
    seqs = [e["server_event_seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all({"epoch", "turn_id", "response_seq"} <= set(e["fence"]) for e in events)


async def test_auth_is_required(settings):
    async with serving(settings, echo_pipeline("echo")) as base:
        for key in (None, "wrong"):
            with pytest.raises(websockets.exceptions.InvalidStatus) as info:
                async with Client.connect(base, key=key):
                    pass
            assert info.value.response.status_code == 403
        async with websockets.connect(f"{base}/v1/realtime?api_key=k1") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"


def _png(size=(8, 8)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


BAD_INPUTS = [
    ("{not json", "invalid_json"),
    (json.dumps(["a", "list"]), "invalid_json"),
    (json.dumps({"type": "input_audio_buffer.sing"}), "unknown_event"),
    (json.dumps({"type": "conversation.item.create", "item": {"content": []}}), "invalid_event"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "***"}), "invalid_base64"),
    (
        json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(b"\x01\x02\x03").decode(),
            }
        ),
        "invalid_audio",
    ),
    (
        json.dumps(
            {"type": "input_video.append", "image": base64.b64encode(b"not an image").decode()}
        ),
        "invalid_image",
    ),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 40_000}), "event_too_large"),
    (json.dumps({"type": "session.resume", "resume_token": "x" * 20}), "invalid_event"),
]


async def test_bad_inputs_get_errors_and_the_session_survives(settings):
    settings = settings.model_copy(update={"max_event_bytes": 32_768})
    pipeline = echo_pipeline("echo")
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await client.recv()
        for event in text_turn("kept"):
            await client.send(event)
        first = await client.until("response.done")
        codes = []
        for raw, _ in BAD_INPUTS:
            await client.send(raw)
            codes.append((await client.until("error"))[-1]["error"]["code"])
        assert codes == [code for _, code in BAD_INPUTS]
        # A valid image is accepted; the session still answers.
        await client.send({"type": "input_video.append", "image": _png()})
        for event in text_turn("still here"):
            await client.send(event)
        second = await client.until("response.done")
    assert _deltas(first) == "kept"
    assert "still here" in _deltas(second)
