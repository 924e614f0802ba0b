"""Server events of a response, validated by the official SDK's own types.

Each journal below goes through ``ServerEventTranslator`` as a live reader (and a
resume) would; every standard server event that comes out is validated with
pydantic against the ``openai`` SDK's server-event union (``validate_python``,
which checks required fields and literal values, not the SDK's unvalidated
``construct``), and a response's whole sequence is asserted with its ids.
duplexq's own events (``EXTENSION_EVENTS``) are the only types outside the union.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from coordinator.realtime import EXTENSION_EVENTS, ServerEventTranslator
from schemas.config import echo_pipeline
from schemas.events import ControlEvent, ControlKind, OutputEvent, OutputKind, TextPayload
from schemas.fence import Fence
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import Client, serving, streaming_echo
from workers.backends.base import BackendError, OutputDraft
from workers.backends.echo import EchoBackend

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
TALKER = "talker"


def _f(epoch: int = 0, turn: int = 1) -> Fence:
    return Fence("s1", 0, epoch, turn, turn)


def _out(seq: int, kind: OutputKind, stage: str = TALKER, fence: Fence | None = None,
         **fields: Any) -> OutputEvent:  # fmt: skip
    return OutputEvent(fence or _f(), stage, kind, seq, **fields)


def _translate(items: list[OutputEvent | ControlEvent]) -> list[dict[str, Any]]:
    translator = ServerEventTranslator([TALKER])
    events: list[dict[str, Any]] = []
    for n, item in enumerate(items, start=1):
        events += translator.translate(item, 0 if isinstance(item, ControlEvent) else n)
    return events


def _validated(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for event in events:
        if event["type"] in EXTENSION_EVENTS:
            continue
        SERVER_EVENT.validate_python(event)  # raises on a missing or wrong field
    return events


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


TEXT_RESPONSE = [
    _out(1, OutputKind.TEXT_DELTA, text="Hel"),
    _out(2, OutputKind.TEXT_DELTA, text="lo"),
    _out(3, OutputKind.DONE),
]


def test_a_text_response_is_framed_as_the_reference_api_frames_it():
    events = _validated(_translate(TEXT_RESPONSE))
    assert _types(events) == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    rid = events[0]["response"]["id"]
    item = events[1]["item"]
    for event in events[1:]:
        if "response_id" in event:
            assert event["response_id"] == rid
        if "item_id" in event:
            assert event["item_id"] == item["id"]
    assert events[6]["text"] == "Hello"
    assert events[7]["part"] == {"type": "text", "text": "Hello"}
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"] == [{"type": "output_text", "text": "Hello"}]


def test_an_audio_response_carries_its_transcript_in_one_audio_part():
    audio = [
        _out(1, OutputKind.TRANSCRIPT, text="Hi", meta={"role": "assistant"}),
        _out(2, OutputKind.AUDIO_DELTA, data=b"\x00\x01"),
        _out(3, OutputKind.DONE),
    ]
    events = _validated(_translate(audio))
    assert "response.output_audio.done" in _types(events)
    transcript = next(e for e in events if e["type"] == "response.output_audio_transcript.done")
    assert transcript["transcript"] == "Hi"
    parts = [e for e in events if e["type"] == "response.content_part.added"]
    assert [p["part"]["type"] for p in parts] == ["audio"]
    deltas = [e for e in events if e["type"].endswith(".delta")]
    assert {e["content_index"] for e in deltas} == {0}


@pytest.mark.parametrize(
    ("reason", "status_reason"),
    [("response.cancel", "client_cancelled"), ("barge_in", "turn_detected")],
)
def test_a_cancelled_response_ends_once_with_a_reason_the_reference_api_knows(
    reason, status_reason
):
    cancel = ControlEvent(ControlKind.CANCEL, _f(1), _f(), reason)
    events = _validated(_translate([TEXT_RESPONSE[0], cancel]))
    done = [e for e in events if e["type"] == "response.done"]
    assert len(done) == 1
    assert done[0]["response"]["status"] == "cancelled"
    assert done[0]["response"]["status_details"]["reason"] == status_reason
    # The parts and the item are closed, incomplete, before the response ends.
    item_done = next(e for e in events if e["type"] == "response.output_item.done")
    assert item_done["item"]["status"] == "incomplete"


def test_a_superseded_response_is_incomplete_and_the_next_one_starts_fresh():
    later = _f(turn=2)
    items = [TEXT_RESPONSE[0], _out(2, OutputKind.TEXT_DELTA, fence=later, text="B"),
             _out(3, OutputKind.DONE, fence=later)]  # fmt: skip
    events = _validated(_translate(items))
    done = [e["response"] for e in events if e["type"] == "response.done"]
    assert [d["status"] for d in done] == ["incomplete", "completed"]
    assert done[0]["id"] != done[1]["id"]
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert len(set(added)) == 2


def test_speech_events_carry_their_times_and_one_item_id_per_utterance():
    vad = "vad"
    utterance = [
        _out(1, OutputKind.SPEECH_STARTED, stage=vad, meta={"audio_start_ms": 320, "segment": 1}),
        _out(2, OutputKind.SPEECH_STOPPED, stage=vad, meta={"audio_end_ms": 1840, "segment": 1}),
        _out(3, OutputKind.DONE, stage=vad, meta={"reason": "silence", "turn_end": True,
                                                   "segment": 1}),
        _out(4, OutputKind.DONE, stage=vad, meta={"reason": "commit", "turn_end": True}),
        _out(5, OutputKind.TRANSCRIPT, stage="asr", text="hello",
             meta={"segment": 1, "audio_seconds": 1.52}),
    ]  # fmt: skip
    events = _validated(_translate(utterance))
    started, stopped, committed, added, done, by_commit, *by_commit_item, heard = events
    assert started["audio_start_ms"] == 320 and stopped["audio_end_ms"] == 1840
    assert started["item_id"] == stopped["item_id"] == committed["item_id"] == heard["item_id"]
    assert heard["transcript"] == "hello" and heard["usage"]["seconds"] == 1.52
    assert committed["type"] == by_commit["type"] == "input_audio_buffer.committed"
    assert by_commit["item_id"] != committed["item_id"]
    # Each committed turn's spoken item joins the conversation, its transcript to come.
    assert [added["type"], done["type"]] == ["conversation.item.added", "conversation.item.done"]
    assert added["item"]["id"] == done["item"]["id"] == committed["item_id"]
    assert added["item"]["role"] == "user"
    assert added["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    assert [e["item"]["id"] for e in by_commit_item] == [by_commit["item_id"]] * 2


def test_every_server_event_has_a_unique_event_id():
    cancel = ControlEvent(ControlKind.CANCEL, _f(1), _f(), "barge_in")
    events = _translate([*TEXT_RESPONSE, _out(4, OutputKind.TEXT_DELTA, fence=_f(0, 2)), cancel])
    ids = [e["event_id"] for e in events]
    assert all(ids) and len(set(ids)) == len(ids)


# -- through the official SDK, end to end -------------------------------------------------


@pytest.fixture
def sdk_settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)


async def test_a_text_turn_through_the_official_sdk_validates_event_by_event(sdk_settings):
    pipeline = echo_pipeline("echo")
    async with (
        serving(sdk_settings, pipeline) as base,
        running_worker(sdk_settings, pipeline, "echo"),
    ):
        client = AsyncOpenAI(api_key="k1", websocket_base_url=f"{base}/v1")
        events: list[dict[str, Any]] = []
        async with client.realtime.connect(model="duplexq") as connection:
            await connection.conversation.item.create(
                item={"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "hello sdk"}]}
            )  # fmt: skip
            await connection.response.create()
            async with asyncio.timeout(15):
                while not events or events[-1]["type"] != "response.done":
                    events.append(json.loads(await connection.recv_bytes()))
        await client.close()
    _validated(events)  # session.created included
    assert {"session.created", "conversation.item.created"} <= {e["type"] for e in events}
    response = [e["type"] for e in events if e["type"].startswith("response.")]
    opening = ["response.created", "response.output_item.added", "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.done"]  # fmt: skip
    assert response[:3] == opening and response[3] == "response.output_text.delta"
    assert response[-4:] == closing
    text_done = next(e for e in events if e["type"] == "response.output_text.done")
    assert text_done["text"] == "hello sdk"
    assert events[-1]["response"]["status"] == "completed"


class _Fragile(EchoBackend):
    """The echo backend, failing on one input as a model server might."""

    async def handle(self, ctx: Any, event: Any) -> AsyncIterator[OutputDraft]:
        if event.payload == TextPayload("boom"):
            raise BackendError("the model fell over")
        async for draft in super().handle(ctx, event):
            yield draft


def test_a_failure_ends_the_response_with_the_error_inside():
    failure = _out(2, OutputKind.ERROR, stage="thinker", text="too long",
                   meta={"code": "backend_error"})  # fmt: skip
    events = _validated(_translate([TEXT_RESPONSE[0], failure]))
    assert _types(events)[-4:] == ["response.content_part.done", "response.output_item.done",
                                   "conversation.item.done", "response.done"]  # fmt: skip
    assert "error" in _types(events)
    done = events[-1]["response"]
    assert done["status"] == "failed"
    assert done["status_details"]["error"]["code"] == "backend_error"


async def test_a_backend_failure_through_the_sdk_ends_in_a_failed_response_done(sdk_settings):
    pipeline = echo_pipeline("echo")
    async with (
        serving(sdk_settings, pipeline) as base,
        running_worker(sdk_settings, pipeline, "echo", backend=_Fragile()),
    ):
        client = AsyncOpenAI(api_key="k1", websocket_base_url=f"{base}/v1")
        events: list[dict[str, Any]] = []

        async def turn(text: str) -> dict[str, Any]:
            await connection.conversation.item.create(
                item={"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": text}]}
            )  # fmt: skip
            await connection.response.create()
            async with asyncio.timeout(15):
                while True:
                    events.append(json.loads(await connection.recv_bytes()))
                    if events[-1]["type"] == "response.done" and (
                        events[-1]["response"]["status"] != "completed" or text != "boom"
                    ):
                        return events[-1]["response"]

        async with client.realtime.connect(model="duplexq") as connection:
            failed = await turn("boom")
            after = await turn("still here")
        await client.close()
    _validated(events)
    assert failed["status"] == "failed"
    assert failed["status_details"]["error"]["message"] == "the model fell over"
    assert after["status"] == "completed"


# -- the session object ---------------------------------------------------------------------


async def test_session_updates_merge_in_the_ga_shape_and_survive_a_resume(sdk_settings):
    pipeline = echo_pipeline("echo")
    async with serving(sdk_settings, pipeline) as base:
        async with Client.connect(base) as first:
            created = await first.recv()
            SERVER_EVENT.validate_python(created)
            token = created["duplexq"]["resume_token"]
            await first.send({"type": "session.update", "session": {
                "type": "realtime", "instructions": "Be brief.",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                    "turn_detection": None}}}})  # fmt: skip
            one = (await first.until("session.updated"))[-1]
            # A second update names only the voice: the rest is kept.
            await first.send({"type": "session.update", "session": {
                "type": "realtime", "audio": {"output": {"voice": "verse"}}}})  # fmt: skip
            two = (await first.until("session.updated"))[-1]
            # A value the session cannot take is an error; the session is unchanged.
            await first.send({"type": "session.update", "event_id": "evt_bad", "session": {
                "type": "realtime", "audio": {"input": {"format": {"rate": 1}}}}})  # fmt: skip
            bad = (await first.until("error"))[-1]
            last = max(e["duplexq"]["seq"] for e in first.seen)
        async with Client.connect(base) as second:
            await second.send({"type": "duplexq.session.resume", "resume_token": token,
                               "last_received_seq": last})  # fmt: skip
            assert (await second.recv())["type"] == "duplexq.session.resumed"
            # Beta-shaped updates are still read; the resumed session kept the rest. (A
            # 16 kHz input is duplexq's own: the reference API takes 24 kHz PCM only.)
            await second.send({"type": "session.update", "session": {
                "modalities": ["text"], "input_audio_sample_rate": 16000}})  # fmt: skip
            three = (await second.until("session.updated"))[-1]
    for event in (one, two):
        SERVER_EVENT.validate_python(event)
    assert one["session"]["instructions"] == "Be brief."
    assert one["session"]["audio"]["input"]["turn_detection"] is None
    assert two["session"]["audio"]["output"]["voice"] == "verse"
    assert two["session"]["instructions"] == "Be brief."
    assert bad["error"]["code"] == "invalid_event" and bad["error"]["event_id"] == "evt_bad"
    session = three["session"]
    assert session["output_modalities"] == ["text"]
    assert session["instructions"] == "Be brief."
    assert session["audio"]["output"]["voice"] == "verse"
    assert session["audio"]["input"]["turn_detection"] is None
    assert session["audio"]["input"]["format"]["rate"] == 16000


# -- cancelling ---------------------------------------------------------------------------


async def test_cancelling_nothing_is_an_error_and_clearing_audio_cancels(sdk_settings):
    pipeline = streaming_echo(chunks=64, step_ms=50)  # about 3 s of streaming
    async with (
        serving(sdk_settings, pipeline) as base,
        running_worker(sdk_settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await client.recv()
        # Nothing reserved, nothing streaming: refused, and the session goes on.
        await client.send({"type": "response.cancel", "event_id": "evt_c1"})
        refused = (await client.until("error"))[-1]
        await client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "a long answer " * 10}]}})  # fmt: skip
        await client.send({"type": "response.create"})
        await client.until("response.output_text.delta")
        # While it streams, clearing the output audio cancels it.
        await client.send({"type": "output_audio_buffer.clear"})
        cut = await client.until("output_audio_buffer.cleared")
        done = [e for e in cut if e["type"] == "response.done"]
        # The answer ended: a cancel now finds nothing again; a barge-in is never refused.
        await client.send({"type": "response.cancel"})
        again = (await client.until("error"))[-1]
        await client.send({"type": "duplexq.barge_in"})
        await client.until("duplexq.response.cancelled")
    assert refused["error"]["code"] == "response_cancel_not_active"
    assert refused["error"]["event_id"] == "evt_c1"
    assert [d["response"]["status"] for d in done] == ["cancelled"]
    assert done[0]["response"]["status_details"]["reason"] == "client_cancelled"
    _validated(client.seen)
    assert cut[-1]["response_id"] == done[0]["response"]["id"]
    assert again["error"]["code"] == "response_cancel_not_active"


async def test_a_cancelled_turn_and_bad_input_through_the_sdk(sdk_settings):
    pipeline = streaming_echo(chunks=64, step_ms=50)  # about 3 s of streaming
    events: list[dict[str, Any]] = []

    async def until(kind: str) -> dict[str, Any]:
        async with asyncio.timeout(15):
            while True:
                events.append(json.loads(await connection.recv_bytes()))
                if events[-1]["type"] == kind:
                    return events[-1]

    async with (
        serving(sdk_settings, pipeline) as base,
        running_worker(sdk_settings, pipeline, "echo"),
    ):
        client = AsyncOpenAI(api_key="k1", websocket_base_url=f"{base}/v1")
        async with client.realtime.connect(model="duplexq") as connection:
            await until("session.created")
            # Bad input, each answered by an error naming it; the session goes on.
            await connection.send_raw("{not json")
            not_json = await until("error")
            await connection.send_raw(json.dumps({"type": "no.such.event", "event_id": "e1"}))
            unknown = await until("error")
            await connection.send_raw(json.dumps({"type": "input_audio_buffer.append",
                                                  "audio": "%%%", "event_id": "e2"}))  # fmt: skip
            not_base64 = await until("error")
            await connection.conversation.item.create(
                item={"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "a long answer " * 10}]}
            )  # fmt: skip
            await connection.response.create()
            await until("response.output_text.delta")
            await connection.response.cancel()
            done = await until("response.done")
            await connection.conversation.item.create(
                item={"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "again"}]}
            )  # fmt: skip
            await connection.response.create()
            while (again := await until("response.done"))["response"]["status"] != "completed":
                pass
        await client.close()
    _validated(events)
    assert not_json["error"]["code"] == "invalid_json"
    assert (unknown["error"]["code"], unknown["error"]["event_id"]) == ("unknown_event", "e1")
    assert (not_base64["error"]["code"], not_base64["error"]["event_id"]) == (
        "invalid_base64", "e2")  # fmt: skip
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    # Framed to the end: the cut text part and the item closed before response.done.
    closing = [e["type"] for e in events[events.index(done) - 4 : events.index(done)]]
    assert closing == ["response.output_text.done", "response.content_part.done",
                       "response.output_item.done", "conversation.item.done"]  # fmt: skip
    # The next turn is answered in full. (The echo answers an input as it arrives, so its
    # first chunk may come before response.create reserves the response: a response of
    # its own, superseded. A model answers only once asked.)
    after = events[events.index(done) + 1 :]
    said = [e["delta"] for e in after if e["type"] == "response.output_text.delta"]
    assert "".join(said) == "again" and again["response"]["status"] == "completed"
