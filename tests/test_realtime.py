"""The realtime WebSocket API end to end: real uvicorn, real Redis, echo workers."""

import asyncio
import base64
import io
import json

import pytest
import websockets
from PIL import Image

from schemas.config import echo_pipeline
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import (
    Client,
    coordinator_process,
    sample,
    serving,
    streaming_echo,
    text_turn,
    until_completed,
)


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
        assert len(created["duplexq"]["resume_token"]) >= 22  # >= 128 bits
        for event in text_turn("hello there"):
            await client.send(event)
        events = await until_completed(client)
    types = [e["type"] for e in events]
    assert "response.created" in types
    assert _deltas(events) == "hello there"
    assert events[-1]["response"]["status"] == "completed"
    seqs = [e["duplexq"]["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all({"epoch", "turn_id", "response_seq"} <= set(e["duplexq"]["fence"]) for e in events)


async def test_auth_is_required(settings):
    async with serving(settings, echo_pipeline("echo")) as base:
        for key in (None, "wrong"):
            with pytest.raises(websockets.exceptions.InvalidStatus) as info:
                async with Client.connect(base, key=key):
                    pass
            assert info.value.response.status_code == 403
        # A key with characters outside ASCII is refused as a wrong one, not a crash.
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            headers = {"Authorization": "Bearer cl\u00e9"}
            async with websockets.connect(f"{base}/v1/realtime", additional_headers=headers):
                pass
        assert info.value.response.status_code == 403
        # A URL never carries a key: the query form is not accepted.
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            async with websockets.connect(f"{base}/v1/realtime?api_key=k1"):
                pass
        assert info.value.response.status_code == 403
        async with Client.connect(base, key="k1") as client:
            assert (await client.recv())["type"] == "session.created"


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
            {
                "type": "duplexq.input_video.append",
                "image": base64.b64encode(b"not an image").decode(),
            }
        ),
        "invalid_image",
    ),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 40_000}), "event_too_large"),
    (json.dumps({"type": "duplexq.session.resume", "resume_token": "x" * 20}), "invalid_event"),
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
        first = await until_completed(client)
        codes = []
        for raw, _ in BAD_INPUTS:
            await client.send(raw)
            codes.append((await client.until("error"))[-1]["error"]["code"])
        assert codes == [code for _, code in BAD_INPUTS]
        # An error names the client event it answers, when that had an id.
        await client.send({"type": "no.such.event", "event_id": "evt_client_7"})
        assert (await client.until("error"))[-1]["error"]["event_id"] == "evt_client_7"
        # A valid image is accepted; the session still answers.
        await client.send({"type": "duplexq.input_video.append", "image": _png()})
        for event in text_turn("still here"):
            await client.send(event)
        second = await until_completed(client)
    assert _deltas(first) == "kept"
    assert "still here" in _deltas(second)
    ids = [event["event_id"] for event in client.seen]
    assert all(ids) and len(set(ids)) == len(ids)


@pytest.mark.parametrize("how", ["response.cancel", "duplexq.barge_in"])
async def test_cancel_leaves_no_stale_delta_after_the_acknowledgement(settings, how):
    pipeline = streaming_echo()
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await client.recv()
        for event in text_turn("z" * 400):
            await client.send(event)
        await client.until("response.output_text.delta")
        await client.send({"type": how})
        cancelled = await client.until("response.done")
        assert cancelled[-1]["response"]["status"] == "cancelled"
        old_epoch = cancelled[-1]["duplexq"]["fence"]["epoch"] - 1
        for event in text_turn("next"):
            await client.send(event)
        after = await until_completed(client)
    deltas = [e for e in after if e["type"] == "response.output_text.delta"]
    assert all(e["duplexq"]["fence"]["epoch"] > old_epoch for e in deltas)
    assert _deltas(after) == "next"
    assert after[-1]["response"]["status"] == "completed"


async def test_backpressure_refuses_appends_until_the_stage_catches_up(settings):
    settings = settings.model_copy(update={"max_pending_input_bytes": 2048})
    pipeline = echo_pipeline("echo")
    chunk = base64.b64encode(b"\x00\x01" * 500).decode()
    async with serving(settings, pipeline) as base, Client.connect(base) as client:
        await client.recv()
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
        await client.send({"type": "input_audio_buffer.append", "audio": chunk})
        error = (await client.until("error"))[-1]
        assert error["error"]["code"] == "input_backpressure"
        # Once a worker applies what was accepted, the session takes input again.
        async with running_worker(settings, pipeline, "echo"):
            for _ in range(2):
                await client.until("response.output_audio.delta")
            for event in text_turn("flows again"):
                await client.send(event)
            events = await until_completed(client, within_s=20)
    assert "flows again" in _deltas(events)
    # Nothing accepted was lost: both accepted chunks were echoed as audio.
    audio = [e for e in client.seen if e["type"] == "response.output_audio.delta"]
    assert len(audio) == 2


