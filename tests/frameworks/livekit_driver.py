"""LiveKit Agents' OpenAI realtime plugin, unmodified and with its default settings,
driven against a duplexq server the way an ``AgentSession`` drives it.

Runs in ``.venv-frameworks`` (the pinned framework versions; scripts/setup), never in the
product's venv: ``python livekit_driver.py BASE_URL API_KEY SCENARIO [PCM_FILE]``. It prints
one JSON object: what the scenario saw, for tests/test_frameworks.py to judge.

The plugin is driven without a LiveKit room: ``RealtimeModel.session()`` is the object an
agent session talks to, and these are the calls it makes (``update_chat_ctx``,
``generate_reply``, ``push_audio``, ``interrupt``, ``update_tools``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiohttp
import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.plugins.openai.realtime import RealtimeModel

RATE = 24_000
"""The plugin's audio rate (PCM16 mono, both ways)."""
FRAME_MS = 20


class Watch:
    """What the session reported beside the calls' results."""

    def __init__(self, session: Any) -> None:
        self.errors: list[str] = []
        self.generations: list[llm.GenerationCreatedEvent] = []
        self.speech_started = 0
        self.server_events: list[str] = []
        self.statuses: list[str] = []
        session.on("error", lambda ev: self.errors.append(str(getattr(ev, "error", ev))))
        session.on("generation_created", self.generations.append)
        session.on("input_speech_started", lambda _ev: self._started())
        session.on("openai_server_event_received", self._received)

    def _started(self) -> None:
        self.speech_started += 1

    def _received(self, event: dict[str, Any]) -> None:
        self.server_events.append(event["type"])
        if event["type"] == "response.done":
            self.statuses.append(event["response"]["status"])


async def read_generation(gen: llm.GenerationCreatedEvent) -> dict[str, Any]:
    """Every message's text (the transcript, in audio mode) and audio, and every call."""
    texts: list[str] = []
    audio_ms = 0.0

    async def read_audio(stream: Any) -> None:
        nonlocal audio_ms
        async for frame in stream:
            audio_ms += 1000 * frame.samples_per_channel / frame.sample_rate

    async for message in gen.message_stream:
        audio = asyncio.create_task(read_audio(message.audio_stream))
        text = "".join([piece async for piece in message.text_stream])
        await audio
        texts.append(text)
    calls = [
        {"call_id": c.call_id, "name": c.name, "arguments": c.arguments}
        async for c in gen.function_stream
    ]
    return {"texts": texts, "audio_ms": audio_ms, "calls": calls}


def user_message(text: str) -> llm.ChatContext:
    ctx = llm.ChatContext.empty()
    ctx.add_message(role="user", content=text)
    return ctx


async def text_turn(session: Any, _watch: Watch, _argv: list[str]) -> dict[str, Any]:
    await session.update_chat_ctx(user_message("Say hello to the team in one short sentence."))
    gen = await session.generate_reply()
    return await asyncio.wait_for(read_generation(gen), 120)


async def audio_turn(session: Any, watch: Watch, argv: list[str]) -> dict[str, Any]:
    """The user speaks (PCM16 at 24 kHz from the file), then is silent: the server's
    turn detection ends the turn and the server answers on its own."""
    pcm = np.fromfile(argv[0], dtype="<i2")
    silence = np.zeros(RATE * 2, dtype="<i2")
    step = RATE * FRAME_MS // 1000
    for samples in (pcm, silence):
        for i in range(0, len(samples), step):
            chunk = samples[i : i + step]
            session.push_audio(rtc.AudioFrame(chunk.tobytes(), RATE, 1, len(chunk)))
            await asyncio.sleep(FRAME_MS / 1000)
    deadline = time.monotonic() + 60
    while not watch.generations and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not watch.generations:
        return {"generations": 0}
    result = await asyncio.wait_for(read_generation(watch.generations[0]), 120)
    transcripts = [
        item.text_content
        for item in session.chat_ctx.items
        if item.type == "message" and item.role == "user"
    ]
    return {**result, "generations": len(watch.generations), "user_transcripts": transcripts}


async def interruption(session: Any, watch: Watch, _argv: list[str]) -> dict[str, Any]:
    """A long answer is interrupted once its first words arrive; the next turn answers."""
    await session.update_chat_ctx(user_message("Tell me a long story about the sea. " * 20))
    gen = await session.generate_reply()
    first: list[str] = []
    async for message in gen.message_stream:
        audio = asyncio.create_task(_drain(message.audio_stream))
        async for piece in message.text_stream:
            first.append(piece)
            if len(first) == 1:
                session.interrupt()
        await audio
    after = await asyncio.wait_for(text_turn(session, watch, []), 120)
    return {"interrupted_text": "".join(first), "after": after}


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


@llm.function_tool
async def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
        city: The city's name.
    """
    return f"It is sunny and 21 degrees in {city}."


async def tool_loop(session: Any, _watch: Watch, _argv: list[str]) -> dict[str, Any]:
    """The model calls a tool; its result goes back as a function_call_output item, and
    the model answers from it: what AgentSession does for a realtime model that does not
    reply to a tool result on its own (``auto_tool_reply_generation=False``)."""
    await session.update_tools([get_weather])
    await session.update_chat_ctx(user_message("What is the weather in Paris?"))
    gen = await session.generate_reply(tool_choice="required")
    called = await asyncio.wait_for(read_generation(gen), 120)
    if not called["calls"]:
        return {"called": called}
    ctx = session.chat_ctx.copy()
    for call in called["calls"]:
        ctx.items.append(
            llm.FunctionCallOutput(
                call_id=call["call_id"],
                name=call["name"],
                output="It is sunny and 21 degrees in Paris.",
                is_error=False,
            )
        )
    await session.update_chat_ctx(ctx)
    gen = await session.generate_reply()
    answer = await asyncio.wait_for(read_generation(gen), 120)
    return {"called": called, "answer": answer}


SCENARIOS = {
    "text": text_turn,
    "audio": audio_turn,
    "interrupt": interruption,
    "tools": tool_loop,
}


async def main(base_url: str, api_key: str, scenario: str, argv: list[str]) -> None:
    async with aiohttp.ClientSession() as http:
        model = RealtimeModel(base_url=base_url, api_key=api_key, http_session=http)
        session = model.session()
        watch = Watch(session)
        result: dict[str, Any]
        try:
            result = await SCENARIOS[scenario](session, watch, argv)
        except Exception as exc:  # reported, for the test to show
            result = {"exception": f"{type(exc).__name__}: {exc}"}
        finally:
            await session.aclose()
        result["errors"] = watch.errors
        result["server_events"] = sorted(set(watch.server_events))
        result["statuses"] = watch.statuses
        print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))
