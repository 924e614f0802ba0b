"""A served voice pipeline (real VAD, ASR and TTS stages; a thinker that repeats what it
heard) and an official SDK connection to it, for the Realtime audio and item tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from coordinator.realtime import EXTENSION_EVENTS
from schemas.config import PipelineConfig, Settings, StageConfig
from schemas.events import OutputEvent, OutputKind
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import serving
from workers.backends.asr import AsrBackend
from workers.backends.base import OutputDraft, StageBackend, StageContext, StageEvent
from workers.backends.echo import EchoBackend
from workers.backends.tts import TtsBackend
from workers.backends.vad import VadBackend

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
RATE = 24_000
PIPELINE = PipelineConfig(
    name="voice",
    stages=(
        StageConfig(name="vad", backend="vad"),
        StageConfig(name="asr", backend="asr", input="vad", to_client=True),
        StageConfig(name="thinker", backend="echo", input="asr", to_client=True),
        StageConfig(name="tts", backend="tts", input="thinker", to_client=True),
    ),
)


class Parrot(EchoBackend):
    """A thinker that says back what it heard, after the session's instructions."""

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        if not isinstance(event, OutputEvent):
            return
        if event.kind is OutputKind.TRANSCRIPT:
            said = f"You said {event.text.strip().rstrip('.')}."
            text = f"{ctx.session.instructions} {said}" if ctx.session.instructions else said
            yield OutputDraft(OutputKind.TEXT_DELTA, text=text)
        elif event.kind is OutputKind.DONE:
            yield OutputDraft(OutputKind.DONE)


def voice_settings(url: str, prefix: str) -> Settings:
    return fast_settings(url, prefix, api_keys=("k1",), first_event_wait_ms=50)


@contextlib.asynccontextmanager
async def voice_session(settings: Any, thinker: StageBackend | None = None) -> AsyncIterator[Any]:
    """A served voice pipeline (``thinker``: a ``Parrot`` unless given) and one SDK
    connection to it."""
    backends = {"vad": VadBackend(), "asr": AsrBackend(), "thinker": thinker or Parrot(),
                "tts": TtsBackend()}  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        base = await stack.enter_async_context(serving(settings, PIPELINE))
        for name, backend in backends.items():
            await stack.enter_async_context(
                running_worker(settings, PIPELINE, name, backend=backend)
            )
        client = AsyncOpenAI(api_key="k1", websocket_base_url=f"{base}/v1")
        stack.push_async_callback(client.close)
        connection = await stack.enter_async_context(client.realtime.connect(model="duplexq"))
        yield connection


async def receive(connection: Any, seen: list[dict[str, Any]], until: Callable[..., bool],
                  within_s: float = 40) -> list[dict[str, Any]]:  # fmt: skip
    """Events (validated) up to the first one ``until`` accepts; all go to ``seen``."""
    got: list[dict[str, Any]] = []
    async with asyncio.timeout(within_s):
        while True:
            event = json.loads(await connection.recv_bytes())
            if event["type"] not in EXTENSION_EVENTS:
                SERVER_EVENT.validate_python(event)
            seen.append(event)
            got.append(event)
            if until(event):
                return got


def is_done(event: dict[str, Any]) -> bool:
    return event["type"] == "response.done"


def is_updated(event: dict[str, Any]) -> bool:
    return event["type"] == "session.updated"


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]