async def test_session_limit_is_a_retryable_error(settings):
    settings = settings.model_copy(update={"max_sessions": 1})
    async with serving(settings, echo_pipeline("echo")) as base, Client.connect(base) as first:
        assert (await first.recv())["type"] == "session.created"
        async with Client.connect(base) as second:
            event = await second.recv()
            assert event["type"] == "error"
            assert event["error"]["code"] == "resource_exhausted"


async def test_resume_on_another_coordinator_process(settings, tmp_path):
    pipeline = streaming_echo(chunks=20, step_ms=10)
    async with (
        coordinator_process(settings, pipeline, tmp_path) as other_base,
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
    ):
        async with Client.connect(base) as first:
            token = (await first.recv())["duplexq"]["resume_token"]
            for event in text_turn("one"):
                await first.send(event)
            await until_completed(first)
            for event in text_turn("the second turn streams in chunks"):
                await first.send(event)
            await first.until("response.output_text.delta")
        # The connection dropped mid-response; the client resumes elsewhere.
        seen = first.seen
        last = max(e["duplexq"]["seq"] for e in seen)
        async with Client.connect(other_base) as second:
            assert (await second.resume(token, last))["type"] == "duplexq.session.resumed"
            rest = await until_completed(second)
            for event in text_turn("three"):
                await second.send(event)
            rest += await until_completed(second)
    events = seen + rest
    seqs = [e["duplexq"]["seq"] for e in events]
    assert seqs == sorted(set(seqs)), "an event was repeated or reordered"
    assert _deltas(events) == "one" + "the second turn streams in chunks" + "three"
    completed = [
        e["response"]["id"]
        for e in events
        if e["type"] == "response.done" and e["response"]["status"] == "completed"
    ]
    assert len(set(completed)) == len(completed) == 3


async def test_resume_with_a_wrong_token_is_refused(settings):
    async with serving(settings, echo_pipeline("echo")) as base, Client.connect(base) as client:
        await client.send({"type": "duplexq.session.resume", "resume_token": "x" * 43})
        event = await client.recv()
        assert event["type"] == "error"
        assert event["error"]["code"] == "resume_failed"


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_health_readiness_and_metrics(settings):
    pipeline = echo_pipeline("echo")
    async with serving(settings, pipeline) as base:
        http = base.replace("ws://", "http://")
        assert await asyncio.to_thread(_get, f"{http}/healthz") == (200, '{"status":"ok"}')
        status, body = await asyncio.to_thread(_get, f"{http}/readyz")
        assert status == 503 and json.loads(body)["workers"] == {"echo": 0}
        async with running_worker(settings, pipeline, "echo"), Client.connect(base) as client:
            async with asyncio.timeout(10):
                while (await asyncio.to_thread(_get, f"{http}/readyz"))[0] != 200:
                    await asyncio.sleep(0.05)
            await client.recv()
            _, before = await asyncio.to_thread(_get, f"{http}/metrics")
            for event in text_turn("measure me"):
                await client.send(event)
            await until_completed(client)
            # The answer is over: a response.cancel would be refused; a barge-in never is.
            await client.send({"type": "duplexq.barge_in"})
            await client.until("duplexq.response.cancelled")
            status, metrics = await asyncio.to_thread(_get, f"{http}/metrics")
    assert status == 200
    # One typed turn, measured once: from its commit to its answer's first output.
    first_output = ("duplexq_time_to_first_output_seconds_count", {"turn": "commit"})
    assert sample(metrics, *first_output) - sample(before, *first_output) == 1
    for name in (
        "duplexq_sessions",
        "duplexq_events_in_total",
        "duplexq_events_out_total",
        "duplexq_dropped_stale_total",
        "duplexq_stage_pending_entries",
        "duplexq_stage_lag_seconds",
        "duplexq_cancel_ack_seconds_count",
        "duplexq_time_to_first_output_seconds_count",
        "duplexq_failovers_total",
        "duplexq_barge_in_reaction_seconds",
    ):
        assert name in metrics, name


async def test_worker_metrics_endpoint():
    from dataplane.metrics import serve_metrics

    server = serve_metrics("127.0.0.1", 0)
    try:
        status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.close()
    assert status == 200 and "# TYPE duplexq_events_in_total counter" in body


