"""The tool loop and ``response.create``'s options on a real model, through the API.

The default pipeline's shape (vad -> asr -> a vLLM thinker), the thinker on the tiny
model of ``tests.tiny_model`` (greedy): a forced call, the client's result, and the
answer ``response.create`` asks for, although the turn added nothing the asr stage
heard. Then what a response's own options do to the model's conversation: an
out-of-band response leaves it as it was, a response's ``input`` replaces it for that
response, its ``instructions`` are for that response only. Every server event is
validated with the official SDK's types.

The shipped model (SmolLM2) runs the same loop in ``tests/test_default_model.py``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from schemas.config import PipelineConfig, StageConfig
from tests.engine_helpers import (
    TINY_ENGINE_OPTIONS,
    engine_fixture,
    engine_test_marks,
    model_dir_fixture,
)
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import Client, serving
from tests.tiny_model import build_tiny_model
from tests.voice_helpers import SERVER_EVENT

STAGE = "thinker"
PIPELINE = PipelineConfig(
    name="spoken",
    stages=(
        StageConfig(name="vad", backend="vad", to_client=False),
        StageConfig(name="asr", backend="asr", input="vad", to_client=True),
        StageConfig(name=STAGE, backend="vllm", input="asr", to_client=True,
                    options={"model": "x"}),
    ),
)  # fmt: skip
TOOL = {"type": "function", "name": "get_time", "description": "The time now.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string",
                       "enum": ["UTC", "CET"]}}, "required": ["tz"],
                       "additionalProperties": False}}  # fmt: skip

engine_test = engine_test_marks("onnxruntime.*", "faster_whisper.*", "ctranslate2.*")
model_dir = model_dir_fixture(build_tiny_model, "tiny-model")


def start_engine(model_dir: str):
    from workers.backends.vllm_engine import VllmEngine
    from workers.backends.vllm_options import parse_options

    return VllmEngine(parse_options(STAGE, {"model": model_dir, **TINY_ENGINE_OPTIONS}))


engine = engine_fixture(start_engine)


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)


@contextlib.asynccontextmanager
async def spoken_pipeline(settings, engine) -> AsyncIterator[tuple[Client, Any]]:
    from workers.backends.asr import AsrBackend
    from workers.backends.vad import VadBackend
    from workers.backends.vllm_backend import VllmBackend

    options = {"model": engine.options.model, **TINY_ENGINE_OPTIONS, "max_tokens": 24}
    thinker = VllmBackend(options, stage=STAGE, engine=engine)
    async with (
        serving(settings, PIPELINE) as base,
        running_worker(settings, PIPELINE, "vad", backend=VadBackend({})),
        running_worker(settings, PIPELINE, "asr", backend=AsrBackend({})),
        running_worker(settings, PIPELINE, STAGE, backend=thinker),
        Client.connect(base) as client,
    ):
        await _until(client, "session.created")
        yield client, thinker


async def _until(client: Client, kind: str, within_s: float = 60) -> list[dict[str, Any]]:
    events = await client.until(kind, within_s)
    for event in events:
        if not event["type"].startswith("duplexq."):
            SERVER_EVENT.validate_python(event)
    return events


async def _respond(client: Client, **response: Any) -> dict[str, Any]:
    await client.send({"type": "response.create", **({"response": response} if response else {})})
    return (await _until(client, "response.done"))[-1]["response"]


async def _say(client: Client, text: str) -> None:
    content = [{"type": "input_text", "text": text}]
    item = {"type": "message", "role": "user", "content": content}
    await client.send({"type": "conversation.item.create", "item": item})
    await _until(client, "conversation.item.done")


def _latest_prompt(thinker: Any) -> str:
    return list(thinker.records.values())[-1].prompt


def _assistant(prompt: str) -> list[str]:
    return re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", prompt, re.S)


@engine_test
async def test_a_result_then_response_create_gets_an_answer(engine, settings):
    async with spoken_pipeline(settings, engine) as (client, thinker):
        await client.send({"type": "session.update", "session": {"type": "realtime",
                                                                 "tools": [TOOL]}})  # fmt: skip
        await _until(client, "session.updated")
        await _say(client, "what time is it")
        called = await _respond(client, tool_choice={"type": "function", "name": "get_time"})
        [call] = called["output"]
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "12:00"}
        await client.send({"type": "conversation.item.create", "item": result})
        await _until(client, "conversation.item.done")
        answered = await _respond(client)
    assert call["type"] == "function_call" and json.loads(call["arguments"])["tz"] in ("UTC", "CET")
    assert answered["status"] == "completed"
    [message] = answered["output"]
    assert message["type"] == "message" and message["content"][0]["text"]
    assert "<tool_response>12:00</tool_response>" in _latest_prompt(thinker)


@engine_test
async def test_a_response_from_the_conversation_alone(engine, settings):
    async with spoken_pipeline(settings, engine) as (client, thinker):
        await _say(client, "hello")
        first = await _respond(client)
        again = await _respond(client)  # nothing new: answered from the conversation
    said = first["output"][0]["content"][0]["text"]
    assert again["status"] == "completed" and again["output"]
    assert _assistant(_latest_prompt(thinker)) == [said]


@engine_test
async def test_out_of_band_input_and_instructions_leave_the_conversation_as_it_was(
    engine, settings
):
    async with spoken_pipeline(settings, engine) as (client, thinker):
        await _say(client, "hello")
        said = (await _respond(client))["output"][0]["content"][0]["text"]
        outside = await _respond(client, conversation="none", instructions="Only this once.")
        prompt_outside = _latest_prompt(thinker)
        own = await _respond(client, conversation="none", input=[
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "a context of its own"}]}])  # fmt: skip
        prompt_own = _latest_prompt(thinker)
        await _say(client, "and then")
        await _respond(client)
        prompt_after = _latest_prompt(thinker)
    assert outside["output"] and own["output"]
    assert prompt_outside.startswith("<|im_start|>system\nOnly this once.<|im_end|>")
    assert "hello" in prompt_outside
    assert "hello" not in prompt_own and "a context of its own" in prompt_own
    # Neither answer joined the conversation; the instructions were for one response.
    assert _assistant(prompt_after) == [said]
    assert "Only this once." not in prompt_after and "a context of its own" not in prompt_after
