"""The shipped pipeline's thinker: a real instruction-tuned model, prepared offline.

``scripts/setup`` prepares ``package:smollm2-135m-instruct`` in ``var/models``
(``workers.backends.packaged_model``); these tests use that copy, as ``duplexq up``
does, and run it through vLLM behind a real stage worker.
"""

from __future__ import annotations

import logging
import os

import pytest

from coordinator.service import Coordinator
from schemas.config import PipelineConfig, load_pipeline
from schemas.events import OutputKind, TextPayload
from tests.pipeline_helpers import fast_settings, outputs_of, read_until, running_worker
from tests.processes import ROOT
from workers.backends.model_source import resolve_model
from workers.backends.packaged_model import PreparationFailed, prepare, prepared_path

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"):
    os.environ.setdefault(_name, "1")

MODELS = ROOT / "var" / "models"
THIRD_PARTY_WARNINGS = [
    pytest.mark.filterwarnings(f"ignore::{category}:{module}")
    for category in ("DeprecationWarning", "FutureWarning", "UserWarning")
    for module in ("torch.*", "vllm.*", "transformers.*")
]


def shipped_thinker() -> tuple[PipelineConfig, dict]:
    pipeline = load_pipeline(ROOT / "configs" / "default.toml")
    thinker = next(stage for stage in pipeline.stages if stage.name == "thinker")
    return pipeline, dict(thinker.options)


def test_the_shipped_thinker_is_a_packaged_model_that_setup_prepared(monkeypatch, caplog):
    _, options = shipped_thinker()
    assert options["model"] == "package:smollm2-135m-instruct"
    prepared = prepared_path("smollm2-135m-instruct", MODELS)
    assert prepared is not None, "scripts/setup prepares it in var/models"
    assert (prepared / "model.safetensors").is_file()
    assert (prepared / "chat_template.jinja").is_file() or "chat_template" in (
        prepared / "tokenizer_config.json"
    ).read_text()
    monkeypatch.setenv("DUPLEXQ_MODELS_DIR", str(MODELS))
    with caplog.at_level(logging.WARNING, logger="duplexq.worker.model"):
        assert resolve_model(options["model"], options["fallback_model_dir"]) == (
            str(prepared),
            False,
        )
    assert not caplog.records  # no fallback, nothing to warn about


def test_an_unknown_packaged_model_is_a_clear_error(tmp_path):
    with pytest.raises(PreparationFailed, match="unknown packaged model 'nope'; known: smollm2"):
        prepare("nope", tmp_path)


def test_the_fallback_is_built_under_the_models_directory(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DUPLEXQ_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.WARNING, logger="duplexq.worker.model"):
        path, fallback = resolve_model("no-such-org/no-such-model", "tiny-chat")
    assert fallback and path == str(tmp_path / "tiny-chat")
    assert "TINY model" in caplog.text


def _with_third_party_warnings(fn):
    for mark in THIRD_PARTY_WARNINGS:
        fn = mark(fn)
    return fn


@pytest.mark.timeout(480)
@_with_third_party_warnings
async def test_the_shipped_thinker_answers_in_real_words(redis_server, key_prefix, monkeypatch):
    from workers.backends.vllm_backend import VllmBackend

    monkeypatch.setenv("DUPLEXQ_MODELS_DIR", str(MODELS))
    pipeline, options = shipped_thinker()
    # The shipped options, greedy so the answer is the same on every run (this test
    # checks the path; tests/test_shipped_answers.py judges the shipped sampling).
    backend = VllmBackend({**options, "temperature": 0.0, "seed": 0}, stage="thinker")
    chat = PipelineConfig(
        name="chat",
        stages=tuple(s.model_copy(update={"input": "session"}) for s in pipeline.stages
                     if s.name == "thinker"),
    )  # fmt: skip
    settings = fast_settings(redis_server.url, key_prefix)
    coordinator = Coordinator(settings, chat)
    try:
        async with running_worker(settings, chat, "thinker", backend=backend):
            await coordinator.open("s1")
            await coordinator.append(
                "s1", "append_text", TextPayload("What is the capital of France?")
            )
            await coordinator.commit("s1")
            got = await read_until(
                coordinator,
                lambda got: any(o.kind is OutputKind.DONE for o in outputs_of(got)),
                timeout=240,
            )
        assert not backend.engine.fallback
        answer = "".join(o.text for o in outputs_of(got, OutputKind.TEXT_DELTA))
        assert "Paris" in answer, answer
        await _a_forced_call(settings, chat, backend)
        await _the_tool_loop_through_vad_and_asr(settings, pipeline, backend)
    finally:
        await coordinator.aclose()
        await backend.engine.shutdown()


