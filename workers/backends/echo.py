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

Function calls, for tests and the nemesis: when the session declares tools, a
typed input ``call:<text>`` is answered with a call of the first tool
(arguments ``{"text": <text>}``, id ``call_<input seq>``) instead of its echo;
the client's result for it (a ``tool`` message) is then the answer of the next
commit, echoed like a text. A downstream echo passes calls on as they are.

Answering when asked (option ``when_asked``): typed text (a user message, text
appended) is held until the turn's commit (a client commit or a
``response.create``) and answered then, before the commit's ``done``, as a model
answers. The answer is then the response that was asked for: answered at once,
a streamed echo of a typed message can begin before ``response.create`` reserves
its response and go on under it, which splits one answer over two responses,
the first ended ``incomplete`` (``tests/test_echo_stack.py``). A commit absorbed
after an interruption drops what was held for it; text absorbed is held for the
next commit, which asks about it.

Options: ``chunks`` (1..64, default 1), ``step_ms`` (0..10000, default 0),
``when_asked`` (bool, default false). Echo keeps no state between events but a
function's result and, answering when asked, the text typed since the last
commit: a takeover reads the newest inputs to find them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from schemas.events import (
    AudioPayload,
    CommitPayload,
    ConversationPayload,
    InputEvent,
    OutputEvent,
    OutputKind,
    TextPayload,
    TokensPayload,
    UnitPayload,
    VideoPayload,
    session_payload_of,
)
from schemas.fence import Fence
from workers.backends.base import OutputDraft, RebuildWindow, StageContext, StageEvent


def _int_option(options: Mapping[str, Any], name: str, default: int, high: int) -> int:
    value = options.get(name, default)
    if type(value) is not int or not 0 <= value <= high:
        raise ValueError(f"echo option {name} must be an int in 0..{high}, got {value!r}")
    return value


def _bool_option(options: Mapping[str, Any], name: str) -> bool:
    value = options.get(name, False)
    if type(value) is not bool:
        raise ValueError(f"echo option {name} must be true or false, got {value!r}")
    return value


def _typed(event: StageEvent) -> bool:
    """Text the client typed (a message, text appended), as the session stage reads it."""
    return isinstance(event, InputEvent) and isinstance(event.payload, TextPayload)


def _commit(event: StageEvent) -> bool:
    return isinstance(event, InputEvent) and isinstance(event.payload, CommitPayload)


REBUILD_INPUTS = 16
"""Newest inputs a takeover reads for a function's result, or text typed, waiting for
its commit."""
_NAMING = ("item", "typed", "role", "segment", "commit_seq")
"""Meta keys that say what an output is (``schemas.items``), echoed with it."""


