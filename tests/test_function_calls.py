"""Function calling: the rules of the model stage, the events a client sees, and fencing.

The model stage itself (a real vLLM engine on the tiny model) is
``tests/test_vllm_stage.py``'s part (``test_g_*``); here are its pure rules, the
server events validated with the official SDK's types, and the coordinator's
fencing of calls, with a thinker that calls a function whenever the session
declares one (so each race is placed exactly).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI

from schemas.config import PipelineConfig, StageConfig
from schemas.events import (
    CommitPayload,
    ConversationPayload,
    InputEvent,
    OutputKind,
    session_payload_of,
)
from schemas.fence import Fence
from schemas.realtime import SessionConfig
from schemas.session_shape import merged, stage_settings
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import serving
from tests.test_realtime_conformance import _out, _translate, _types, _validated
from tests.voice_helpers import receive
from workers.backends.base import OutputDraft, StageContext, StageEvent
from workers.backends.echo import EchoBackend
from workers.backends.vllm_tools import CallGate, ToolPlan, forced_calls, plain_history, plan_for

PIPELINE = PipelineConfig(
    name="tools", stages=(StageConfig(name="thinker", backend="echo", to_client=True),)
)
TIME_TOOL = {"type": "function", "name": "get_time", "description": "The time now.",
             "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                            "required": ["tz"]}}  # fmt: skip


# -- the rules ----------------------------------------------------------------------------


def test_session_tools_reach_the_stages_in_the_chat_completions_shape():
    config = merged(
        SessionConfig(),
        {
            "type": "realtime",
            "tools": [TIME_TOOL],
            "tool_choice": {"type": "function", "name": "get_time"},
        },
    )
    settings = stage_settings(config)
    assert json.loads(settings.tools) == [{"type": "function", "function": {
        "name": "get_time", "description": "The time now.",
        "parameters": TIME_TOOL["parameters"]}}]  # fmt: skip
    assert settings.tool_choice == "function:get_time"
    plan = plan_for(settings, None)
    assert plan.forced == "get_time" and plan.schema() == TIME_TOOL["parameters"]
    # A response.create's own tools replace the session's for that response.
    assert not plan_for(settings, {"tools": "[]"}).active
    assert plan_for(settings, {"tool_choice": "auto"}).forced is None


def test_the_gate_streams_text_until_a_call_tag_and_holds_what_may_start_one():
    gate = CallGate()
    pieces = ["Sure", ", one moment. <tool", '_call>{"name": "get_time"', "}</tool_call>"]
    streamed = [gate.feed(piece, piece) for piece in pieces]
    assert streamed == [["Sure"], [], [], []]
    assert gate.calling and gate.text == "".join(pieces)
    quiet = CallGate()
    assert [quiet.feed(p, p) for p in ["a <to", "ast> b"]] == [[], ["a <to", "ast> b"]]
    assert quiet.flush() == [] and not quiet.calling


def test_a_forced_answer_is_one_call_with_its_arguments():
    fence = Fence("s1", 0, 2, 3, 3)
    named = ToolPlan(({"type": "function", "function": {"name": "get_time"}},), "function:get_time")
    [call] = forced_calls(named, '{"tz":"UTC"}', fence)
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "call_2_3_3_0", "get_time", {"tz": "UTC"})  # fmt: skip
    required = ToolPlan(named.tools, "required")
    [call] = forced_calls(required, '{"name":"get_time","arguments":{"tz":"CET"}}', fence)
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"tz": "CET"})
    assert forced_calls(named, "not json", fence) == []


def test_a_template_without_tools_gets_calls_and_results_as_text():
    chat = [{"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_time", "arguments": '{"tz":"UTC"}'}}]},
            {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]  # fmt: skip
    assert plain_history(chat) == [
        {"role": "assistant",
         "content": '<tool_call>{"name": "get_time", "arguments": {"tz":"UTC"}}</tool_call>'},
        {"role": "user", "content": "<tool_response>12:00</tool_response>"},
    ]  # fmt: skip


# -- the events ---------------------------------------------------------------------------


def test_a_function_call_is_framed_as_the_reference_api_frames_it():
    call = _out(1, OutputKind.FUNCTION_CALL, text='{"tz":"UTC"}',
                meta={"call_id": "call_0_1_1_0", "name": "get_time"})  # fmt: skip
    events = _validated(_translate([call, _out(2, OutputKind.DONE)]))
    assert _types(events) == [
        "response.created", "response.output_item.added", "conversation.item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "conversation.item.done", "response.done",
    ]  # fmt: skip
    done = events[4]
    assert (done["call_id"], done["name"], done["arguments"]) == (
        "call_0_1_1_0", "get_time", '{"tz":"UTC"}')  # fmt: skip
    [item] = events[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert item["call_id"] == "call_0_1_1_0"


def test_text_then_a_call_are_two_items_in_order():
    events = _validated(_translate([
        _out(1, OutputKind.TEXT_DELTA, text="Let me check."),
        _out(2, OutputKind.FUNCTION_CALL, text="{}", meta={"call_id": "c", "name": "get_time"}),
        _out(3, OutputKind.DONE),
    ]))  # fmt: skip
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1]


# -- fencing, through the SDK ------------------------------------------------------------------


class _Caller(EchoBackend):
    """A thinker that answers every turn with a call of the session's first tool (its
    arguments: the turn's text), and a function's result with ``result: <output>``."""

    edits_conversation = True

    def __init__(self, *, step_ms: int = 0) -> None:
        super().__init__()
        self.results: list[ConversationPayload] = []
        """Every function result given to this thinker, any session."""
        self.step_s = step_ms / 1000

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        edit = session_payload_of(event) if isinstance(event, InputEvent) else None
        if isinstance(edit, ConversationPayload) and edit.role == "tool":
            self.results.append(edit)
            ctx.state["result"] = edit.text

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        if not isinstance(event, InputEvent):
            return
        if not isinstance(event.payload, CommitPayload):
            ctx.state["said"] = getattr(event.payload, "text", "")
            return
        said, result = ctx.state.pop("said", ""), ctx.state.pop("result", "")
        plan, ctx.next_response = plan_for(ctx.session, ctx.next_response), None
        if result and not said:
            yield OutputDraft(OutputKind.TEXT_DELTA, text=f"result: {result}")
        elif plan.active:
            await asyncio.sleep(self.step_s)  # the model deliberating
            name = plan.tools[0]["function"]["name"]
            yield OutputDraft(OutputKind.FUNCTION_CALL, text=json.dumps({"q": said}),
                              meta={"call_id": f"call_{event.seq}", "name": name})  # fmt: skip
        yield OutputDraft(OutputKind.DONE)


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)


async def _until(connection: Any, seen: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """Events (each validated with the SDK's types) up to the first of ``kind``."""
    return (await receive(connection, seen, lambda e: e["type"] == kind, within_s=15))[-1]


async def _session(base: str) -> tuple[AsyncOpenAI, Any]:
    client = AsyncOpenAI(api_key="k1", websocket_base_url=f"{base}/v1")
    return client, client.realtime.connect(model="duplexq")


async def test_a_call_its_result_and_the_answer_through_the_sdk(settings):
    pipeline = PIPELINE
    thinker = _Caller()
    seen: list[dict[str, Any]] = []

    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "thinker", backend=thinker),
    ):
        client, connecting = await _session(base)
        async with connecting as connection:
            await _until(connection, seen, "session.created")
            await connection.session.update(session={"type": "realtime", "tools": [TIME_TOOL]})
            await _until(connection, seen, "session.updated")
            await connection.conversation.item.create(item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "what time is it"}]})  # fmt: skip
            await connection.response.create()
            called = await _until(connection, seen, "response.function_call_arguments.done")
            await _until(connection, seen, "response.done")
            await connection.conversation.item.create(item={
                "type": "function_call_output", "call_id": called["call_id"],
                "output": "12:00"})  # fmt: skip
            await connection.response.create()
            answered = await _until(connection, seen, "response.done")
        await client.close()
    assert (called["name"], json.loads(called["arguments"])) == (
        "get_time", {"q": "what time is it"})  # fmt: skip
    assert [(r.call_id, r.text) for r in thinker.results] == [(called["call_id"], "12:00")]
    assert answered["response"]["output"][0]["content"][0]["text"] == "result: 12:00"


