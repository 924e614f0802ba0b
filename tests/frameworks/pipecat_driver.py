"""Pipecat's OpenAI realtime service, unmodified and with its default settings, in a
pipeline of Pipecat's own parts, driven against a duplexq server.

Runs in ``.venv-frameworks`` (the pinned framework versions; scripts/setup), never in the
product's venv: ``python pipecat_driver.py WS_URL API_KEY SCENARIO [PCM_FILE]``. It prints
one JSON object: the frames the pipeline saw, for tests/test_frameworks.py to judge.

The pipeline is what a Pipecat bot builds around a realtime service: the context
aggregator pair on either side of it (the assistant's half records the answers and the
function results, and asks the service for the answer to a result). A transport is the
only part left out: the scenario queues the frames a transport would (user audio, an
interruption), and a recorder in its place keeps what comes out.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from pipecat.adapters.schemas.function_schema import FunctionSchema
from pipecat.adapters.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    FunctionCallResultFrame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMRunFrame,
    LLMTextFrame,
    LLMUpdateSettingsFrame,
    OutputAudioRawFrame,
    TranscriptionFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.realtime.events import SessionProperties
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

RATE = 24_000
FRAME_MS = 20


class Recorder(FrameProcessor):
    """Where the transport's output would be: keeps what the pipeline produced."""

    def __init__(self) -> None:
        super().__init__()
        self.responses: list[dict[str, Any]] = [self._fresh()]
        self.transcripts: list[str] = []
        self.errors: list[str] = []
        self.results = 0
        self.on_frame: Callable[[Frame], None] = lambda _frame: None

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"llm_text": "", "tts_text": [], "audio_ms": 0.0}

    @property
    def ended(self) -> list[dict[str, Any]]:
        return self.responses[:-1]

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        current = self.responses[-1]
        if isinstance(frame, LLMTextFrame):
            current["llm_text"] += frame.text
        elif isinstance(frame, TTSTextFrame):
            current["tts_text"].append(frame.text)
        elif isinstance(frame, OutputAudioRawFrame):
            current["audio_ms"] += 1000 * len(frame.audio) / 2 / frame.sample_rate
        elif isinstance(frame, LLMFullResponseEndFrame):
            self.responses.append(self._fresh())
        elif isinstance(frame, TranscriptionFrame):
            self.transcripts.append(frame.text)
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame.error)
        elif isinstance(frame, FunctionCallResultFrame):
            self.results += 1
        self.on_frame(frame)
        await self.push_frame(frame, direction)