async def test_detached_session_is_closed_after_the_grace_period(settings):
    settings = settings.model_copy(update={"resume_grace_s": 1})
    async with serving(settings, echo_pipeline("echo")) as base:
        async with Client.connect(base) as client:
            created = await client.recv()
        sid = created["session"]["id"]
        from dataplane.bus import RedisBus
        from schemas.keys import Keys

        bus = RedisBus(settings.redis_url, Keys(settings.key_prefix))
        try:
            meta = bus.keys.session(sid).meta
            assert await bus.client.hget(meta, "status") == b"open"
            async with asyncio.timeout(10):
                while await bus.client.hget(meta, "status") != b"closed":
                    await asyncio.sleep(0.05)
            # A late resume gets a clear error.
            async with Client.connect(base) as late:
                await late.send(
                    {
                        "type": "duplexq.session.resume",
                        "resume_token": created["duplexq"]["resume_token"],
                    }
                )
                event = await late.recv()
            assert event["error"]["code"] == "resume_failed"
        finally:
            await bus.aclose()


async def test_an_audio_turn_with_server_vad(settings):
    """Real speech over the WebSocket: server VAD ends the turn, ASR hears it, TTS answers."""
    import numpy as np

    from schemas.config import PipelineConfig, StageConfig
    from tests.speech import silence, speak
    from workers.backends.asr import AsrBackend
    from workers.backends.audio import encode_pcm
    from workers.backends.echo import EchoBackend
    from workers.backends.tts import TtsBackend
    from workers.backends.vad import VadBackend

    pipeline = PipelineConfig(
        name="voice",
        stages=(
            StageConfig(name="vad", backend="vad"),
            StageConfig(name="asr", backend="asr", input="vad", to_client=True),
            StageConfig(name="thinker", backend="echo", input="asr"),
            StageConfig(name="tts", backend="tts", input="thinker", to_client=True),
        ),
    )
    rate = 24_000
    audio = np.concatenate(
        [silence(0.3, rate), speak("good morning how are you today", rate), silence(1.2, rate)]
    )
    step = rate * 40 // 1000
    chunks = [encode_pcm(audio[i : i + step], "pcm_s16le") for i in range(0, len(audio), step)]
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "vad", backend=VadBackend({})),
        running_worker(settings, pipeline, "asr", backend=AsrBackend({})),
        running_worker(settings, pipeline, "thinker", backend=EchoBackend()),
        running_worker(settings, pipeline, "tts", backend=TtsBackend({"speak": ["transcript"]})),
        Client.connect(base) as client,
    ):
        await client.recv()
        for chunk in chunks:
            await client.send(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
            )
        events = await until_completed(client, within_s=90)
    types = [e["type"] for e in events]
    assert types.count("input_audio_buffer.speech_started") == 1
    assert types.index("input_audio_buffer.speech_started") < types.index(
        "input_audio_buffer.speech_stopped"
    )
    assert types.count("input_audio_buffer.committed") == 1
    heard = [
        e["transcript"]
        for e in events
        if e["type"] == "conversation.item.input_audio_transcription.completed"
    ]
    assert len(heard) == 1 and "morning" in heard[0].lower()
    # The server VAD's turn end reserved the model's turn, as a client commit does.
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert (
        committed["duplexq"]["fence"]["turn_id"],
        committed["duplexq"]["fence"]["response_seq"],
    ) == (1, 1)
    answer = next(e for e in events if e["type"] == "response.output_audio.delta")
    assert answer["duplexq"]["fence"]["turn_id"] == 1
    audio_out = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert sum(len(base64.b64decode(e["delta"])) for e in audio_out) > 24_000  # > 0.5 s


async def test_readiness_answers_at_once_when_redis_is_down(settings):
    import socket
    import time

    from coordinator.app import READY_WITHIN_S

    # A Redis that accepts connections and never answers: the slowest way to be down.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        down = settings.model_copy(
            update={"redis_url": f"redis://127.0.0.1:{silent.getsockname()[1]}/0"}
        )
        async with serving(down, echo_pipeline("echo")) as base:
            http = base.replace("ws://", "http://")
            began = time.monotonic()
            status, body = await asyncio.to_thread(_get, f"{http}/readyz")
            took = time.monotonic() - began
    assert status == 503
    assert json.loads(body) == {"ready": False, "redis": False, "workers": {}}
    # A limit, not a timing: the probe's own bound plus generous slack.
    assert took < READY_WITHIN_S + 5
