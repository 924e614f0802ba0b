"""Audio turns and session settings, driven through the official SDK.

A voice pipeline of real stages (Silero VAD, Whisper ASR, espeak-ng TTS) with a
thinker that repeats what it heard, behind a served coordinator; the client is
``AsyncOpenAI().realtime.connect``. Every standard server event received is
validated against the SDK's server-event union.
"""

from __future__ import annotations

import base64
import contextlib
import re
import warnings
from typing import Any

import numpy as np
import pytest

from dataplane.metrics import value
from tests.speech import silence, speak
from tests.voice_helpers import (
    RATE,
    is_done,
    is_updated,
    of_type,
    receive,
    voice_session,
    voice_settings,
)
from workers.backends.audio import encode_pcm

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def settings(redis_server, key_prefix):
    return voice_settings(redis_server.url, key_prefix)


async def say(connection: Any, samples: np.ndarray, *, fmt: str = "pcm_s16le") -> None:
    step = RATE * 40 // 1000
    for i in range(0, len(samples), step):
        data = encode_pcm(samples[i : i + step], fmt)
        await connection.input_audio_buffer.append(audio=base64.b64encode(data).decode())


def utterance(text: str) -> np.ndarray:
    return np.concatenate([silence(0.3, RATE), speak(text, RATE), silence(1.2, RATE)])


FIRST_OUTPUT = "duplexq_time_to_first_output_seconds_count"
"""Turns measured by the coordinator serving the voice session (in this process)."""


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


async def test_an_audio_turn_with_server_vad_is_heard_committed_and_answered(settings):
    seen: list[dict[str, Any]] = []
    voice_turns = value(FIRST_OUTPUT, turn="server_vad")
    async with voice_session(settings) as connection:
        await receive(connection, seen, lambda e: e["type"] == "session.created")
        await say(connection, utterance("good morning how are you today"))
        await receive(connection, seen, is_done)
    # The turn the server VAD ended is measured once, to its answer's first output.
    assert value(FIRST_OUTPUT, turn="server_vad") - voice_turns == 1
    kinds = [e["type"] for e in seen]
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed",
             "conversation.item.input_audio_transcription.completed",
             "response.created", "response.output_audio.delta", "response.done"]  # fmt: skip
    positions = [kinds.index(kind) for kind in order]
    assert positions == sorted(positions), kinds
    assert kinds.count("input_audio_buffer.committed") == 1
    # One item id names the utterance from its start to its transcript.
    named = [e["item_id"] for e in seen if e["type"] in order[:4]]
    assert len(set(named)) == 1, named
    heard = of_type(seen, "conversation.item.input_audio_transcription.completed")[0]
    assert words(heard["transcript"]) == ["good", "morning", "how", "are", "you", "today"]
    response = seen[-1]["response"]
    assert response["status"] == "completed"
    parts = [part["type"] for item in response["output"] for part in item["content"]]
    assert "output_audio" in parts


async def test_with_turn_detection_off_only_the_clients_commit_ends_the_turn(settings):
    seen: list[dict[str, Any]] = []
    async with voice_session(settings) as connection:
        await receive(connection, seen, lambda e: e["type"] == "session.created")
        await connection.session.update(session={
            "type": "realtime", "audio": {"input": {"turn_detection": None}}})  # fmt: skip
        await receive(connection, seen, is_updated)
        await say(connection, utterance("please book a table for two"))
        # Speech and a long silence: with detection off nothing is announced or answered.
        with contextlib.suppress(TimeoutError):
            await receive(connection, seen, lambda e: True, within_s=2.0)
        assert [e["type"] for e in seen[2:]] == []
        await connection.input_audio_buffer.commit()
        await receive(connection, seen, is_done)
    kinds = [e["type"] for e in seen]
    assert not [k for k in kinds if k.startswith("input_audio_buffer.speech_")]
    committed = of_type(seen, "input_audio_buffer.committed")
    assert len(committed) == 1
    heard = of_type(seen, "conversation.item.input_audio_transcription.completed")
    assert [e["item_id"] for e in heard] == [committed[0]["item_id"]]
    assert words(heard[0]["transcript"]) == ["please", "book", "a", "table", "for", "two"]
    assert seen[-1]["response"]["status"] == "completed"
    # The committed speech joined the conversation as the user's item, added then done.
    spoken = [e for e in seen if e["type"].startswith("conversation.item.")
              and e.get("item", {}).get("role") == "user"]  # fmt: skip
    assert [(e["type"], e["item"]["id"]) for e in spoken] == [
        ("conversation.item.added", committed[0]["item_id"]),
        ("conversation.item.done", committed[0]["item_id"]),
    ]


