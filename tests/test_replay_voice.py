"""A real voice session of the default pipeline, replayed greedily, is IDENTICAL.

The shipped stack (``duplexq up --workers 1`` on configs/default.toml, nothing
overridden: VAD -> ASR -> the SmolLM2 thinker on vLLM -> TTS) is asked two spoken
questions (espeak-ng speech, streamed like a microphone over the Realtime WebSocket)
and answers each in speech. ``duplexq replay --greedy`` then replays the session twice
greedily and must say the two replays are identical: each input waits for the
answers the recording had given before it (coordinator/controlplane/replay_wait.py), and
settings records are not compared (coordinator/controlplane/replay_verdict.py).

How a replay that differs names the first differing record is tested on hand-built
journals of the same shape in tests/test_replay_verdict.py.
"""

from __future__ import annotations

import asyncio
import base64
import re

import numpy as np
import pytest

from tests.realtime_helpers import Client, until_completed
from tests.shipped_stack import START_S, ShippedStack
from tests.speech import silence, speak
from workers.backends.audio import encode_pcm

pytestmark = pytest.mark.timeout(START_S + 900)

RATE = 24_000
"""The Realtime API's default input: 24 kHz PCM16."""
HEARD = "conversation.item.input_audio_transcription.completed"
QUESTIONS = ("What is the capital of France?", "And what is the capital of Japan?")


async def speak_turn(client: Client, text: str) -> list[dict]:
    """``text`` spoken into the session in 40 ms chunks, then the answer's events."""
    samples = np.concatenate([silence(0.3, RATE), speak(text, RATE), silence(1.2, RATE)])
    step = RATE * 40 // 1000
    for i in range(0, len(samples), step):
        data = encode_pcm(samples[i : i + step], "pcm_s16le")
        await client.send({"type": "input_audio_buffer.append",
                           "audio": base64.b64encode(data).decode()})  # fmt: skip
    return await until_completed(client, within_s=300)


async def record_voice_session(stack: ShippedStack) -> str:
    """A two-turn voice session on the shipped stack: its id, once both are answered
    in speech."""
    async with Client.connect(f"ws://127.0.0.1:{stack.port}", stack.api_key) as client:
        created = await client.recv(30)
        assert created["type"] == "session.created", created
        for question in QUESTIONS:
            events = await speak_turn(client, question)
            assert not [e for e in events if e["type"] == "error"], events
            heard = [e for e in events if e["type"] == HEARD]
            assert heard and "capital" in heard[0]["transcript"].lower(), heard
            assert any(e["type"] == "response.output_audio.delta" for e in events)
        return str(created["session"]["id"])


def test_a_voice_session_replayed_greedily_is_identical(shipped_stack: ShippedStack) -> None:
    session = asyncio.run(record_voice_session(shipped_stack))
    done = shipped_stack.cli("replay", "--greedy", session, f"{session}-replayed", timeout=900)
    out = done.stdout
    print(out)
    assert done.returncode == 0, out + done.stderr
    assert "-replayed (default, fast, greedy): greedy replays identical\n" in out, out
    assert "note:" not in out
    # Both replays gave every answer: two turns of ASR (speech started, stopped, the
    # transcript, done), thinker (the text, done) and TTS (a transcript and audio per
    # sentence, done) outputs, all equal.
    again = re.search(r"outputs (\d+) -> (\d+) \(against \S+\), matched (\d+)", out)
    assert again is not None, out
    assert again[1] == again[2] == again[3] and int(again[1]) >= 18, out
    assert "target incomplete" not in out, out
