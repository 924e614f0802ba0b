"""The echo stack as ``duplexq up --pipeline configs/echo.toml`` ships it: a typed turn
(``conversation.item.create`` then ``response.create``, what the demo page sends) is
answered whole, as the one response the client asked for.

The situation that cut it: the thinker takes the typed message before
``response.create`` reserves the response. Answering at once, the echo streamed its
first piece under the fence of no response (or of the previous one) and the rest,
restamped, under the response reserved meanwhile, so the client saw the first piece
as a response of its own, ended ``incomplete`` (superseded). The shipped thinker
answers typed text when asked (``when_asked``, ``workers/backends/echo.py``). Here
the thinker's answers pause after their first piece until the test lets them go, so
the message is always taken, and any piece of its answer given at once delivered,
before the response is asked for.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from schemas.config import PipelineConfig, load_pipeline
from schemas.events import CommitPayload, InputEvent, InputMode, OutputKind, TextPayload
from schemas.fence import Fence
from tests.pipeline_helpers import fast_settings, running_worker
from tests.processes import ROOT
from tests.realtime_helpers import Client, serving, text_turn
from workers.backends.base import OutputDraft, StageContext, StageEvent
from workers.backends.echo import EchoBackend

pytestmark = pytest.mark.timeout(60)

SHIPPED = load_pipeline(ROOT / "configs" / "echo.toml")
MESSAGE = "Hello there, who are you?"


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",))


class PausingEcho(EchoBackend):
    """The echo, whose answer to a typed message pauses after its first piece until
    ``go`` is set; ``taken`` is set once it has taken the message (answered it as far
    as the pause, or held it for the commit)."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.go = asyncio.Event()
        self.taken = asyncio.Event()
        self.said_at_once = False
        """Whether the first piece of the message's answer was given as it arrived."""

    async def handle(self, ctx: StageContext, event: StageEvent):  # type: ignore[override]
        typed = isinstance(event, InputEvent) and isinstance(event.payload, TextPayload)
        async for draft in super().handle(ctx, event):
            yield draft
            if typed and not self.go.is_set():
                self.said_at_once = True
                self.taken.set()
                await self.go.wait()
        if typed:
            self.taken.set()


async def _typed_turn(settings, pipeline: PipelineConfig, thinker: PausingEcho) -> list[Any]:
    """The page's typed turn, asked for once the thinker has taken the message; the
    server events up to the first ``response.done`` that completes."""
    events: list[dict[str, Any]] = []
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "thinker", backend=thinker),
        running_worker(settings, pipeline, "talker"),
        Client.connect(base) as client,
    ):
        events += await client.until("session.created")
        item, create = text_turn(MESSAGE)
        await client.send(item)
        events += await client.until("conversation.item.created")
        item_id = events[-1]["item"]["id"]
        await asyncio.wait_for(thinker.taken.wait(), 20)
        delta = "response.output_text.delta"
        if thinker.said_at_once and not any(e["type"] == delta for e in events):
            events += await client.until(delta)
        await client.send(create)
        # Client events are taken in order: once the item is retrieved, the response
        # is reserved and its commit is in the session's log.
        await client.send({"type": "conversation.item.retrieve", "item_id": item_id})
        events += await client.until("conversation.item.retrieved")
        thinker.go.set()
        while not any(
            e["type"] == "response.done" and e["response"]["status"] == "completed" for e in events
        ):
            events += await client.until("response.done")
    return events


def _responses(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(id, status, text) of each response that ended, in order."""
    ended = []
    for done in (e for e in events if e["type"] == "response.done"):
        rid = done["response"]["id"]
        text = "".join(
            e["delta"]
            for e in events
            if e["type"] == "response.output_text.delta" and e["response_id"] == rid
        )
        ended.append((rid, done["response"]["status"], text))
    return ended


async def test_a_typed_turn_taken_before_it_is_asked_for_arrives_whole(settings):
    thinker = PausingEcho(SHIPPED.stage("thinker").options)
    events = await _typed_turn(settings, SHIPPED, thinker)
    created = [e["response"]["id"] for e in events if e["type"] == "response.created"]
    responses = _responses(events)
    assert [(status, text) for _, status, text in responses] == [("completed", MESSAGE)]
    assert created == [responses[0][0]]
    assert not thinker.said_at_once


async def test_answering_at_once_the_same_turn_is_split_over_two_responses(settings):
    """Why the shipped thinker answers when asked: the situation above, answered at once."""
    thinker = PausingEcho({**SHIPPED.stage("thinker").options, "when_asked": False})
    events = await _typed_turn(settings, SHIPPED, thinker)
    (first, first_status, said), (_, status, rest) = _responses(events)
    assert thinker.said_at_once
    assert first_status == "incomplete" and status == "completed"
    assert said + rest == MESSAGE and said and rest
    [done] = [e for e in events if e["type"] == "response.done" and e["response"]["id"] == first]
    assert done["response"]["status_details"]["duplexq"]["reason"] == "superseded"


# -- answering when asked, without I/O ------------------------------------------------------


def _text(seq: int, text: str, epoch: int = 0) -> InputEvent:
    return InputEvent(Fence("s", epoch=epoch), seq, 1, InputMode.APPEND_TEXT, TextPayload(text))


def _commit(seq: int, epoch: int = 0) -> InputEvent:
    fence = Fence("s", epoch=epoch, turn_id=1, response_seq=1)
    return InputEvent(fence, seq, 1, InputMode.TURN_COMMIT_ONLY, CommitPayload(respond=True))


async def _answer(echo: EchoBackend, ctx: StageContext, event: StageEvent) -> list[OutputDraft]:
    return [draft async for draft in echo.handle(ctx, event)]


def _said(drafts: list[OutputDraft]) -> tuple[str, list[OutputKind]]:
    text = "".join(d.text for d in drafts if d.kind is OutputKind.TEXT_DELTA)
    return text, [d.kind for d in drafts if d.kind is not OutputKind.TEXT_DELTA]


async def test_typed_text_is_answered_by_its_commit_also_after_a_takeover():
    echo = EchoBackend({"chunks": 2, "when_asked": True})
    ctx = StageContext("s", "thinker", Fence("s"), {})
    assert await _answer(echo, ctx, _text(1, "hello ")) == []
    assert _said(await _answer(echo, ctx, _commit(2))) == ("hello ", [OutputKind.DONE])
    # A new owner takes over between a message and its commit: it rebuilds what waits.
    heir = EchoBackend({"chunks": 2, "when_asked": True})
    ctx = StageContext("s", "thinker", Fence("s", incarnation=1), {})
    await heir.start(ctx, [_text(1, "hello "), _commit(2), _text(3, "again "), _text(4, "!")], [])
    assert _said(await _answer(heir, ctx, _commit(5))) == ("again !", [OutputKind.DONE])


async def test_an_interrupted_turn_drops_its_text_and_text_absorbed_waits_for_a_commit():
    echo = EchoBackend({"when_asked": True})
    ctx = StageContext("s", "thinker", Fence("s", epoch=1), {})
    await _answer(echo, ctx, _text(1, "cut "))
    await echo.absorb(ctx, _commit(2))  # its turn was interrupted before it was answered
    await echo.absorb(ctx, _text(3, "asked "))  # typed before the interruption
    assert _said(await _answer(echo, ctx, _commit(4, epoch=1))) == ("asked ", [OutputKind.DONE])


def test_when_asked_is_a_bool():
    with pytest.raises(ValueError, match="when_asked must be true or false"):
        EchoBackend({"when_asked": "yes"})
    assert EchoBackend().when_asked is False
    assert SHIPPED.stage("thinker").options["when_asked"] is True
