"""Conversation items through the official SDK: messages of every role, delete, truncate.

The thinker here records what reaches it (the edits a model stage takes in, and the
item each user part is named by), so each test shows the client's edit arriving, with
the right item and, for a truncation, exactly the words the user heard. How a model's
history applies them is ``tests/test_vllm_stage.py``'s part.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.frames import Timeline
from schemas.events import ConversationPayload, OutputEvent, OutputKind, session_payload_of
from schemas.items import speech_item
from tests.voice_helpers import Parrot, is_done, receive, voice_session, voice_settings
from workers.backends.base import OutputDraft, StageContext, StageEvent

pytestmark = pytest.mark.timeout(120)


class Recorder(Parrot):
    """A parrot that keeps the conversation as a model stage would see it."""

    edits_conversation = True

    def __init__(self) -> None:
        super().__init__()
        self.edits: list[ConversationPayload] = []
        self.user_items: list[str] = []

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        edit = session_payload_of(event) if isinstance(event, OutputEvent) else None
        if isinstance(edit, ConversationPayload):
            self.edits.append(edit)

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        if isinstance(event, OutputEvent) and event.kind is OutputKind.TRANSCRIPT:
            self.user_items.append(speech_item(event))
        async for draft in super().handle(ctx, event):
            yield draft


@pytest.fixture
def settings(redis_server, key_prefix):
    return voice_settings(redis_server.url, key_prefix)


def test_a_timeline_gives_the_words_heard_up_to_a_moment():
    timeline = Timeline()
    for text, ms in (("You said one.", 1000.0), ("Two three.", 800.0), ("Four five six.", 900.0)):
        timeline.said(text)
        timeline.played(ms)
    assert timeline.heard(0) == ""
    assert timeline.heard(100) == ""  # no whole word of the first sentence yet
    assert timeline.heard(300) == "You"
    assert timeline.heard(1000) == "You said one."
    assert timeline.heard(1500) == "You said one. Two"
    assert timeline.heard(2700) == "You said one. Two three. Four five six."


def _sentence_starts(events: list[dict[str, Any]], response_id: str) -> list[float]:
    """Where each spoken sentence begins in the response's audio, as a client measures it
    (24 kHz 16-bit PCM deltas)."""
    starts: list[float] = []
    played = 0.0
    for event in events:
        if event.get("response_id") != response_id:
            continue
        if event["type"] == "response.output_audio_transcript.delta":
            starts.append(played)
        elif event["type"] == "response.output_audio.delta":
            played += len(base64.b64decode(event["delta"])) / 2 / 24_000 * 1000
    return starts


async def test_items_of_every_role_deletes_and_truncation_reach_the_model(settings):
    thinker = Recorder()
    seen: list[dict[str, Any]] = []
    async with voice_session(settings, thinker) as connection:
        await receive(connection, seen, lambda e: e["type"] == "session.created")

        async def create(role: str, text: str, **item: Any) -> dict[str, Any]:
            kind = "output_text" if role == "assistant" else "input_text"
            await connection.conversation.item.create(item={
                "type": "message", "role": role, "content": [{"type": kind, "text": text}],
                **item})  # fmt: skip
            done = await receive(connection, seen, lambda e: e["type"] == "conversation.item.done")
            return done[-1]["item"]

        system = await create("system", "Be terse.")
        earlier = await create("assistant", "Earlier I said hi.", id="item_mine")
        asked = await create("user", "one. two three. four five six.")
        await connection.response.create()
        done = (await receive(connection, seen, is_done))[-1]["response"]
        answer = done["output"][0]["id"]
        second = _sentence_starts(seen, done["id"])[1]
        await connection.conversation.item.truncate(
            item_id=answer, content_index=0, audio_end_ms=int(second) + 1
        )
        truncated = (await receive(connection, seen, lambda e: "truncated" in e["type"]))[-1]
        await connection.conversation.item.delete(item_id="item_mine")
        deleted = (await receive(connection, seen, lambda e: "deleted" in e["type"]))[-1]
        # What cannot be cut is an error naming the event; the session goes on.
        await connection.send({"type": "conversation.item.truncate", "event_id": "evt_far",
                               "item_id": answer, "content_index": 0,
                               "audio_end_ms": 3_600_000})  # fmt: skip
        await connection.send({"type": "conversation.item.truncate", "event_id": "evt_none",
                               "item_id": "item_nope", "content_index": 0,
                               "audio_end_ms": 10})  # fmt: skip
        errors = []
        for _ in range(2):
            errors += (await receive(connection, seen, lambda e: e["type"] == "error"))[-1:]
        await connection.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "still here"}]})  # fmt: skip
        await connection.response.create()
        after = (await receive(connection, seen, is_done))[-1]["response"]
    assert system["role"] == "system" and earlier["id"] == "item_mine"
    assert done["status"] == after["status"] == "completed"
    assert truncated["item_id"] == answer and truncated["audio_end_ms"] == int(second) + 1
    assert deleted["item_id"] == "item_mine"
    assert [(e["error"]["code"], e["error"]["event_id"]) for e in errors] == [
        ("invalid_event", "evt_far"), ("item_not_found", "evt_none")]  # fmt: skip
    # The model stage got each edit, named as the client saw it; the cut keeps the first
    # sentence (the second had just begun: none of its words was heard).
    assert [(e.op, e.item_id, e.role, e.text) for e in thinker.edits] == [
        ("add", system["id"], "system", "Be terse."),
        ("add", "item_mine", "assistant", "Earlier I said hi."),
        ("truncate", answer, "", "You said one."),
        ("delete", "item_mine", "", ""),
    ]
    # The user's messages reach it under the ids the client was given.
    assert thinker.user_items[0] == asked["id"]