async def test_a_result_for_an_interrupted_call_is_refused_once(settings):
    pipeline = PIPELINE
    thinker = _Caller()
    seen: list[dict[str, Any]] = []

    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "thinker", backend=thinker),
    ):
        client, connecting = await _session(base)
        async with connecting as connection:
            await _until(connection, seen, "session.created")
            await connection.session.update(session={"type": "realtime", "tools": [TIME_TOOL]})
            await connection.conversation.item.create(item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "book it"}]})  # fmt: skip
            await connection.response.create()
            called = await _until(connection, seen, "response.function_call_arguments.done")
            await _until(connection, seen, "response.done")
            # The user barges in before the client ran the function.
            await connection.send({"type": "duplexq.barge_in"})
            await _until(connection, seen, "duplexq.response.cancelled")
            result = {"type": "function_call_output", "call_id": called["call_id"],
                      "output": "booked"}  # fmt: skip
            await connection.send({"type": "conversation.item.create", "event_id": "late",
                                   "item": result})  # fmt: skip
            refused = await _until(connection, seen, "error")
            await asyncio.sleep(0.3)
            assert thinker.results == []  # not given to the model under the new epoch
            # Sent again, on purpose: taken.
            await connection.conversation.item.create(item=result)
            await _until(connection, seen, "conversation.item.created")
            await connection.response.create()
            answered = await _until(connection, seen, "response.done")
        await client.close()
    assert refused["error"]["code"] == "function_call_stale"
    assert refused["error"]["event_id"] == "late"
    assert [r.text for r in thinker.results] == ["booked"]
    assert answered["response"]["output"][0]["content"][0]["text"] == "result: booked"


