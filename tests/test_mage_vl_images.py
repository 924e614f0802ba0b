"""The Mage-VL stage shows a vision-language model its frames, through a real engine.

A tiny random-weight Idefics3 (``tests.tiny_vlm``: SmolVLM's architecture,
which vLLM and transformers serve without remote code or torchvision) stands
in for a vision-language Mage-VL checkpoint. The stage runs in a worker
behind a real coordinator and redis-server, with ``image_placeholder =
"<image>"``; the test records what reaches vLLM's ``AsyncLLM.generate`` (the
prompt the stage built and the outputs) without changing it.

What it shows: the request carries the frames of the described windows as
PIL images, one ``<image>`` per frame in the prompt the stage built; vLLM's
Idefics3 processor received them, because it expanded each placeholder into
exactly the number of image tokens Idefics3's rule gives for that frame's
size (``idefics3_image_tokens``: 12 for a 100x40 frame, 20 for a 30x30 one),
wrapped in the processor's ``<fake_token_around_image>`` markers.
"""

from __future__ import annotations

import io

import pytest
from PIL import Image

from coordinator.service import Coordinator
from schemas.config import PipelineConfig, StageConfig
from schemas.events import OutputKind, TextPayload, VideoPayload
from tests.engine_helpers import (
    TINY_ENGINE_OPTIONS,
    engine_fixture,
    engine_test_marks,
    model_dir_fixture,
)
from tests.pipeline_helpers import fast_settings, read_until, running_worker
from tests.pipeline_helpers import outputs_of as outputs
from tests.tiny_vlm import IMAGE_SEQ_LEN, build_tiny_vlm, idefics3_image_tokens

STAGE = "watcher"
ENGINE_OPTIONS = {**TINY_ENGINE_OPTIONS, "limit_mm_per_prompt": {"image": 8}}
SIZES = [(100, 40), (30, 30)]
"""Frame sizes: one wide frame (a 1x2 tile grid) and one small square (2x2)."""

engine_test = engine_test_marks("PIL.*")


def png(size: tuple[int, int], shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (shade, 255 - shade, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


model_dir = model_dir_fixture(build_tiny_vlm, "tiny-vlm")


def start_engine(model_dir: str):
    from workers.backends.mage_vl_core import parse_options
    from workers.backends.minicpmo_engine import MiniCPMOEngine

    return MiniCPMOEngine(parse_options(STAGE, {"model": model_dir, **ENGINE_OPTIONS}).engine)


engine = engine_fixture(start_engine, record=True)


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, lease_ttl_ms=3000, heartbeat_ms=750)


@engine_test
async def test_frames_reach_the_model_as_images_and_expand_by_idefics3s_rule(engine, settings):
    from workers.backends.mage_vl_stage import MageVLStage

    options = {"model": engine.options.model, **ENGINE_OPTIONS}
    backend = MageVLStage(
        {**options, "image_placeholder": "<image>", "gate_decision": "never", "window_size": 2,
         "gate_max_tokens": 2, "generate_max_tokens": 3},
        stage=STAGE, engine=engine,
    )  # fmt: skip
    stage = StageConfig(name=STAGE, backend="mage_vl", to_client=True, options={"model": "x"})
    pipeline = PipelineConfig(name="video", stages=(stage,))
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("v")
            for pts, (size, shade) in enumerate(zip(SIZES, (30, 200), strict=True)):
                payload = VideoPayload((png(size, shade),), "png", pts * 500, 100)
                await coordinator.append("v", "append_video_frame", payload)
            await coordinator.append("v", "append_text", TextPayload("what do you see?"))
            await coordinator.commit("v")
            got = await read_until(coordinator, lambda o: outputs(o, OutputKind.DONE))
            assert outputs(got)[-1].meta["trigger"] == "query"
    finally:
        await coordinator.aclose()

    tokenizer = engine.tokenizer
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    around_id = tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    (answer,) = [r for r in backend.records.values() if r.purpose == "answer"]
    assert answer.windows == 2 and answer.outcome.startswith("finished")
    prompt, output = engine.recorder.requests[answer.request_id]
    # The stage built a prompt with one placeholder per frame and sent the frames.
    assert prompt["prompt_token_ids"] == engine.encode(answer.prompt)
    assert prompt["prompt_token_ids"].count(image_id) == len(SIZES)
    assert [image.size for image in prompt["multi_modal_data"]["image"]] == SIZES
    # vLLM's Idefics3 processor expanded each placeholder by the frame's size.
    expected = [idefics3_image_tokens(*size) for size in SIZES]
    assert expected == [12, 20]
    expanded = output.prompt_token_ids
    assert expanded.count(image_id) == sum(expected)
    runs = image_runs(expanded, image_id)
    assert all(length == IMAGE_SEQ_LEN for length in runs)
    assert len(runs) == sum(expected) // IMAGE_SEQ_LEN  # one run per tile or global view
    assert expanded.count(around_id) == len(runs) + len(SIZES)  # each view opens, each image closes
    # The gate saw the same two frames.
    (gate,) = [r for r in backend.records.values() if r.purpose == "gate"]
    gate_prompt, gate_output = engine.recorder.requests[gate.request_id]
    assert [image.size for image in gate_prompt["multi_modal_data"]["image"]] == SIZES
    assert gate_output.prompt_token_ids.count(image_id) == sum(expected)


def image_runs(token_ids, image_id):
    """Lengths of the runs of consecutive image tokens."""
    runs, current = [], 0
    for token in [*token_ids, None]:
        if token == image_id:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs
