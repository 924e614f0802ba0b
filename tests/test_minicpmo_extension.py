"""The MiniCPM-o 4.5 extension: sampling overrides, append plans, listen/speak decisions."""

from __future__ import annotations

import copy
from io import BytesIO
from types import MappingProxyType, SimpleNamespace

import pytest
from PIL import Image

from schemas.errors import InvalidInputError, UnsupportedModeError
from schemas.events import (
    AudioPayload,
    CommitPayload,
    InputMode,
    TextPayload,
    TokensPayload,
    UnitPayload,
    VideoPayload,
)
from schemas.fence import Fence
from workers.extensions import DecisionAction, StageSamplingParams, load_extension
from workers.extensions.minicpmo import (
    DEFAULT_CONTEXT_RESERVE,
    LISTEN_TOKEN,
    MiniCPMOExtension,
    MiniCPMOTokenIds,
    parse_stage_overrides,
)

FENCE = Fence("sess-9", incarnation=2, epoch=1, turn_id=3, response_seq=1)
IDS = MiniCPMOTokenIds(audio_placeholder_id=20, image_placeholder_id=30, context_token_id=10)
LISTEN = 777


def pcm_seconds(seconds: float) -> bytes:
    return b"\x00" * (4 * int(16_000 * seconds))


def jpeg(width: int, height: int) -> bytes:
    out = BytesIO()
    Image.new("RGB", (width, height)).save(out, "JPEG")
    return out.getvalue()


@pytest.fixture
def ext() -> MiniCPMOExtension:
    return MiniCPMOExtension(IDS, context_reserve=5)


# --- sampling -----------------------------------------------------------------
def three_defaults() -> list[StageSamplingParams]:
    return [
        StageSamplingParams(max_tokens=8),
        StageSamplingParams(max_tokens=64, temperature=0.7),
        StageSamplingParams(max_tokens=256),
    ]


def test_overrides_apply_to_copies_with_int_and_str_stage_keys(ext):
    defaults = three_defaults()
    snapshot = copy.deepcopy(defaults)
    config = {
        "duplex_stage_max_tokens": {0: 4, "2": 512},
        "duplex_stage_sampling_params": {"1": {"temperature": 0.0, "top_k": 20}, 0: {"top_p": 0.9}},
        "unrelated_key": {"ignored": True},
    }
    result = ext.configure_sampling_params(defaults, config)
    assert [p.max_tokens for p in result] == [4, 64, 512]
    assert result[0].top_p == 0.9
    assert (result[1].temperature, result[1].top_k) == (0.0, 20)
    assert defaults == snapshot
    assert all(new is not old for new, old in zip(result, defaults, strict=True))


def test_no_overrides_still_returns_fresh_copies(ext):
    defaults = three_defaults()
    result = ext.configure_sampling_params(defaults, {})
    assert result == defaults
    assert all(new is not old for new, old in zip(result, defaults, strict=True))


def test_overrides_through_the_checked_loader():
    checked = load_extension("minicpmo45")
    result = checked.configure_sampling_params(
        three_defaults(), {"duplex_stage_max_tokens": {"1": 9}}
    )
    assert [p.max_tokens for p in result] == [8, 9, 256]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"duplex_stage_max_tokens": {3: 10}}, "out of range"),
        ({"duplex_stage_max_tokens": {"-1": 10}}, "not a stage id"),
        ({"duplex_stage_max_tokens": {-1: 10}}, "out of range"),
        ({"duplex_stage_sampling_params": {"7": {"top_p": 0.5}}}, "out of range"),
        ({"duplex_stage_sampling_params": {"talker": {"top_p": 0.5}}}, "not a stage id"),
        ({"duplex_stage_max_tokens": {True: 10}}, "not a stage id"),
        (
            {"duplex_stage_sampling_params": {0: {"temprature": 0.5}}},
            "unknown sampling parameter field 'temprature'",
        ),
        ({"duplex_stage_sampling_params": {0: {"top_p": 2.0}}}, "top_p"),
        ({"duplex_stage_sampling_params": {0: 0.5}}, "must map field names"),
        ({"duplex_stage_sampling_params": [0.5]}, "must map stage ids"),
        ({"duplex_stage_max_tokens": {0: 0}}, "positive int"),
        ({"duplex_stage_max_tokens": {0: "12"}}, "positive int"),
        ({"duplex_stage_max_tokens": {0: 10, "0": 12}}, "given twice"),
        (
            {
                "duplex_stage_max_tokens": {0: 10},
                "duplex_stage_sampling_params": {"0": {"max_tokens": 11}},
            },
            "says 10",
        ),
    ],
)
def test_bad_overrides_raise_value_error(ext, config, message):
    defaults = three_defaults()
    snapshot = copy.deepcopy(defaults)
    with pytest.raises(ValueError, match=message):
        ext.configure_sampling_params(defaults, config)
    assert defaults == snapshot


