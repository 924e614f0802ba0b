"""The ``minicpmo`` stage: its pure core, then the duplex wiring through a real engine.

Real MiniCPM-o weights cannot be loaded here. The engine tests run vLLM (CPU
build) on the tiny model of ``tests.tiny_model`` whose tokenizer also carries
``<|listen|>``, ``<|speak|>`` and the ``<unk>`` placeholder, so the stage
resolves its token ids from a real tokenizer and every decision comes out of
the engine. The tiny model never picks a special token on its own (their
output rows are zeroed), so left alone it speaks; a listen is forced with the
stage's duplex sampling options (``allowed_token_ids`` = the listen token).
One engine serves the module; each test builds its own backend(s) and workers
on it and talks to them through a real coordinator and a real redis-server.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.realtime import ServerEventTranslator
from coordinator.service import Coordinator
from dataplane.request_ids import parse_request_id
from schemas.config import PipelineConfig, StageConfig, load_pipeline
from schemas.events import (
    AudioPayload,
    CommitPayload,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    TextPayload,
    TokensPayload,
    UnitPayload,
)
from schemas.fence import Fence
from tests.engine_helpers import (
    TINY_ENGINE_OPTIONS,
    engine_fixture,
    engine_test_marks,
    eventually,
    held_after,
)
from tests.pipeline_helpers import delta_tokens, fast_settings, read_until, running_worker
from tests.pipeline_helpers import outputs_of as outputs
from tests.tiny_model import build_tiny_model
from workers.backends.minicpmo_options import parse_minicpmo_options
from workers.backends.minicpmo_session import (
    Contribution,
    DuplexPrompt,
    Emission,
    PromptTooLong,
    UnitTurn,
    classify,
    rebuild,
)
from workers.backends.registry import create_backend
from workers.extensions.base import Decision, DecisionAction
from workers.extensions.minicpmo import MiniCPMOExtension, MiniCPMOTokenIds

STAGE = "thinker"
EXTRA_TOKENS = ("<|listen|>", "<|speak|>", "<unk>")
RESERVE = 16
ENGINE_OPTIONS = {
    **TINY_ENGINE_OPTIONS,
    "context_reserve": RESERVE,
}
ONE_SECOND = b"\0" * (16_000 * 4)
"""1 s of pcm_f32le at 16 kHz: a whole second costs 12 tokens."""
HALF_SECOND = b"\0" * (8_000 * 4)
"""0.5 s: max(16, min(768, 8000 // 1600 + 8)) = 16 tokens."""
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "minicpmo45.toml"

# -- the pure core (no engine) ---------------------------------------------------------


def _in(seq: int, mode: InputMode, payload, epoch: int = 0) -> InputEvent:
    return InputEvent(Fence("s1", 0, epoch), seq, seq, mode, payload)


def _unit(seq: int, data: bytes = ONE_SECOND) -> InputEvent:
    return _in(seq, InputMode.APPEND_UNIT, UnitPayload(audio=AudioPayload(data)))


def _out(seq: int, source_seq: int, kind: OutputKind, ids: tuple[int, ...], text: str = ""):
    return OutputEvent(Fence("s1", 0), STAGE, kind, seq, source_seq, text, token_ids=ids)


def test_options_extend_the_vllm_ones_and_check_the_duplex_config():
    options = parse_minicpmo_options(STAGE, {"model": "/m", "max_model_len": 512})
    assert options.max_tokens == 8 and options.unit_max_tokens == 8
    assert options.prompt_budget == 512 - 8
    assert options.runtime_config() == {
        "duplex_stage_max_tokens": {},
        "duplex_stage_sampling_params": {},
    }
    tuned = parse_minicpmo_options(
        STAGE,
        {
            "model": "/m",
            "trust_remote_code": True,
            "limit_mm_per_prompt": {"audio": 64},
            "history_max_tokens": 900,
            "duplex_stage_max_tokens": {"0": 40},
            "duplex_stage_sampling_params": {0: {"temperature": 0.5}},
        },
    )
    assert tuned.unit_max_tokens == 40 and tuned.prompt_budget == 900
    kwargs = tuned.engine_kwargs()
    assert kwargs["trust_remote_code"] is True and kwargs["limit_mm_per_prompt"] == {"audio": 64}
    bad = {
        "system_prompt": "hi",
        "duplex_stage_max_tokens": {"1": 4},
        "duplex_stage_sampling_params": {"0": {"output_kind": 1}},
        "temprature": 0.5,
    }
    messages = {
        "system_prompt": "not used by the minicpmo stage",
        "duplex_stage_max_tokens": "out of range",
        "duplex_stage_sampling_params": "set by the stage",
        "temprature": "Extra inputs",
    }
    for key, value in bad.items():
        with pytest.raises(ValueError, match=messages[key]):
            parse_minicpmo_options(STAGE, {"model": "/m", key: value})
    with pytest.raises(ValueError, match=r"unit's max_tokens \(64\) must be below"):
        parse_minicpmo_options(
            STAGE, {"model": "/m", "max_model_len": 64, "duplex_stage_max_tokens": {"0": 64}}
        )


def test_classify_events():
    kinds = [
        classify(_unit(1)),
        classify(_in(2, InputMode.APPEND_AUDIO_CHUNK, AudioPayload(ONE_SECOND))),
        classify(_in(3, InputMode.APPEND_TOKENS, TokensPayload((5,)))),
        classify(_in(4, InputMode.APPEND_TEXT, TextPayload("hi"))),
        classify(_in(5, InputMode.TURN_COMMIT_ONLY, CommitPayload())),
        classify(_out(1, 1, OutputKind.TEXT_DELTA, (1,))),
    ]
    assert kinds == [
        Contribution.UNIT,
        Contribution.UNIT,
        Contribution.CONTEXT,
        Contribution.CONTEXT,
        Contribution.COMMIT,
        Contribution.NOTHING,
    ]


def test_prompt_keeps_the_reserve_and_drops_oldest_segments_whole():
    ext = MiniCPMOExtension(context_reserve=4)
    prompt = DuplexPrompt()
    assert prompt.first_append
    first = ext.plan_append(Fence("s1"), InputMode.APPEND_UNIT, _unit(1).payload, first_append=True)
    prompt.add_plan(first)
    assert prompt.prefix == (1,) * 4 and not prompt.first_append
    prompt.answer((50, 51))  # what the model said after the first unit
    prompt.add(())
    prompt.add((2,) * 12)
    assert len(prompt) == 4 + 12 + 2 + 12 and len(prompt.segments) == 2
    assert prompt.fit(30) == 0
    assert prompt.fit(20) == 1  # the first unit, with the model's answer to it
    assert prompt.tokens() == [1] * 4 + [2] * 12
    prompt.add((3,) * 17)
    with pytest.raises(PromptTooLong):
        prompt.fit(20)
    assert prompt.tokens() == [1] * 4 + [2] * 12  # the oversized segment is gone


def test_unit_turn_turns_decisions_into_drafts_carrying_every_token():
    speak, listen = DecisionAction.SPEAK, DecisionAction.LISTEN
    turn = UnitTurn("r1", seq=3)
    assert turn.read(Decision(DecisionAction.CONTINUE)) == []
    assert turn.read(Decision(speak, (90,))) == [Emission(OutputKind.SPEAK)]  # "<|speak|>"
    assert turn.read(Decision(speak, (7,), "hel")) == [
        Emission(OutputKind.TEXT_DELTA, "hel", (90, 7))
    ]
    assert turn.read(Decision(listen, (8,), "lo", {"listen_token_id": 99})) == [
        Emission(OutputKind.TEXT_DELTA, "lo", (8,)),
        Emission(OutputKind.LISTEN, "", (99,)),
    ]
    assert turn.ended and turn.decision == "listen"
    assert turn.read(Decision(speak, (9,), "x")) == []  # nothing after the listen
    assert turn.produced == [90, 7, 8, 99]

    quiet = UnitTurn("r2", seq=4)
    assert quiet.read(Decision(listen, metadata={"listen_token_id": 99})) == [
        Emission(OutputKind.LISTEN, "", (99,))
    ]
    cut = UnitTurn("r3", seq=5)
    cut.read(Decision(speak, (7,), "a"))
    cut.read(Decision(speak, (91,)))  # a text-less step at the very end
    assert cut.decision == "speak"
    assert cut.finish() == [Emission(OutputKind.TEXT_DELTA, "", (91,))]
    assert cut.produced == [7, 91] and cut.finish() == []


def test_rebuild_replays_plans_and_the_published_tokens():
    ext = MiniCPMOExtension(MiniCPMOTokenIds(listen_token_id=99), context_reserve=3)

    def plan(event, first):
        if event.seq == 4:
            return None  # failed when live too
        return ext.plan_append(event.fence, event.mode, event.payload, first_append=first)

    inputs = [
        _in(1, InputMode.APPEND_TOKENS, TokensPayload((40, 41))),
        _unit(2),
        _in(3, InputMode.TURN_COMMIT_ONLY, CommitPayload()),
        _unit(4),
        _in(5, InputMode.APPEND_AUDIO_CHUNK, AudioPayload(HALF_SECOND), epoch=1),
    ]
    outputs = [
        _out(1, 2, OutputKind.SPEAK, ()),
        _out(2, 2, OutputKind.TEXT_DELTA, (70, 71), "hi"),
        _out(3, 3, OutputKind.DONE, ()),
        _out(4, 5, OutputKind.LISTEN, (99,)),
    ]
    # Answers to inputs the previous owner had not finished applying.
    outputs += [_out(5, 6, OutputKind.SPEAK, ()), _out(6, 6, OutputKind.TEXT_DELTA, (72,), "x")]
    outputs += [_out(7, 7, OutputKind.DONE, ())]
    prompt = DuplexPrompt()
    carried = rebuild(prompt, inputs, list(reversed(outputs)), plan)
    # Literal tokens carry no reserve, so the first unit is the first framed append.
    assert prompt.tokens() == [1, 1, 1] + [40, 41] + [2] * 12 + [70, 71] + [2] * 16 + [99]
    assert carried == {6: (72,), 7: ()}


def test_registry_builds_the_stage_and_the_gpu_config_validates():
    pipeline = load_pipeline(CONFIG)
    (stage,) = [s for s in pipeline.stages if s.backend == "minicpmo"]
    backend = create_backend(stage)  # builds no engine until a session needs it
    assert backend.name == "minicpmo" and backend.follows_responses
    assert not backend.continuous_input
    options = backend.options
    assert options.dtype == "bfloat16" and options.trust_remote_code
    assert options.engine_kwargs()["model"] == options.model
    assert options.unit_max_tokens < options.max_model_len


# -- through the engine ------------------------------------------------------------------

engine_test = engine_test_marks()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")
    path = tmp_path_factory.mktemp("tiny-duplex-model")
    return str(build_tiny_model(path, extra_special_tokens=EXTRA_TOKENS))


def start_engine(model_dir: str):
    from workers.backends.minicpmo_stage import MiniCPMOEngine

    return MiniCPMOEngine(parse_minicpmo_options(STAGE, {"model": model_dir, **ENGINE_OPTIONS}))


engine = engine_fixture(start_engine)


@pytest.fixture
def token(engine):
    """The tiny tokenizer's id of a token."""
    return engine.tokenizer.convert_tokens_to_ids


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix)


def backend_for(engine, **options):
    from workers.backends.minicpmo_stage import MiniCPMOStage

    merged = {"model": engine.options.model, **ENGINE_OPTIONS, **options}
    return MiniCPMOStage(merged, stage=STAGE, engine=engine)


def duplex_pipeline() -> PipelineConfig:
    stage = StageConfig(name=STAGE, backend="minicpmo", to_client=True, options={"model": "x"})
    return PipelineConfig(name="duplex", stages=(stage,))


def count(kind, n=1):
    return lambda deliveries: len(outputs(deliveries, kind)) >= n


def client_events(deliveries):
    translator = ServerEventTranslator([STAGE])
    events = []
    for delivery in deliveries:
        events += translator.translate(delivery.event, delivery.server_event_seq)
    return [event["type"] for event in events]


@engine_test
async def test_a_a_unit_becomes_placeholders_and_the_model_speaks(engine, settings, token):
    unk = token("<unk>")
    backend = backend_for(engine, max_tokens=4)
    pipeline = duplex_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("s1")
            await coordinator.append("s1", InputMode.APPEND_UNIT, _unit(1).payload)
            got = await read_until(coordinator, count(OutputKind.TEXT_DELTA, 4))

            # What the engine got: the context reserve and 12 audio placeholders.
            first = backend.last_prompts["s1"]
            assert first == (unk,) * (RESERVE + 12)
            # The tiny model speaks: a speak marker, then one delta per token.
            unit1 = outputs(got)
            assert [o.kind for o in unit1] == [OutputKind.SPEAK] + [OutputKind.TEXT_DELTA] * 4
            request_id = unit1[0].meta["request_id"]
            assert {o.meta["request_id"] for o in unit1} == {request_id}
            assert parse_request_id(request_id)[:3] == ("s1", 0, 0)
            assert all(o.source_seq == 1 for o in unit1)
            spoken = tuple(i for o in unit1 for i in o.token_ids)
            assert len(spoken) == 4 and engine.decode(spoken) == "".join(o.text for o in unit1)
            await eventually(lambda: backend.records[request_id].outcome != "running")
            record = backend.records[request_id]
            assert (record.outcome, record.decision, record.tokens) == (
                "finished:length",
                "speak",
                4,
            )

            # The next unit is decided after what the model said: no reserve again.
            await coordinator.append("s1", InputMode.APPEND_AUDIO_CHUNK, AudioPayload(HALF_SECOND))
            got += await read_until(coordinator, count(OutputKind.TEXT_DELTA, 4))
            assert backend.last_prompts["s1"] == first + spoken + (unk,) * 16
            await coordinator.commit("s1")
            got += await read_until(coordinator, count(OutputKind.DONE))
            assert outputs(got)[-1].meta == {"finish_reason": "turn_commit"}

            # The client sees speech as a response: speak, then text deltas.
            assert client_events(got) == (
                ["response.created", "duplexq.response.speak"]
                + ["response.output_item.added", "conversation.item.added"]
                + ["response.content_part.added"]
                + ["response.output_text.delta"] * 4
                + ["duplexq.response.speak"]
                + ["response.output_text.delta"] * 4
                + ["response.output_text.done", "response.content_part.done"]
                + ["response.output_item.done", "conversation.item.done", "response.done"]
            )
            assert not engine.live_request_ids()
    finally:
        await coordinator.aclose()


@engine_test
async def test_b_a_forced_listen_reaches_the_client_as_response_listen(engine, settings, token):
    listen = token("<|listen|>")
    backend = backend_for(
        engine, duplex_stage_sampling_params={"0": {"allowed_token_ids": [listen]}}
    )
    pipeline = duplex_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("s1")
            chunk = InputMode.APPEND_AUDIO_CHUNK
            await coordinator.append("s1", chunk, AudioPayload(ONE_SECOND))
            got = await read_until(coordinator, count(OutputKind.LISTEN))
            await coordinator.append("s1", InputMode.APPEND_UNIT, _unit(2).payload)
            got += await read_until(coordinator, count(OutputKind.LISTEN))

            # Each unit: the model's one token is the listen token, a stop token.
            assert [o.kind for o in outputs(got)] == [OutputKind.LISTEN] * 2
            assert all(o.token_ids == (listen,) and not o.text for o in outputs(got))
            ids = [o.meta["request_id"] for o in outputs(got)]
            await eventually(lambda: all(backend.records[r].outcome != "running" for r in ids))
            assert {(backend.records[r].outcome, backend.records[r].decision) for r in ids} == {
                ("listen", "listen")
            }
            # The listen token stays in the context the next unit is decided in.
            unk = token("<unk>")
            expected = (unk,) * (RESERVE + 12) + (listen,) + (unk,) * 12
            assert backend.last_prompts["s1"] == expected
            assert client_events(got) == [
                "response.created",
                "duplexq.response.listen",
                "duplexq.response.listen",
            ]
            assert not engine.live_request_ids()
    finally:
        await coordinator.aclose()


@engine_test
async def test_c_barge_in_aborts_the_running_request(engine, settings, token):
    max_tokens = 300  # a few seconds of generation on CPU, uninterrupted
    backend = backend_for(engine, duplex_stage_max_tokens={"0": max_tokens})
    pipeline = duplex_pipeline()
    coordinator = Coordinator(settings, pipeline)
    try:
        async with running_worker(settings, pipeline, STAGE, backend=backend):
            await coordinator.open("s1")
            # The engine stops where it stands after a few tokens, so the request is
            # certainly still running when the cancel reaches the worker.
            async with held_after(engine, tokens=5) as hold:
                await coordinator.append("s1", InputMode.APPEND_UNIT, _unit(1).payload)
                await hold.wait()
                before = await read_until(coordinator, lambda d: delta_tokens(d) >= 3)
                request_id = outputs(before)[0].meta["request_id"]
                assert request_id in engine.live_request_ids()  # mid-generation
                first_prompt = backend.last_prompts["s1"]

                result = await coordinator.cancel("s1", reason="barge_in")
                assert result.cancelled.epoch == 0 and result.fence.epoch == 1
                await eventually(lambda: request_id not in engine.live_request_ids())
            record = backend.records[request_id]
            await eventually(lambda: record.outcome != "running")
            assert record.outcome == "released" and 3 <= record.tokens < max_tokens
            assert list(backend.released) == [result.cancelled]
            assert engine.unfinished() == 0

            # A new unit after the barge-in: decided at epoch 1, in a context that
            # holds the interrupted speech cut where it was stopped.
            await coordinator.append("s1", InputMode.APPEND_UNIT, _unit(3).payload)
            after = await read_until(coordinator, count(OutputKind.SPEAK))
            assert all(o.fence.epoch == 1 for o in outputs(after))
            assert not [o for o in outputs(after) if o.meta.get("request_id") == request_id]
            prompt = backend.last_prompts["s1"]
            cut = prompt[len(first_prompt) : -12]
            assert prompt[: len(first_prompt)] == first_prompt
            assert len(cut) == record.tokens and prompt[-12:] == (token("<unk>"),) * 12
            await coordinator.cancel("s1", reason="done")
            await eventually(lambda: not engine.live_request_ids())
    finally:
        await coordinator.aclose()


@engine_test
async def test_d_a_new_owner_rebuilds_the_prompt_from_the_log(engine, settings, token):
    pipeline = duplex_pipeline()
    coordinator = Coordinator(settings, pipeline)
    first = backend_for(engine, max_tokens=3)
    second = backend_for(engine, max_tokens=3)
    try:
        async with running_worker(settings, pipeline, STAGE, worker_id="w1", backend=first):
            await coordinator.open("s1")
            await coordinator.append("s1", InputMode.APPEND_TOKENS, TokensPayload((5, 6)))
            await coordinator.append("s1", InputMode.APPEND_UNIT, _unit(2).payload)
            got = await read_until(coordinator, count(OutputKind.TEXT_DELTA, 3))
            # The done is published with w1's progress: the log is applied up to it.
            await coordinator.commit("s1")
            await read_until(coordinator, count(OutputKind.DONE))
        # w1 handed the session back on stop; w2 takes it and rebuilds.
        async with running_worker(settings, pipeline, STAGE, worker_id="w2", backend=second):
            await coordinator.append("s1", InputMode.APPEND_UNIT, _unit(4).payload)
            await eventually(lambda: "s1" in second.last_prompts, timeout=30)
        unk = token("<unk>")
        live = first.last_prompts["s1"]
        # Literal tokens take no reserve; the unit's reserve goes to the front.
        assert live == (unk,) * RESERVE + (5, 6) + (unk,) * 12
        # The new owner's prompt: the log's inputs through the plans, and the
        # tokens the first owner published for the unit it answered.
        produced = tuple(i for o in outputs(got) for i in o.token_ids)
        assert len(produced) == 3
        assert second.last_prompts["s1"] == live + produced + (unk,) * 12
    finally:
        await coordinator.aclose()


def test_each_request_samples_with_its_own_seed_unless_the_stage_fixes_one():
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")
    from workers.backends.minicpmo_stage import seeded

    params = vllm.SamplingParams(temperature=0.7, top_p=0.8)
    first, second = (
        seeded(params, "s1:0:0:0:0:duplex-u1-r0"),
        seeded(params, "s2:0:0:0:0:duplex-u1-r0"),
    )
    assert first.seed != second.seed and None not in (first.seed, second.seed)
    assert seeded(params, "s1:0:0:0:0:duplex-u1-r0").seed == first.seed  # drawn from the id
    assert params.seed is None and first.temperature == 0.7  # a copy, nothing else changed
    fixed = vllm.SamplingParams(temperature=0.7, seed=5)
    assert seeded(fixed, "s1:0:0:0:0:duplex-u1-r0") is fixed