@pytest.mark.parametrize("kind", ["audio/pcmu", "audio/pcma"])
async def test_g711_input_is_heard(settings, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop  # the reference encoder (the standard library's, to 3.12)

    spoken = [silence(0.3, 8000), speak("what time is it in london", 8000), silence(1.0, 8000)]
    pcm = encode_pcm(np.concatenate(spoken), "pcm_s16le")
    encoded = audioop.lin2ulaw(pcm, 2) if kind == "audio/pcmu" else audioop.lin2alaw(pcm, 2)
    seen: list[dict[str, Any]] = []
    async with voice_session(settings) as connection:
        await receive(connection, seen, lambda e: e["type"] == "session.created")
        await connection.session.update(session={"type": "realtime", "audio": {"input": {
            "format": {"type": kind}, "turn_detection": None}}})  # fmt: skip
        updated = (await receive(connection, seen, is_updated))[-1]
        assert updated["session"]["audio"]["input"]["format"] == {"type": kind}
        for i in range(0, len(encoded), 320):  # 40 ms at 8 kHz, one byte a sample
            chunk = base64.b64encode(encoded[i : i + 320]).decode()
            await connection.input_audio_buffer.append(audio=chunk)
        await connection.input_audio_buffer.commit()
        await receive(connection, seen, is_done)
    heard = of_type(seen, "conversation.item.input_audio_transcription.completed")
    # Telephone audio (8 kHz) is heard less well by the tiny Whisper model; the words
    # that carry the question come through.
    assert {"time", "london"} <= set(words(heard[0]["transcript"]))


async def test_instructions_text_only_output_and_voice_take_effect(settings):
    seen: list[dict[str, Any]] = []

    async def turn(text: str) -> dict[str, Any]:
        await connection.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}]})  # fmt: skip
        await connection.response.create()
        return (await receive(connection, seen, is_done))[-1]["response"]

    def audio_of(response_id: str) -> bytes:
        deltas = [e["delta"] for e in of_type(seen, "response.output_audio.delta")
                  if e["response_id"] == response_id]  # fmt: skip
        return b"".join(base64.b64decode(d) for d in deltas)

    async with voice_session(settings) as connection:
        await receive(connection, seen, lambda e: e["type"] == "session.created")
        await connection.session.update(
            session={"type": "realtime", "instructions": "Gladly.", "output_modalities": ["text"]}
        )
        await receive(connection, seen, is_updated)
        quiet = await turn("hello there")
        await connection.session.update(session={
            "type": "realtime", "output_modalities": ["audio"],
            "audio": {"output": {"voice": "marin"}}})  # fmt: skip
        await receive(connection, seen, is_updated)
        marin = await turn("hello there")
        await connection.session.update(session={
            "type": "realtime", "audio": {"output": {"voice": "cedar"}}})  # fmt: skip
        await receive(connection, seen, is_updated)
        cedar = await turn("hello there")
    # Text only: the thinker's answer (after the instructions), no audio at all.
    assert quiet["status"] == "completed"
    content = [part for item in quiet["output"] for part in item["content"]]
    assert content == [{"type": "output_text", "text": "Gladly. You said hello there."}]
    assert not audio_of(quiet["id"])
    # Audio again, and each voice speaks the same words differently; the updates that
    # named only the output and the voice kept the instructions (merge, not replace).
    assert marin["status"] == cedar["status"] == "completed"
    for spoken in (marin, cedar):
        # An audio response streams its transcript, never the thinker's text beside it.
        parts = {part["type"]: part for item in spoken["output"] for part in item["content"]}
        assert set(parts) == {"output_audio"}
        assert parts["output_audio"]["transcript"] == "Gladly. You said hello there."
        streamed = {e["type"] for e in seen if e.get("response_id") == spoken["id"]}
        assert not {t for t in streamed if t.startswith("response.output_text.")}
        assert "response.output_audio_transcript.delta" in streamed
    # A text response streams text and no transcript.
    streamed = {e["type"] for e in seen if e.get("response_id") == quiet["id"]}
    assert "response.output_text.delta" in streamed
    assert not {t for t in streamed if t.startswith("response.output_audio")}
    assert audio_of(marin["id"]) and audio_of(cedar["id"])
    assert audio_of(marin["id"]) != audio_of(cedar["id"])
    # Typed text is not reported as a transcription of audio.
    assert not of_type(seen, "conversation.item.input_audio_transcription.completed")