async def test_a_call_of_a_cancelled_response_never_reaches_the_client(settings):
    pipeline = PIPELINE
    thinker = _Caller(step_ms=1500)  # the call comes 1.5 s into the response
    seen: list[dict[str, Any]] = []
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "thinker", backend=thinker),
    ):
        client, connecting = await _session(base)
        async with connecting as connection:
            seen.append(json.loads(await connection.recv_bytes()))
            await connection.session.update(session={"type": "realtime", "tools": [TIME_TOOL]})
            await connection.conversation.item.create(item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "call someone"}]})  # fmt: skip
            await connection.response.create()
            await asyncio.sleep(0.5)
            await connection.send({"type": "duplexq.barge_in"})
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(3):  # well past when the call would have come
                    while True:
                        seen.append(json.loads(await connection.recv_bytes()))
        await client.close()
    kinds = [e["type"] for e in seen]
    assert "duplexq.response.cancelled" in kinds
    assert not [k for k in kinds if "function_call" in k]


async def test_a_session_with_calls_replays_with_its_results_fed_back(settings):
    from coordinator.controlplane.replay import replay_session
    from coordinator.service import Coordinator
    from schemas.events import InputMode, SettingsPayload, TextPayload
    from schemas.tools import FunctionTool, tools_text
    from tests.pipeline_helpers import collect

    tools = tools_text((FunctionTool(name="get_time"),))
    coordinator = Coordinator(settings, PIPELINE)
    try:
        async with running_worker(settings, PIPELINE, "thinker", backend=_Caller()):
            await coordinator.open("src")
            await coordinator.append("src", InputMode.UPDATE_SESSION, SettingsPayload(tools=tools))
            await coordinator.append("src", InputMode.APPEND_TEXT, TextPayload("what time"))
            await coordinator.commit("src")
            result = ConversationPayload("add", "item_r", role="tool", text="noon",
                                         call_id="call_3")  # fmt: skip
            await coordinator.append("src", InputMode.EDIT_CONVERSATION, result)
            await coordinator.commit("src")
            await collect(coordinator, 4)  # the source's outputs are all in
            report = await replay_session(coordinator.bus, PIPELINE, "src", "copy", quiet_s=1)
    finally:
        await coordinator.aclose()
    assert report.identical, report.summary()
    assert report.comparison.matched == 4  # the call, its done, the answer, its done


def test_a_replay_comparison_tells_calls_apart():
    from coordinator.controlplane.replay import compare_outputs

    def call(name: str) -> Any:
        return _out(1, OutputKind.FUNCTION_CALL, text="{}", meta={"name": name, "call_id": "c"})

    assert compare_outputs([call("get_time")], [call("get_time")]).identical
    assert not compare_outputs([call("get_time")], [call("get_date")]).identical


