"""The MiniCPM-o stage hands a unit's audio to an audio-language model, through a real engine.

A tiny random-weight Qwen2-Audio (``tests.tiny_audio_lm``; vLLM and
transformers serve it without remote code) stands in for MiniCPM-o: its
audio token is ``<unk>``, the placeholder the MiniCPM-o extension fills a
unit's budget with, so the stage runs unchanged (``send_media`` on because
vLLM reports the model multimodal; ``audio_marker = "<unk>"``, the marker
Qwen2-Audio's processor expands). The stage runs in a worker behind a real
coordinator and redis-server; the test records what reaches vLLM's
``AsyncLLM.generate`` without changing it.

What it shows: each unit's audio reaches vLLM as a float32 array at 16 kHz,
with one marker per unit in the prompt the stage sent; vLLM's Qwen2-Audio
processor received it, because it expanded each marker into the number of
audio tokens Qwen2-Audio's rule gives for the clip; and for 0.64 s clips,
where that rule and MiniCPM-o's budget both give 16 tokens, the expanded
prompt is token for token the prompt the stage accounted for (its
placeholder runs). Whether MiniCPM-o's own processor gives 12 tokens per
second and 66 per image block is checked on a GPU (bench/gpu_minicpmo_media.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.service import Coordinator
from schemas.config import PipelineConfig, StageConfig
from schemas.events import AudioPayload, InputMode, UnitPayload
from tests.engine_helpers import (
    TINY_ENGINE_OPTIONS,
    engine_fixture,
    engine_test_marks,
    eventually,
    model_dir_fixture,
)
from tests.pipeline_helpers import fast_settings, running_worker
from tests.tiny_audio_lm import build_tiny_audio_lm, qwen2_audio_tokens
from workers.extensions.budget import audio_tokens_for_samples

STAGE = "thinker"
SAMPLES = 10_240
"""0.64 s at 16 kHz: MiniCPM-o's budget and Qwen2-Audio's rule both give 16 tokens."""
ENGINE_OPTIONS = {
    **TINY_ENGINE_OPTIONS,
    "limit_mm_per_prompt": {"audio": 8},
    # The reserve is made of <unk>, here the audio token itself: none.
    "context_reserve": 0,
    "audio_marker": "<unk>",
}

engine_test = engine_test_marks("librosa.*")
model_dir = model_dir_fixture(build_tiny_audio_lm, "tiny-audio-lm")


def start_engine(model_dir: str):
    from workers.backends.minicpmo_engine import MiniCPMOEngine
    from workers.backends.minicpmo_options import parse_minicpmo_options

    return MiniCPMOEngine(parse_minicpmo_options(STAGE, {"model": model_dir, **ENGINE_OPTIONS}))


engine = engine_fixture(start_engine, record=True)


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix)


def clip(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, SAMPLES).astype(np.float32)


@engine_test
async def test_unit_audio_reaches_the_model_and_expands_to_the_budget(engine, settings):
    from workers.backends.minicpmo_stage import MiniCPMOStage

    assert audio_tokens_for_samples(SAMPLES) == qwen2_audio_tokens(SAMPLES) == 16
    backend = MiniCPMOStage(
        {"model": engine.options.model, **ENGINE_OPTIONS, "max_tokens": 2},
        stage=STAGE,
        engine=engine,
    )
    stage = StageConfig(name=STAGE, backend="minicpmo", to_client=True, options={"model": "x"})
    pipeline = PipelineConfig(name="duplex", stages=(stage,))
    coordinator = Coordinator(settings, pipeline)
    clips = [clip(1), clip(2)]
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("s1")
            for samples in clips:
                payload = UnitPayload(audio=AudioPayload(samples.astype("<f4").tobytes()))
                await coordinator.append("s1", InputMode.APPEND_UNIT, payload)
            await eventually(
                lambda: (
                    len(backend.records.values()) == 2
                    and all(r.outcome != "running" for r in backend.records.values())
                ),
                timeout=60.0,
            )
    finally:
        await coordinator.aclose()

    unk = engine.tokenizer.convert_tokens_to_ids("<unk>")
    first, second = backend.records.values()
    assert first.outcome.startswith("finished") and second.outcome.startswith("finished")
    for count, record in enumerate((first, second), 1):
        prompt, output = engine.recorder.requests[record.request_id]
        # The stage sent one marker per unit, and the units' audio in order.
        assert prompt["prompt_token_ids"].count(unk) == count
        audio = prompt["multi_modal_data"]["audio"]
        assert len(audio) == count
        for sent, original in zip(audio, clips, strict=False):
            assert sent.dtype == np.float32
            np.testing.assert_array_equal(sent, original)
        # vLLM's processor expanded each marker by Qwen2-Audio's rule, and the result is
        # the prompt the stage accounted for: its 16-token placeholder run per unit.
        assert output.prompt_token_ids.count(unk) == count * qwen2_audio_tokens(SAMPLES)
        assert tuple(output.prompt_token_ids) == record.prompt_token_ids
    assert second.prompt_token_ids[:16] == (unk,) * 16