def test_agreeing_max_tokens_from_both_keys_is_fine():
    overrides = parse_stage_overrides(
        {
            "duplex_stage_max_tokens": {1: 32},
            "duplex_stage_sampling_params": {"1": {"max_tokens": 32}},
        },
        stages=2,
    )
    assert overrides == {1: {"max_tokens": 32}}


def test_none_config_values_mean_no_overrides():
    assert parse_stage_overrides({"duplex_stage_max_tokens": None}, stages=1) == {}


# --- append plans -------------------------------------------------------------
def pair_unit(seconds: float = 1.0) -> UnitPayload:
    return UnitPayload(
        audio=AudioPayload(data=pcm_seconds(seconds)),
        video=VideoPayload(frames=(jpeg(960, 540), jpeg(320, 240))),
    )


def test_first_unit_append_has_reserve_then_image_then_audio(ext):
    plan = ext.plan_append(FENCE, InputMode.APPEND_UNIT, pair_unit(), first_append=True)
    assert plan.prompt_token_ids == (10,) * 5 + (30,) * 264 + (20,) * 12
    buffer = plan.buffer
    assert buffer.fence == FENCE
    assert buffer.incarnation == FENCE.incarnation == 2
    assert (buffer.budget, buffer.placeholder_count, buffer.context_reserve) == (281, 276, 5)
    assert buffer.first_append is True
    assert dict(plan.metadata) == {"audio_tokens": 12, "video_tokens": 264, "context_reserve": 5}
    assert isinstance(plan.metadata, MappingProxyType)
    with pytest.raises(TypeError):
        plan.metadata["audio_tokens"] = 0  # type: ignore[index]


def test_later_unit_append_has_no_reserve(ext):
    plan = ext.plan_append(FENCE, InputMode.APPEND_UNIT, pair_unit(0.5), first_append=False)
    assert plan.prompt_token_ids == (30,) * 264 + (20,) * 16
    assert (plan.buffer.budget, plan.buffer.context_reserve, plan.buffer.first_append) == (
        280,
        0,
        False,
    )


def test_default_context_reserve():
    plan = MiniCPMOExtension().plan_append(
        FENCE, InputMode.APPEND_AUDIO_CHUNK, AudioPayload(data=pcm_seconds(1)), first_append=True
    )
    assert plan.buffer.context_reserve == DEFAULT_CONTEXT_RESERVE
    assert plan.buffer.budget == DEFAULT_CONTEXT_RESERVE + 12


def test_audio_chunk_and_video_frame_modes(ext):
    audio = ext.plan_append(
        FENCE, InputMode.APPEND_AUDIO_CHUNK, AudioPayload(data=pcm_seconds(2)), first_append=False
    )
    assert audio.prompt_token_ids == (20,) * 24
    video = ext.plan_append(
        FENCE,
        InputMode.APPEND_VIDEO_FRAME,
        VideoPayload(frames=(jpeg(64, 64),)),
        first_append=False,
    )
    assert video.prompt_token_ids == (30,) * 66
    assert video.metadata["video_tokens"] == 66


def test_client_budget_fields_are_ignored(ext):
    claims = {"num_input_tokens": 5, "duplex_num_input_tokens": 9_999, "max_input_tokens": 1}
    plain = ext.plan_append(FENCE, InputMode.APPEND_UNIT, pair_unit(), first_append=True)
    claimed = ext.plan_append(
        FENCE, InputMode.APPEND_UNIT, pair_unit(), first_append=True, client_meta=claims
    )
    assert claimed.prompt_token_ids == plain.prompt_token_ids
    assert claimed.buffer == plain.buffer
    assert claimed.metadata["ignored_client_fields"] == tuple(sorted(claims))


def test_tokens_pass_through_untouched(ext):
    plan = ext.plan_append(
        FENCE, InputMode.APPEND_TOKENS, TokensPayload(token_ids=(4, 5, 6)), first_append=True
    )
    assert plan.prompt_token_ids == (4, 5, 6)
    assert (plan.buffer.budget, plan.buffer.placeholder_count, plan.buffer.context_reserve) == (
        3,
        0,
        0,
    )


def test_text_needs_a_tokenizer(ext):
    with pytest.raises(UnsupportedModeError, match="not supported") as info:
        ext.plan_append(FENCE, InputMode.APPEND_TEXT, TextPayload(text="hi"), first_append=False)
    assert info.value.code == "unsupported_mode"