def _draft(kind: OutputKind, piece: Any, meta: dict[str, Any], *, flush: bool) -> OutputDraft:
    if isinstance(piece, bytes):
        return OutputDraft(kind, data=piece, meta=meta, flush=flush)
    return OutputDraft(kind, text=piece, meta=meta, flush=flush)


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
    rebuild = RebuildWindow(inputs=REBUILD_INPUTS, outputs=0)
    """Every event is answered on its own, but a function's result (or, answering when
    asked, typed text) still waiting for its commit is found among the newest inputs."""
    edits_conversation = True
    """A function's result (a ``tool`` message) is echoed at the next commit."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        options = options or {}
        self.chunks = max(1, _int_option(options, "chunks", 1, 64))
        self.step_s = _int_option(options, "step_ms", 0, 10_000) / 1000
        self.when_asked = _bool_option(options, "when_asked")
        """Typed text is answered at the turn's commit, not as it arrives."""
        self.released: list[Fence] = []
        self.steps_after_release = 0
        """Chunks produced for a fence after it was released (barge-in reaction, in steps)."""

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        """A function's result applied after the last commit waits for the next one; so
        does, answering when asked, the text typed since."""
        typed: list[StageEvent] = []
        for event in reversed(inputs):
            if _commit(event):
                break
            edit = session_payload_of(event) if not isinstance(event, OutputEvent) else None
            if isinstance(edit, ConversationPayload) and edit.role == "tool":
                ctx.state.setdefault("result", edit.text)  # the newest one
            elif self.when_asked and _typed(event):
                typed.append(event)
        if typed:
            ctx.state["typed"] = typed[::-1]

    def _answer(self, ctx: StageContext, event: StageEvent) -> tuple[OutputKind, Any] | None:
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

    @staticmethod
    def _call(ctx: StageContext, event: StageEvent) -> OutputDraft | None:
        """The function call a ``call:`` input makes when the session has tools; a call
        passed on by the stage upstream, unchanged."""
        if isinstance(event, OutputEvent):
            if event.kind is not OutputKind.FUNCTION_CALL:
                return None
            return OutputDraft(event.kind, text=event.text, meta=dict(event.meta))
        payload = event.payload
        if not (isinstance(payload, TextPayload) and payload.text.startswith("call:")):
            return None
        if not ctx.session.tools or ctx.session.tool_choice == "none":
            return None
        name = json.loads(ctx.session.tools)[0]["function"]["name"]
        arguments = json.dumps({"text": payload.text.removeprefix("call:")})
        return OutputDraft(OutputKind.FUNCTION_CALL, text=arguments,
                           meta={"name": name, "call_id": f"call_{event.seq}"})  # fmt: skip

    def answer_now(self, ctx: StageContext, event: StageEvent) -> list[OutputDraft] | None:
        """The whole answer at once when it is not streamed (``chunks`` 1): nothing to
        wait for, so the runtime stages it without running ``handle`` in a task. A
        subclass with a ``handle`` of its own answers through it."""
        if self.chunks > 1 or type(self).handle is not EchoBackend.handle:
            return None
        return list(self._answer_drafts(ctx, event))

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        epoch = ctx.fence.epoch
        for draft in self._answer_drafts(ctx, event):
            if draft.meta.get("chunk", 0) and self.step_s:
                await asyncio.sleep(self.step_s)
            if "chunk" in draft.meta and ctx.fence.epoch > epoch:
                self.steps_after_release += 1
            yield draft

    def _answer_drafts(self, ctx: StageContext, event: StageEvent) -> Iterator[OutputDraft]:
        """The answer's drafts in order (a streamed one is paced by ``handle``)."""
        if self.when_asked and _typed(event):
            ctx.state.setdefault("typed", []).append(event)  # answered by the commit
            return
        if self.when_asked and _commit(event):
            for typed in ctx.state.pop("typed", []):
                yield from self._reply(ctx, typed)
        yield from self._reply(ctx, event)

    def _reply(self, ctx: StageContext, event: StageEvent) -> Iterator[OutputDraft]:
        """What answers ``event`` itself."""
        call = self._call(ctx, event)
        if call is not None:
            yield call
            return
        result = ctx.state.pop("result", None)
        if result is not None and isinstance(event, InputEvent):
            yield from self._echo(event, OutputKind.TEXT_DELTA, result)
        answer = self._answer(ctx, event)
        if answer is not None:
            yield from self._echo(event, *answer)

    def _echo(self, event: StageEvent, kind: OutputKind, content: Any) -> Iterator[OutputDraft]:
        """``content`` as ``kind`` drafts, in ``chunks`` pieces."""
        source: dict[str, str | int | float | bool] = {"source": event.seq}
        if isinstance(event, InputEvent):
            source["turn_seq"] = event.turn_seq
        elif event.kind is kind:
            # What names the echoed output passes on with it (whose item, typed or
            # heard, the assistant's or the user's): the echo is the same thing again.
            source |= {k: v for k, v in event.meta.items() if k in _NAMING}
        if self.chunks == 1 or kind is OutputKind.DONE:
            yield _draft(kind, content, {**source, "chunk": 0, "last": True}, flush=False)
            return
        pieces = _split(content, self.chunks)
        for index, piece in enumerate(pieces):
            meta = {**source, "chunk": index, "last": index == len(pieces) - 1}
            yield _draft(kind, piece, meta, flush=len(pieces) > 1)

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        if self.when_asked and _typed(event):
            ctx.state.setdefault("typed", []).append(event)  # the next commit asks about it
            return
        if self.when_asked and _commit(event):
            ctx.state.pop("typed", None)  # its turn was interrupted: nothing answers it
        edit = session_payload_of(event) if isinstance(event, InputEvent) else None
        if isinstance(edit, ConversationPayload):
            if edit.role == "tool":  # a function's result: the next commit's answer
                ctx.state["result"] = edit.text
            return
        ctx.state["absorbed"] = ctx.state.get("absorbed", 0) + 1

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        self.released.append(fence)

    async def stop(self, ctx: StageContext) -> None:
        ctx.state.clear()

    async def aclose(self) -> None:
        return None