async def wait_for(check: Callable[[], bool], timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def get_weather(params: FunctionCallParams) -> None:
    """The tool. The session forced this call (``tool_choice: "required"``); before the
    result goes back, the choice returns to ``auto`` so that the model answers it in words
    rather than calling again (the settings frame reaches the service before the result's
    request for an answer does)."""
    await params.llm.queue_frame(
        LLMUpdateSettingsFrame(
            delta=OpenAIRealtimeLLMService.Settings(
                session_properties=SessionProperties(tool_choice="auto")
            )
        )
    )
    city = params.arguments.get("city", "Paris")
    await params.result_callback({"city": city, "weather": "sunny", "celsius": 21})


WEATHER = FunctionSchema(
    name="get_weather",
    description="The current weather in a city.",
    properties={"city": {"type": "string", "description": "The city's name."}},
    required=["city"],
)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


class Bot:
    """A realtime service between the context aggregators, run by Pipecat's runner."""

    def __init__(self, url: str, api_key: str, context: LLMContext, settings: Any = None) -> None:
        self.llm = OpenAIRealtimeLLMService(api_key=api_key, base_url=url, settings=settings)
        self.llm.register_function("get_weather", get_weather)
        self.recorder = Recorder()
        pair = LLMContextAggregatorPair(context)
        pipeline = Pipeline([pair.user(), self.llm, self.recorder, pair.assistant()])
        self.worker = PipelineWorker(
            pipeline,
            params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
            idle_timeout_secs=None,
        )
        self.runner = WorkerRunner(handle_sigint=False)
        self._run: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Bot:
        await self.runner.add_workers(self.worker)
        self._run = asyncio.create_task(self.runner.run())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.worker.cancel()
        if self._run is not None:
            await asyncio.wait_for(self._run, 30)

    async def send(self, *frames: Frame) -> None:
        await self.worker.queue_frames(list(frames))


async def text_turn(url: str, key: str, _argv: list[str]) -> dict[str, Any]:
    context = LLMContext([user("Say hello to the team in one short sentence.")])
    async with Bot(url, key, context) as bot:
        await bot.send(LLMRunFrame())
        await wait_for(lambda: bool(bot.recorder.ended))
        return report(bot)


async def audio_turn(url: str, key: str, argv: list[str]) -> dict[str, Any]:
    """The user speaks, then is silent: the server's turn detection (on by default)
    ends the turn, and the server answers on its own."""
    async with Bot(url, key, LLMContext()) as bot:
        await speak(bot, np.fromfile(argv[0], dtype="<i2"))
        await wait_for(lambda: bool(bot.recorder.ended))
        return report(bot)


async def speak(bot: Bot, pcm: np.ndarray) -> None:
    """The user's voice, then two seconds of silence, paced as a microphone sends it."""
    step = RATE * FRAME_MS // 1000
    for samples in (pcm, np.zeros(RATE * 2, dtype="<i2")):
        for i in range(0, len(samples), step):
            chunk = samples[i : i + step].tobytes()
            await bot.send(InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))
            await asyncio.sleep(FRAME_MS / 1000)


async def interruption(url: str, key: str, argv: list[str]) -> dict[str, Any]:
    """The user speaks over a long answer once its first words arrive. With the server's
    turn detection (Pipecat's default), the server hears the barge-in and stops the
    answer; Pipecat interrupts its pipeline on the server's ``speech_started``. The
    interrupting utterance is then answered."""
    context = LLMContext([user("Tell me a long story about the sea. " * 20)])
    async with Bot(url, key, context) as bot:
        answering = asyncio.Event()
        interruptions: list[float] = []

        def on_frame(frame: Frame) -> None:
            if isinstance(frame, TTSTextFrame | LLMTextFrame):
                answering.set()
            elif isinstance(frame, InterruptionFrame):
                interruptions.append(time.monotonic())

        bot.recorder.on_frame = on_frame
        await bot.send(LLMRunFrame())
        await asyncio.wait_for(answering.wait(), 120)
        await speak(bot, np.fromfile(argv[0], dtype="<i2"))
        await wait_for(lambda: len(bot.recorder.ended) >= 2)
        return {**report(bot), "interruptions": len(interruptions)}


async def tool_loop(url: str, key: str, _argv: list[str]) -> dict[str, Any]:
    """The model calls a tool; Pipecat runs the handler, sends its result and asks the
    model for the answer (the assistant aggregator's job)."""
    context = LLMContext(
        [user("What is the weather in Paris? Use the get_weather tool.")],
        tools=ToolsSchema(standard_tools=[WEATHER]),
    )
    forced = OpenAIRealtimeLLMService.Settings(
        session_properties=SessionProperties(tool_choice="required")
    )
    async with Bot(url, key, context, forced) as bot:
        await bot.send(LLMRunFrame())
        await wait_for(lambda: bot.recorder.results > 0 and len(bot.recorder.ended) >= 2)
        return report(bot)


def report(bot: Bot) -> dict[str, Any]:
    recorder = bot.recorder
    return {
        "responses": recorder.ended,
        "transcripts": recorder.transcripts,
        "function_results": recorder.results,
        "errors": recorder.errors,
    }


SCENARIOS = {
    "text": text_turn,
    "audio": audio_turn,
    "interrupt": interruption,
    "tools": tool_loop,
}


async def main(url: str, api_key: str, scenario: str, argv: list[str]) -> None:
    try:
        result = await SCENARIOS[scenario](url, api_key, argv)
    except Exception as exc:  # reported, for the test to show
        result = {"exception": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))