@pytest.mark.parametrize("point", ["after_read", "before_publish", "after_publish"])
async def test_a_call_survives_its_workers_death_and_is_emitted_once(settings, tmp_path, point):
    """kill -9 of the worker making a call, at each step of the protocol: the new owner
    emits the call (it joins the session's stored settings), and exactly once."""
    from coordinator.service import Coordinator
    from schemas.config import echo_pipeline
    from schemas.events import InputMode, TextPayload
    from schemas.session_shape import stage_settings
    from tests.pipeline_helpers import collect, outputs_of
    from tests.processes import WorkerProcess, wait_for_file, write_pipeline

    pipeline = echo_pipeline("echo")
    path = write_pipeline(tmp_path, pipeline)
    marker = tmp_path / "marker"
    env = {"DUPLEXQ_FAILPOINT": f"{point}:3", "DUPLEXQ_FAILPOINT_MARKER": str(marker)}
    first = WorkerProcess(settings, path, "echo", "first", tmp_path, env=env)
    second = WorkerProcess(settings, path, "echo", "second", tmp_path)
    coordinator = Coordinator(settings, pipeline)
    try:
        first.start()
        await coordinator.open("s1")
        # What a connection does on session.update: store the settings, then log them.
        config = merged(SessionConfig(), {"type": "realtime", "tools": [TIME_TOOL]})
        meta = coordinator.bus.keys.session("s1").meta
        await coordinator.bus.hset(meta, {"config": config.model_dump_json()})
        await coordinator.append("s1", InputMode.UPDATE_SESSION, stage_settings(config))
        await coordinator.append("s1", InputMode.APPEND_TEXT, TextPayload("before"))
        await coordinator.append("s1", InputMode.APPEND_TEXT, TextPayload("call:abc"))  # seq 3
        await asyncio.to_thread(wait_for_file, marker)
        second.start()
        first.kill()
        await coordinator.append("s1", InputMode.APPEND_TEXT, TextPayload("after"))
        got = await collect(coordinator, 3, timeout=30)
    finally:
        first.terminate()
        second.terminate()
        await coordinator.aclose()
    calls = outputs_of(got, OutputKind.FUNCTION_CALL)
    assert [(c.meta["name"], c.meta["call_id"], c.text) for c in calls] == [
        ("get_time", "call_3", '{"text": "abc"}')
    ]
    texts = [o.text for o in outputs_of(got, OutputKind.TEXT_DELTA)]
    assert texts == ["before", "after"]


async def test_tools_named_by_one_response_create_are_for_that_response_only(settings):
    thinker = _Caller()
    seen: list[dict[str, Any]] = []

    async def turn(connection: Any, text: str, **response: Any) -> list[str]:
        await connection.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}]})  # fmt: skip
        await connection.response.create(**({"response": response} if response else {}))
        kinds = []
        async with asyncio.timeout(15):
            while not kinds or kinds[-1] != "response.done":
                seen.append(json.loads(await connection.recv_bytes()))
                kinds.append(seen[-1]["type"])
        return kinds

    async with (
        serving(settings, PIPELINE) as base,
        running_worker(settings, PIPELINE, "thinker", backend=thinker),
    ):
        client, connecting = await _session(base)
        async with connecting as connection:
            json.loads(await connection.recv_bytes())  # session.created
            with_tools = await turn(connection, "what time", tools=[TIME_TOOL])
            without = await turn(connection, "and now")
        await client.close()
    assert "response.function_call_arguments.done" in with_tools
    assert not [kind for kind in without if "function_call" in kind]


async def test_an_echo_takeover_finds_a_result_still_waiting_for_its_commit():
    from schemas.events import InputMode, TextPayload

    fence = Fence("s1")
    result = ConversationPayload("add", "item_r", role="tool", text="noon", call_id="c")
    text = InputEvent(fence, 1, 1, InputMode.APPEND_TEXT, TextPayload("call:x"))
    edit = InputEvent(fence, 2, 2, InputMode.EDIT_CONVERSATION, result)
    commit = InputEvent(fence, 3, 3, InputMode.TURN_COMMIT_ONLY, CommitPayload())
    waiting, answered = StageContext("s1", "echo", fence, {}), StageContext("s1", "echo", fence, {})
    await EchoBackend().start(waiting, [text, edit], [])
    await EchoBackend().start(answered, [text, edit, commit], [])
    assert waiting.state == {"result": "noon"} and answered.state == {}
