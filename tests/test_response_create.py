"""``response.create`` and item events with the reference API's semantics, end to end on
the echo pipeline (real uvicorn, real Redis); every server event is validated with the
official SDK's types. What the model does with a response's options (out of band, its
own input and instructions) is ``tests/test_tool_loop.py``'s part, on a real engine.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.response_requests import Create, RequestedResponses, ResponseRequests
from coordinator.service import Coordinator
from schemas.config import echo_pipeline
from schemas.events import CommitPayload, InputMode, decode_input
from schemas.fence import Fence
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import Client, asked_echo, serving, streaming_echo, text_turn
from tests.voice_helpers import SERVER_EVENT

EXTENSION_PREFIX = "duplexq."


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)


async def _until(client: Client, kind: str, within_s: float = 15) -> list[dict[str, Any]]:
    events = await client.until(kind, within_s)
    for event in events:
        if not event["type"].startswith(EXTENSION_PREFIX):
            SERVER_EVENT.validate_python(event)
    return events


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


# -- the one commit path ------------------------------------------------------------------


async def test_a_commit_reserves_its_response_then_journals_the_notice_then_appends(settings):
    """``Coordinator.commit`` is the one commit path (a client's commit, a
    ``response.create``'s): the notice is built from the reserved fence and is in the
    journal when the commit that asks for the response lands."""
    coordinator = Coordinator(settings, echo_pipeline("echo"))
    try:
        await coordinator.open("s1")
        told: list[Fence] = []

        def notice(fence: Fence) -> dict[str, Any]:
            told.append(fence)
            return {"type": "duplexq.response.requested", "response_id": "r"}

        commit = await coordinator.commit("s1", CommitPayload(respond=True), notice=notice)
        assert told == [commit.fence] and commit.fence.response_seq == 1
        assert await coordinator.reserved_response("s1") == 1
        sk = coordinator.bus.keys.session("s1")
        journal = [e.event for e in await coordinator.bus.xrange(sk.client) if e.event]
        assert len(journal) == 1 and b"duplexq.response.requested" in journal[0]
        (entry,) = await coordinator.bus.xrange(sk.input)
        logged = decode_input(entry.event)
        assert logged.mode is InputMode.TURN_COMMIT_ONLY and logged.payload.respond
        assert logged.seq == commit.receipt.seq and logged.fence == commit.fence
        # A plain commit (the control plane's, a test's) journals nothing.
        plain = await coordinator.commit("s1")
        assert plain.fence.response_seq == 2
        assert len([e for e in await coordinator.bus.xrange(sk.client) if e.event]) == 1
    finally:
        await coordinator.aclose()


# -- the rules (pure) -----------------------------------------------------------------------


def test_a_create_claims_a_commits_response_once_then_asks_or_is_refused():
    requests = ResponseRequests()
    requests.committed("resp_0_0_1")
    assert requests.decide(new_input=False, ended_up_to=0) is Create.CLAIM
    # A commit's response may never come (nothing heard): it does not refuse a create.
    assert requests.decide(new_input=False, ended_up_to=0) is Create.NEW
    requests.asked(2)
    # Reserved by a create and not yet seen to end: in progress, though nothing streams.
    assert requests.decide(new_input=True, ended_up_to=1) is Create.REFUSE
    assert requests.decide(new_input=False, ended_up_to=1) is Create.REFUSE
    assert requests.decide(new_input=True, ended_up_to=2) is Create.NEW


def test_requested_options_frame_the_response_and_never_reach_the_client():
    requested = RequestedResponses()
    notice = {"type": "duplexq.response.requested", "response_id": "resp_0_2_3",
              "metadata": {"client_event_id": "e1"}, "conversation": "none"}  # fmt: skip
    item = {"id": "item_0_2_3", "type": "message"}
    events = requested.frame([
        notice,
        {"type": "response.created", "response": {"id": "resp_0_2_3"}},
        {"type": "conversation.item.added", "item": item},
        {"type": "response.output_item.added", "item": item},
        {"type": "conversation.item.done", "item": item},
        {"type": "response.done", "response": {"id": "resp_0_2_3"}},
        {"type": "response.created", "response": {"id": "resp_0_3_4"}},
        {"type": "conversation.item.added", "item": {"id": "item_0_3_4"}},
    ])  # fmt: skip
    assert _types(events) == ["response.created", "response.output_item.added",
                              "response.done", "response.created",
                              "conversation.item.added"]  # fmt: skip
    assert events[0]["response"]["metadata"] == events[2]["response"]["metadata"]
    assert events[2]["response"]["metadata"] == {"client_event_id": "e1"}
    assert "metadata" not in events[3]["response"]


# -- through the API ---------------------------------------------------------------------------


async def test_a_response_from_the_conversation_with_no_new_input(settings):
    pipeline = echo_pipeline("echo")
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await _until(client, "session.created")
        for event in text_turn("hello"):
            await client.send(event)
        first = (await _until(client, "response.done"))[-1]["response"]
        await client.send({"type": "response.create"})
        events = await _until(client, "response.done")
    second = events[-1]["response"]
    assert "response.created" in _types(events)
    assert second["status"] == "completed" and second["id"] != first["id"]


async def test_a_create_is_answered_with_response_created_before_any_output(settings):
    """A client waits for ``response.created`` to match its ``response.create`` (LiveKit
    Agents for a few seconds, by ``metadata.client_event_id``), while a model may take
    longer to say its first word: the response is created when the request is taken.
    No worker runs here, so no output ever comes; a cancel still ends the response, once."""
    pipeline = echo_pipeline("echo")
    metadata = {"client_event_id": "ce_7"}
    async with serving(settings, pipeline) as base, Client.connect(base) as client:
        await _until(client, "session.created")
        await client.send({"type": "response.create", "response": {"metadata": metadata}})
        [created] = (await _until(client, "response.created"))[-1:]
        await client.send({"type": "response.cancel"})
        events = await _until(client, "response.done")
    assert created["response"]["metadata"] == metadata
    assert created["response"]["status"] == "in_progress"
    assert "response.created" not in _types(events)
    done = events[-1]["response"]
    assert done["id"] == created["response"]["id"] and done["metadata"] == metadata
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "client_cancelled")


async def test_metadata_is_echoed_and_a_second_create_is_refused_while_one_runs(settings):
    pipeline = streaming_echo(chunks=20, step_ms=50)  # a second of streaming
    metadata = {"client_event_id": "ce_1", "topic": "greeting"}
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await _until(client, "session.created")
        await client.send({"type": "response.create", "response": {"metadata": metadata}})
        asked = await _until(client, "response.done")
        # A turn whose answer streams for a second (echo streams the text, then the
        # commit's done ends it), and a second create meanwhile.
        for event in text_turn("hello there"):
            await client.send(event)
        await _until(client, "response.created")
        await client.send({"type": "response.create", "event_id": "again"})
        events = await _until(client, "response.done")
        while events[-1]["response"]["status"] != "completed":  # the echo superseded
            events += await _until(client, "response.done")
        # The session goes on: another response is taken once that one is done.
        await client.send({"type": "response.create"})
        after = (await _until(client, "response.done"))[-1]
    created = next(e for e in asked if e["type"] == "response.created")
    assert created["response"]["metadata"] == asked[-1]["response"]["metadata"] == metadata
    [error] = [e for e in events if e["type"] == "error"]
    assert error["error"]["code"] == "conversation_already_has_active_response"
    assert error["error"]["event_id"] == "again"
    assert events[-1]["response"]["status"] == "completed"
    assert after["response"]["status"] == "completed" and "metadata" not in after["response"]


async def test_an_out_of_band_response_adds_no_conversation_item(settings):
    """Echo answers a commit with a function's result waiting for it: a message item."""
    pipeline = echo_pipeline("echo")
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await _until(client, "session.created")
        result = {"type": "function_call_output", "call_id": "call_x", "output": "sunny"}
        for conversation in ("none", "auto"):
            await client.send({"type": "conversation.item.create", "item": result})
            await _until(client, "conversation.item.done")
            await client.send({"type": "response.create", "response": {
                "conversation": conversation, "metadata": {"purpose": conversation}}})  # fmt: skip
            client.seen.clear()
            await _until(client, "response.done")
            if conversation == "none":
                outside = list(client.seen)
        inside = list(client.seen)
    for events, conversation in ((outside, "none"), (inside, "auto")):
        done = events[-1]["response"]
        assert done["metadata"] == {"purpose": conversation} and done["output"]
        assert "response.output_item.added" in _types(events)
    assert not [e for e in outside if e["type"].startswith("conversation.item")]
    assert "conversation.item.added" in _types(inside)


async def test_items_are_announced_retrieved_and_unknown_ones_refused(settings):
    pipeline = asked_echo()
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await _until(client, "session.created")
        await client.send({"type": "conversation.item.create", "item": {
            "id": "item_sys", "type": "message", "role": "system",
            "content": [{"type": "input_text", "text": "Be brief."}]}})  # fmt: skip
        announced = await _until(client, "conversation.item.done")
        await client.send({"type": "conversation.item.retrieve", "item_id": "item_sys"})
        retrieved = (await _until(client, "conversation.item.retrieved"))[-1]
        refusals = []
        for event in (
            {"type": "conversation.item.delete", "item_id": "item_nope", "event_id": "d"},
            {"type": "conversation.item.retrieve", "item_id": "item_nope", "event_id": "r"},
            {"type": "input_audio_buffer.commit", "event_id": "c"},
        ):
            await client.send(event)
            refusals.append((await _until(client, "error"))[-1]["error"])
        await client.send({"type": "conversation.item.delete", "item_id": "item_sys"})
        await _until(client, "conversation.item.deleted")
        await client.send({"type": "conversation.item.retrieve", "item_id": "item_sys"})
        gone = (await _until(client, "error"))[-1]["error"]
        # A response's own items are known too.
        for event in text_turn("hi"):
            await client.send(event)
        done = (await _until(client, "response.done"))[-1]["response"]
        await client.send(
            {"type": "conversation.item.retrieve", "item_id": done["output"][0]["id"]}
        )
        answer = (await _until(client, "conversation.item.retrieved"))[-1]["item"]
    assert _types(announced)[-3:] == ["conversation.item.created", "conversation.item.added",
                                      "conversation.item.done"]  # fmt: skip
    assert all(e["item"]["id"] == "item_sys" for e in announced[-3:])
    assert retrieved["item"]["role"] == "system" and retrieved["item"]["id"] == "item_sys"
    assert [(e["code"], e["event_id"]) for e in refusals] == [
        ("item_delete_invalid_item_id", "d"), ("item_retrieve_invalid_item_id", "r"),
        ("input_audio_buffer_commit_empty", "c")]  # fmt: skip
    assert gone["code"] == "item_retrieve_invalid_item_id"
    assert answer["role"] == "assistant" and answer["status"] == "completed"
