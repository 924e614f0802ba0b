"""Greedy replays: a sampled session, replayed greedily twice, answers the same twice.

The pure part checks how a session's ``greedy`` setting turns into sampling
parameters; the engine part records a session through a real vLLM engine (CPU
build, the tiny model of ``tests.tiny_model``) whose stage samples at
temperature 1 with no seed, then replays it plainly (it differs, and the hint
says ``--greedy``) and greedily (two replays, identical, every request at
temperature 0 in the engine's own ``SamplingParams``).
"""

from __future__ import annotations

import os
import time

import pytest
import pytest_asyncio

from coordinator.controlplane.replay import (
    client_outputs,
    replay_greedily,
    replay_session,
)
from coordinator.controlplane.replay_verdict import compared
from coordinator.launcher.replay_cli import replay_hint
from coordinator.service import Coordinator
from dataplane.request_ids import make_request_id
from schemas.events import OutputKind, SettingsPayload, TextPayload
from schemas.fence import Fence
from tests.pipeline_helpers import fast_settings, read_until, running_worker
from tests.test_vllm_stage import (
    ENGINE_OPTIONS,
    STAGE,
    backend_for,
    chat_pipeline,
    engine_test,
    has_done,
    reference,
)
from tests.tiny_model import build_tiny_model
from workers.backends.minicpmo_stage import Duplex
from workers.backends.vllm_engine import SamplingSpec, request_seed, sampling_spec
from workers.backends.vllm_options import parse_options

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"):
    os.environ.setdefault(_name, "1")

SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": None}
"""The stage's options: sampling, no per-request seed (answers vary run to run)."""


def test_a_greedy_session_samples_at_temperature_zero_whatever_the_options():
    options = parse_options(STAGE, {"model": "/m", **SAMPLED, "seed": 3})
    assert sampling_spec(options, SettingsPayload(), "r1", 8) == SamplingSpec(8, 1.0, 0.9, 3)
    schema = {"type": "object"}
    greedy = sampling_spec(options, SettingsPayload(greedy=True), "r1", 8, schema)
    assert greedy == SamplingSpec(8, 0.0, 1.0, 3, schema)


def test_without_a_stage_seed_each_request_draws_its_own_from_its_id():
    options = parse_options(STAGE, {"model": "/m", **SAMPLED})
    ids = [make_request_id(Fence(s, 0, 0, 1, 1), f"thinker-t0-r{n}") for s in "ab" for n in (1, 2)]
    seeds = {sampling_spec(options, SettingsPayload(), i, 8).seed for i in ids}
    assert len(seeds) == 4 and None not in seeds  # no two sessions or requests share one
    assert request_seed(ids[0]) == request_seed(ids[0]) < 2**31
    fixed = parse_options(STAGE, {"model": "/m", **SAMPLED, "seed": 3})
    assert {sampling_spec(fixed, SettingsPayload(), i, 8).seed for i in ids} == {3}


def test_a_duplex_stage_takes_its_greedy_parameters_for_a_greedy_session():
    duplex = Duplex(None, None, {}, "sampled", 100, greedy_params="greedy")  # type: ignore[arg-type]
    assert duplex.params_for(SettingsPayload(), "r1") == "sampled"
    assert duplex.params_for(SettingsPayload(greedy=True), "r1") == "greedy"
    sampled_only = Duplex(None, None, {}, "sampled", 100)  # type: ignore[arg-type]
    assert sampled_only.params_for(SettingsPayload(greedy=True), "r1") == "sampled"


# -- through the engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import vllm  # noqa: F401 - scripts/setup installs it; a missing vLLM fails these tests

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir):
    from workers.backends.vllm_engine import VllmEngine

    engine = VllmEngine(parse_options(STAGE, {"model": model_dir, **ENGINE_OPTIONS}))
    started = time.monotonic()
    await engine.ready()
    print(f"\nvLLM engine started in {time.monotonic() - started:.1f} s")
    yield engine
    await engine.shutdown()


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix)


def _texts(outputs):
    return ["".join(o.text for o in outputs[: i + 1] if o.kind is OutputKind.TEXT_DELTA)
            for i, o in enumerate(outputs) if o.kind is OutputKind.DONE]  # fmt: skip


@engine_test
async def test_a_sampled_session_replayed_greedily_twice_gives_identical_outputs(
    engine, settings, monkeypatch
):
    temperatures: list[float] = []
    seeds: list[int | None] = []
    sampling = engine._sampling

    def spy(spec):
        params = sampling(spec)  # what the engine gets: vLLM's own SamplingParams
        temperatures.append(params.temperature)
        seeds.append(params.seed)
        return params

    monkeypatch.setattr(engine, "_sampling", spy)
    backend = backend_for(engine, max_tokens=12, **SAMPLED)
    pipeline = chat_pipeline()
    coordinator = Coordinator(settings, pipeline)
    bus = coordinator.bus
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("src")
            for text in ("hello there", "and then?"):
                await coordinator.append("src", "append_text", TextPayload(text))
                await coordinator.commit("src")
                await read_until(coordinator, has_done)
            assert temperatures == [1.0, 1.0]

            # A plain replay samples again: it differs, and says what to do.
            plain = await replay_session(bus, pipeline, "src", "plain", quiet_s=2.0)
            assert temperatures == [1.0] * 4
            # Each session's responses draw their own seeds: the replay's are not the
            # recording's (a seedless engine would hand both the same sample).
            assert None not in seeds and len(set(seeds)) == 4
            assert not plain.identical, plain.summary()
            hint = replay_hint(plain, pipeline)
            assert hint is not None and "replay with --greedy" in hint

            # Greedy: two replays, every request at temperature 0, the same answers.
            temperatures.clear()
            report = await replay_greedily(bus, pipeline, "src", "greedy", quiet_s=2.0)
            assert temperatures == [0.0] * 4
            assert report.greedy and report.again is not None, report.summary()
            assert report.identical and report.again.matches, report.summary()
            assert "greedy replays identical" in report.summary()
            # As read: how an answer is cut into deltas depends on the machine's load.
            first = compared(await client_outputs(bus, "greedy"))
            second = compared(await client_outputs(bus, "greedy.again"))
            assert len(first) == len(second) == report.again.comparison.matched >= 4
            assert _texts(first) == _texts(second) and all(_texts(first))
            assert [o.token_ids for o in first] == [o.token_ids for o in second]

            # Greedy is the engine's argmax: the answer is the reference for its prompt.
            done = next(o for o in first if o.kind is OutputKind.DONE)
            prompt = backend.records[done.meta["request_id"]].prompt
            ids = tuple(i for o in first[: first.index(done)] for i in o.token_ids)
            assert ids == await reference(engine, prompt, len(ids))

            # The greedy target, replayed greedily, is compared with itself directly.
            temperatures.clear()
            direct = await replay_greedily(bus, pipeline, "greedy", "greedy2", quiet_s=2.0)
            assert direct.source_greedy and direct.again is None
            assert direct.identical, direct.summary()
            assert temperatures == [0.0] * 2
    finally:
        await coordinator.aclose()
