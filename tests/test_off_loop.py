"""Blocking inference runs off the event loop: the VAD's network, Whisper, PIL.

Each test slows the real model call down on purpose (a sleep around it) and
watches a task that ticks every millisecond on the same loop: had the call run
on the loop, the ticker would stall for the whole call.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from schemas.config import echo_pipeline
from schemas.events import (
    AudioPayload,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
)
from schemas.fence import Fence
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import Client, serving, text_turn, until_completed
from tests.speech import chunks, silence, speak
from workers.backends.asr import AsrBackend, WhisperTranscriber
from workers.backends.audio import encode_pcm, resample
from workers.backends.base import OutputDraft, StageContext
from workers.backends.vad import SileroModel, VadBackend

SID = "s1"


@contextlib.asynccontextmanager
async def loop_gaps() -> AsyncIterator[list[float]]:
    """Gaps between the turns of a task sleeping 1 ms at a time: the longest is the
    longest the loop was blocked."""
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    last = loop.time()

    async def tick() -> None:
        nonlocal last
        while True:
            await asyncio.sleep(0.001)
            now = loop.time()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(tick())
    try:
        yield gaps
    finally:
        gaps.append(loop.time() - last)  # the gap still open when the block ends
        task.cancel()
        await asyncio.wait([task])


# -- vad -------------------------------------------------------------------------------


def audio_event(seq: int, payload: AudioPayload) -> InputEvent:
    return InputEvent(Fence(SID), seq, seq, InputMode.APPEND_AUDIO_CHUNK, payload)


def utterance() -> list[AudioPayload]:
    """Two events: silence then the start of speech; the rest of it then silence."""
    audio = np.concatenate([silence(0.3), speak("hello world this is a test"), silence(1.0)])
    return [chunks(audio, ms=1000)[0], chunks(audio[16000:], ms=len(audio))[0]]


def vad_context(emitted: list[OutputDraft], reasons: list[str]) -> StageContext:
    async def barge_in(reason: str) -> Fence:
        reasons.append(reason)
        return Fence(SID, 0, len(reasons))

    return StageContext(SID, "vad", Fence(SID), {}, interrupt=barge_in, emit=emitted.append)


def shape(drafts: list[OutputDraft]) -> list[tuple[OutputKind, bytes, dict[str, object]]]:
    return [(d.kind, d.data, dict(d.meta)) for d in drafts]


async def test_vad_runs_the_network_off_the_loop(monkeypatch):
    real = SileroModel.probability

    def slow(self, window, state):
        time.sleep(0.005)
        return real(self, window, state)

    monkeypatch.setattr(SileroModel, "probability", slow)
    backend = VadBackend({"interrupt_response": False})
    ctx = StageContext(SID, "vad", Fence(SID), {})
    await backend.start(ctx, [], [])
    audio = np.concatenate([silence(0.3), speak("hello world this is a test"), silence(1.0)])
    event = audio_event(1, chunks(audio, ms=len(audio))[0])
    started = time.monotonic()
    async with loop_gaps() as gaps:
        drafts = [d async for d in backend.handle(ctx, event)]
    took = time.monotonic() - started
    windows = len(audio) // 512
    assert took >= windows * 0.005  # every window was slow ...
    assert max(gaps) < 0.1, max(gaps)  # ... and the loop kept turning
    kinds = [d.kind for d in drafts]
    assert kinds[:2] == [OutputKind.SPEECH_STARTED, OutputKind.SPEECH_STOPPED]
    assert kinds[-1] is OutputKind.DONE


async def test_a_vad_call_cancelled_mid_detection_loses_nothing(monkeypatch):
    first, second = utterance()
    emitted: list[OutputDraft] = []
    reasons: list[str] = []
    reference = VadBackend()
    ctx = vad_context(emitted, reasons)
    await reference.start(ctx, [], [])
    for seq, payload in enumerate((first, second), 1):
        emitted += [d async for d in reference.handle(ctx, audio_event(seq, payload))]
    assert reasons == ["speech_started"]
    expected = shape(emitted)

    real = SileroModel.probability
    entered, gate = threading.Event(), threading.Event()

    def held(self, window, state):
        entered.set()
        gate.wait(10)
        return real(self, window, state)

    monkeypatch.setattr(SileroModel, "probability", held)
    emitted, reasons = [], []
    backend = VadBackend()
    ctx = vad_context(emitted, reasons)
    await backend.start(ctx, [], [])

    async def drain(seq: int, payload: AudioPayload) -> list[OutputDraft]:
        return [d async for d in backend.handle(ctx, audio_event(seq, payload))]

    task = asyncio.create_task(drain(1, first))
    async with asyncio.timeout(5):
        while not entered.is_set():
            await asyncio.sleep(0.001)
    task.cancel()  # a cancel released the fence while the network was running
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    # The next event hands out the first one's drafts first, and barges in for it.
    emitted += await drain(2, second)
    assert reasons == ["speech_started"]
    assert shape(emitted) == expected


# -- asr -------------------------------------------------------------------------------


async def test_asr_transcribes_off_the_loop(monkeypatch):
    backend = AsrBackend()
    await backend.transcriber()  # loaded beforehand (in a thread as well)
    real = WhisperTranscriber.transcribe

    def slow(self, samples, language, beam_size):
        time.sleep(0.5)
        return real(self, samples, language, beam_size)

    monkeypatch.setattr(WhisperTranscriber, "transcribe", slow)
    speech = np.concatenate([silence(0.3), speak("good morning how are you today"), silence(0.3)])
    rate = 48_000  # resampled to 16 kHz in the same hop
    meta: dict[str, str | int | float | bool] = {
        "format": "pcm_s16le",
        "sample_rate": rate,
        "last": True,
    }
    delta = OutputEvent(
        Fence(SID), "vad", OutputKind.AUDIO_DELTA, 1,
        data=encode_pcm(resample(speech, 16_000, rate)), meta=meta,
    )  # fmt: skip
    ctx = StageContext(SID, "asr", Fence(SID), {})
    await backend.start(ctx, [], [])
    started = time.monotonic()
    async with loop_gaps() as gaps:
        drafts = [d async for d in backend.handle(ctx, delta)]
    assert time.monotonic() - started >= 0.5
    assert max(gaps) < 0.1, max(gaps)
    assert [d.kind for d in drafts] == [OutputKind.TRANSCRIPT]
    assert "good morning" in drafts[0].text.lower()


# -- the coordinator's image check ------------------------------------------------------


def _png(size: tuple[int, int] = (64, 64)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def test_the_coordinator_verifies_images_off_the_loop(redis_server, key_prefix, monkeypatch):
    real = PngImagePlugin.PngImageFile.verify
    verified: list[float] = []

    def slow(self):
        time.sleep(0.5)
        verified.append(time.monotonic())
        return real(self)

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "verify", slow)
    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",),
                             first_event_wait_ms=50)  # fmt: skip
    pipeline = echo_pipeline("echo")
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await client.recv()
        async with loop_gaps() as gaps:
            await client.send({"type": "duplexq.input_video.append", "image": _png()})
            for event in text_turn("after the frame"):
                await client.send(event)
            events = await until_completed(client)
    assert len(verified) == 1
    assert max(gaps) < 0.1, max(gaps)  # the server, in this loop, kept serving
    assert not [e for e in client.seen if e["type"] == "error"]
    deltas = "".join(e.get("delta", "") for e in events)
    assert "[1 frame(s)]" in deltas and "after the frame" in deltas