def test_text_with_tokenizer_gets_reserve_on_first_append():
    ext = MiniCPMOExtension(IDS, context_reserve=2, tokenizer=lambda text: [ord(c) for c in text])
    first = ext.plan_append(FENCE, InputMode.APPEND_TEXT, TextPayload(text="hi"), first_append=True)
    assert first.prompt_token_ids == (10, 10, 104, 105)
    assert (first.buffer.placeholder_count, first.buffer.context_reserve) == (0, 2)
    later = ext.plan_append(
        FENCE, InputMode.APPEND_TEXT, TextPayload(text="hi"), first_append=False
    )
    assert later.prompt_token_ids == (104, 105)


def test_turn_commit_is_an_empty_prompt_marked_commit(ext):
    plan = ext.plan_append(FENCE, InputMode.TURN_COMMIT_ONLY, CommitPayload(), first_append=True)
    assert plan.prompt_token_ids == ()
    assert plan.buffer.budget == 0
    assert plan.metadata["commit"] is True


def test_mode_payload_mismatch_is_invalid_input(ext):
    with pytest.raises(InvalidInputError, match="carries a UnitPayload"):
        ext.plan_append(FENCE, InputMode.APPEND_UNIT, AudioPayload(data=b""), first_append=False)


def test_plan_requires_a_fence(ext):
    with pytest.raises(TypeError, match="must be a Fence"):
        ext.plan_append("sess-9", InputMode.TURN_COMMIT_ONLY, CommitPayload(), first_append=False)


def test_empty_unit_plans_nothing_but_the_reserve(ext):
    plan = ext.plan_append(FENCE, InputMode.APPEND_UNIT, UnitPayload(), first_append=True)
    assert plan.prompt_token_ids == (10,) * 5


def test_token_ids_from_tokenizer_lookup():
    vocab = {"<unk>": 128_244, LISTEN_TOKEN: 151_705}
    ids = MiniCPMOTokenIds.from_token_lookup(vocab.get)
    assert (ids.audio_placeholder_id, ids.image_placeholder_id, ids.context_token_id) == (
        128_244,
    ) * 3
    assert ids.listen_token_id == 151_705
    assert MiniCPMOExtension(ids).special_token_ids == {LISTEN_TOKEN: 151_705}
    with pytest.raises(ValueError, match="<unk>"):
        MiniCPMOTokenIds.from_token_lookup({}.get)
    assert MiniCPMOTokenIds.from_token_lookup({"<unk>": 0}.get).listen_token_id is None


@pytest.mark.parametrize(
    "kwargs",
    [{"audio_placeholder_id": -1}, {"listen_token_id": True}, {"context_token_id": 1.5}],
)
def test_token_ids_validate(kwargs):
    with pytest.raises(ValueError):
        MiniCPMOTokenIds(**kwargs)


def test_context_reserve_validates():
    with pytest.raises(ValueError):
        MiniCPMOExtension(context_reserve=-1)


# --- decisions ----------------------------------------------------------------
def request_output(step_ids=(), text="", stop_reason=None, finish_reason=None, **outer):
    """A RequestOutput look-alike: ``outputs[0]`` holds this step's tokens."""
    completion = SimpleNamespace(
        token_ids=list(step_ids), text=text, stop_reason=stop_reason, finish_reason=finish_reason
    )
    outer.setdefault("special_token_ids", {LISTEN_TOKEN: LISTEN})
    return SimpleNamespace(outputs=[completion], **outer)


def test_listen_token_in_step_tokens_is_listen(ext):
    decision = ext.decide_output(request_output([11, LISTEN], f"ok{LISTEN_TOKEN}"))
    assert decision.action is DecisionAction.LISTEN
    assert decision.token_ids == (11,)
    assert decision.text == "ok"
    assert decision.metadata["listen_token_id"] == LISTEN


@pytest.mark.parametrize("stop_reason", [LISTEN, LISTEN_TOKEN, "listen"])
def test_listen_stop_reason_is_listen(ext, stop_reason):
    output = request_output([], stop_reason=stop_reason, finish_reason="stop")
    decision = ext.decide_output(output)
    assert decision.action is DecisionAction.LISTEN
    assert decision.metadata["finish_reason"] == "stop"


def test_listen_only_in_history_is_not_listen(ext):
    output = request_output(
        [41, 42],
        "more words",
        token_ids=[1, LISTEN, 41, 42],  # cumulative ids on the outer object
        prompt_token_ids=[LISTEN, LISTEN],
        history_token_ids=[LISTEN],
    )
    decision = ext.decide_output(output)
    assert decision.action is DecisionAction.SPEAK
    assert decision.token_ids == (41, 42)
    assert decision.text == "more words"