async def _a_forced_call(settings, chat, backend) -> None:
    """SmolLM2's chat template has no place for tools: duplexq writes them into the
    system message in the Hermes format, and a named tool_choice constrains the answer
    to the function's arguments, so even this small model makes a valid call."""
    import json

    from schemas.events import InputMode, SettingsPayload
    from schemas.tools import FunctionTool, tools_text

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    tool = FunctionTool(name="get_weather", description="The weather in a city.",
                        parameters=schema)  # fmt: skip
    forced = SettingsPayload(tools=tools_text((tool,)), tool_choice="function:get_weather")
    coordinator = Coordinator(settings, chat)
    try:
        async with running_worker(settings, chat, "thinker", backend=backend):
            await coordinator.open("s2")
            await coordinator.append("s2", InputMode.UPDATE_SESSION, forced)
            await coordinator.append("s2", "append_text", TextPayload("Weather in Paris?"))
            await coordinator.commit("s2")
            got = await read_until(
                coordinator,
                lambda got: any(o.kind is OutputKind.DONE for o in outputs_of(got)),
                timeout=240,
            )
    finally:
        await coordinator.aclose()
    [call] = outputs_of(got, OutputKind.FUNCTION_CALL)
    assert call.meta["name"] == "get_weather"
    assert isinstance(json.loads(call.text)["city"], str)
    prompt = backend.records[outputs_of(got, OutputKind.DONE)[0].meta["request_id"]].prompt
    assert "You can call functions" in prompt and '"name": "get_weather"' in prompt


async def _the_tool_loop_through_vad_and_asr(settings, pipeline, backend) -> None:
    """The shipped pipeline's vad -> asr -> thinker (no speech synthesis): a forced call,
    the client's result, and the answer a ``response.create`` asks for (what the
    connection appends: ``CommitPayload(respond=True)``), though the asr stage heard
    nothing in that turn."""
    from schemas.events import CommitPayload, ConversationPayload, InputMode, SettingsPayload
    from schemas.tools import FunctionTool, tools_text
    from workers.backends.asr import AsrBackend
    from workers.backends.vad import VadBackend

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    tool = FunctionTool(name="get_weather", description="The weather in a city.",
                        parameters=schema)  # fmt: skip
    spoken = PipelineConfig(
        name="spoken", stages=tuple(s for s in pipeline.stages if s.name != "tts")
    )
    coordinator = Coordinator(settings, spoken)

    async def respond(sid: str) -> list:
        await coordinator.authority.reserve_response(sid)
        await coordinator.append(sid, InputMode.TURN_COMMIT_ONLY, CommitPayload(respond=True))

        def answered(got) -> bool:
            return any(o.stage == "thinker" for o in outputs_of(got, OutputKind.DONE))

        got = await read_until(coordinator, answered, timeout=240)
        return [o for o in outputs_of(got) if o.stage == "thinker"]

    try:
        async with (
            running_worker(settings, spoken, "vad", backend=VadBackend({})),
            running_worker(settings, spoken, "asr", backend=AsrBackend({})),
            running_worker(settings, spoken, "thinker", backend=backend),
        ):
            await coordinator.open("s3")
            forced = SettingsPayload(tools=tools_text((tool,)), tool_choice="function:get_weather")
            await coordinator.append("s3", InputMode.UPDATE_SESSION, forced)
            await coordinator.append("s3", "append_text", TextPayload("Weather in Paris?"))
            [call] = [o for o in await respond("s3") if o.kind is OutputKind.FUNCTION_CALL]
            auto = SettingsPayload(tools=tools_text((tool,)), tool_choice="auto")
            await coordinator.append("s3", InputMode.UPDATE_SESSION, auto)
            result = ConversationPayload("add", "item_result", role="tool", text="Sunny, 21 C",
                                         call_id=str(call.meta["call_id"]))  # fmt: skip
            await coordinator.append("s3", InputMode.EDIT_CONVERSATION, result)
            answer = await respond("s3")
    finally:
        await coordinator.aclose()
    said = [o for o in answer if o.kind in (OutputKind.TEXT_DELTA, OutputKind.FUNCTION_CALL)]
    assert said and "".join(o.text for o in said).strip()
    request_id = next(o for o in answer if o.kind is OutputKind.DONE).meta["request_id"]
    assert "Sunny, 21 C" in backend.records[request_id].prompt
