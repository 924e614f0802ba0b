"""The deterministic echo backend, for pipeline tests and benchmarks only.

Each event is answered with what it carried: text as text deltas, tokens as
token ids, audio as audio deltas, video as a text note, a turn commit as
``done``. With ``chunks > 1`` the answer is split and streamed with
``step_ms`` between chunks, like a model generating; every chunk is then a
flush draft. Upstream outputs (when the stage reads another stage) are echoed
kind for kind.

Inputs from before an interruption are absorbed (nothing answers them), like a
model's; but echo's outputs describe their input rather than a response, so a
response reserved meanwhile does not make them stale (``follows_responses``).

Options: ``chunks`` (1..64, default 1), ``step_ms`` (0..10000, default 0).
Echo keeps no state between events, so a takeover reads no history.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from schemas.events import (
    AudioPayload,
    CommitPayload,
    InputEvent,
    OutputEvent,
    OutputKind,
    TextPayload,
    TokensPayload,
    UnitPayload,
    VideoPayload,
)
from schemas.fence import Fence
from workers.backends.base import NO_HISTORY, OutputDraft, StageContext, StageEvent


def _int_option(options: Mapping[str, Any], name: str, default: int, high: int) -> int:
    value = options.get(name, default)
    if type(value) is not int or not 0 <= value <= high:
        raise ValueError(f"echo option {name} must be an int in 0..{high}, got {value!r}")
    return value


def _split(data: bytes | str, parts: int) -> list[Any]:
    size = max(1, -(-len(data) // parts))
    return [data[i : i + size] for i in range(0, len(data), size)] or [data]


class EchoBackend:
    """Answers every event with its own content."""

    name = "echo"
    continuous_input = False
    follows_responses = False
    """Echo answers each input as it comes; a response reserved meanwhile does not
    make those answers stale."""
    edits_conversation = False
    rebuild = NO_HISTORY
    """Nothing to rebuild: every event is answered on its own."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        options = options or {}
        self.chunks = max(1, _int_option(options, "chunks", 1, 64))
        self.step_s = _int_option(options, "step_ms", 0, 10_000) / 1000
        self.released: list[Fence] = []
        self.steps_after_release = 0
        """Chunks produced for a fence after it was released (barge-in reaction, in steps)."""

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        return None

    def _answer(self, event: StageEvent) -> tuple[OutputKind, Any] | None:
        if isinstance(event, OutputEvent):
            if event.kind is OutputKind.AUDIO_DELTA:
                return event.kind, event.data
            return event.kind, event.text
        payload = event.payload
        if isinstance(payload, TextPayload):
            return OutputKind.TEXT_DELTA, payload.text
        if isinstance(payload, TokensPayload):
            return OutputKind.TEXT_DELTA, " ".join(map(str, payload.token_ids))
        if isinstance(payload, AudioPayload):
            return OutputKind.AUDIO_DELTA, payload.data
        if isinstance(payload, VideoPayload):
            return OutputKind.TEXT_DELTA, f"[{len(payload.frames)} frame(s)]"
        if isinstance(payload, UnitPayload):
            audio = payload.audio.data if payload.audio else b""
            return OutputKind.AUDIO_DELTA, audio
        if isinstance(payload, CommitPayload):
            return OutputKind.DONE, ""
        return None  # clear / playback acks change no echo

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        answer = self._answer(event)
        if answer is None:
            return
        kind, content = answer
        source = {"source": event.seq}
        if isinstance(event, InputEvent):
            source["turn_seq"] = event.turn_seq
        pieces = _split(content, self.chunks) if kind is not OutputKind.DONE else [content]
        streaming = len(pieces) > 1
        epoch = ctx.fence.epoch
        for index, piece in enumerate(pieces):
            if index and self.step_s:
                await asyncio.sleep(self.step_s)
            if ctx.fence.epoch > epoch:
                self.steps_after_release += 1
            meta = {**source, "chunk": index, "last": index == len(pieces) - 1}
            if isinstance(piece, bytes):
                yield OutputDraft(kind, data=piece, meta=meta, flush=streaming)
            else:
                yield OutputDraft(kind, text=piece, meta=meta, flush=streaming)

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        ctx.state["absorbed"] = ctx.state.get("absorbed", 0) + 1

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        self.released.append(fence)

    async def stop(self, ctx: StageContext) -> None:
        ctx.state.clear()

    async def aclose(self) -> None:
        return None