def test_other_stop_reasons_are_not_listen(ext):
    assert (
        ext.decide_output(request_output([5], "x", stop_reason=LISTEN + 1)).action
        is DecisionAction.SPEAK
    )
    assert (
        ext.decide_output(request_output([5], "x", stop_reason="</s>")).action
        is DecisionAction.SPEAK
    )
    assert (
        ext.decide_output(request_output([5], "x", stop_reason=True)).action is DecisionAction.SPEAK
    )


@pytest.mark.parametrize("name", [LISTEN_TOKEN, "listen"])
def test_listen_id_comes_from_output_metadata(name):
    ext = MiniCPMOExtension(MiniCPMOTokenIds(listen_token_id=5))
    output = request_output([5, 9], special_token_ids={name: 9})
    decision = ext.decide_output(output)
    # The output's metadata names 9, so the configured fallback 5 is just a token.
    assert decision.action is DecisionAction.LISTEN
    assert decision.token_ids == (5,)


def test_listen_id_from_completion_metadata_and_fallback():
    completion = {"token_ids": [9], "text": "", "special_token_ids": {"listen": 9}}
    ext = MiniCPMOExtension()
    assert ext.decide_output({"outputs": [completion]}).action is DecisionAction.LISTEN
    fallback = MiniCPMOExtension(MiniCPMOTokenIds(listen_token_id=9))
    plain = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[9], text="")])
    assert fallback.decide_output(plain).action is DecisionAction.LISTEN
    # Without metadata or a fallback no token is the listen token.
    assert ext.decide_output(plain).action is DecisionAction.SPEAK


def test_bare_completion_is_accepted(ext):
    completion = SimpleNamespace(
        token_ids=(LISTEN,), text="", special_token_ids={LISTEN_TOKEN: LISTEN}
    )
    assert ext.decide_output(completion).action is DecisionAction.LISTEN


def test_speak_and_continue(ext):
    speak = ext.decide_output(request_output([1, 2], "hello", finish_reason=None))
    assert (speak.action, speak.token_ids, speak.text) == (DecisionAction.SPEAK, (1, 2), "hello")
    empty = ext.decide_output(request_output([], ""))
    assert (empty.action, empty.token_ids, empty.text) == (DecisionAction.CONTINUE, (), "")
    none = ext.decide_output(SimpleNamespace(outputs=[]))
    assert none.action is DecisionAction.CONTINUE


def test_malformed_outputs_raise_type_error(ext):
    with pytest.raises(TypeError):
        ext.decide_output(SimpleNamespace(outputs=5))
    with pytest.raises(TypeError):
        ext.decide_output(SimpleNamespace(outputs=[SimpleNamespace(token_ids="abc")]))


def test_decisions_are_checked_through_the_loader():
    checked = load_extension(MiniCPMOExtension, token_ids=IDS)
    decision = checked.decide_output(request_output([LISTEN]))
    assert decision.action is DecisionAction.LISTEN
    with pytest.raises(TypeError):
        decision.metadata["x"] = 1  # type: ignore[index]


# --- with vLLM installed ------------------------------------------------------
def _vllm_sampling_params():
    try:
        from vllm import SamplingParams
    except Exception:  # not installed, or an install that cannot import here
        return None
    return SamplingParams


@pytest.mark.skipif(_vllm_sampling_params() is None, reason="vllm is not importable")
def test_overrides_on_vllm_sampling_params(ext):
    sampling_params = _vllm_sampling_params()
    defaults = [sampling_params(max_tokens=8), sampling_params(max_tokens=64, stop_token_ids=[3])]
    result = load_extension(ext).configure_sampling_params(
        defaults,
        {
            "duplex_stage_max_tokens": {"0": 2},
            "duplex_stage_sampling_params": {1: {"stop_token_ids": [LISTEN]}},
        },
    )
    assert [type(p) for p in result] == [sampling_params, sampling_params]
    assert result[0].max_tokens == 2
    assert defaults[0].max_tokens == 8
    assert result[1].stop_token_ids == [LISTEN]
    assert LISTEN in result[1].all_stop_token_ids
    assert 3 not in result[1].all_stop_token_ids
    assert defaults[1].stop_token_ids == [3]
    assert LISTEN not in defaults[1].all_stop_token_ids
    with pytest.raises(ValueError, match="unknown sampling parameter field"):
        ext.configure_sampling_params(defaults, {"duplex_stage_sampling_params": {0: {"nope": 1}}})
    with pytest.raises(ValueError, match="top_p"):
        ext.configure_sampling_params(
            defaults, {"duplex_stage_sampling_params": {0: {"top_p": 5.0}}}
        )
