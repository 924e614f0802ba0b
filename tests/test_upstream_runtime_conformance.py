"""Conformance with the upstream duplex runtime tests (vLLM-Omni, ``test_duplex_runtime.py``).

Every behaviour the upstream test file checks is checked here once, with the
same inputs and the same expected values, through duplexq's own API. Where
the upstream form differs from duplexq's (caller-chosen request ids, the
upstream completion shapes, the ``stage_results`` reply, extension checks at
load), the upstream form is what these tests feed in.

Name mapping (upstream -> duplexq):

==========================================  ==============================================
upstream                                    duplexq
==========================================  ==============================================
``DuplexFence``                             ``schemas.fence.Fence`` (msgspec frozen struct:
                                            assigning raises ``AttributeError``, the base
                                            of ``FrozenInstanceError``)
``DuplexSessionRuntimeManager``             ``tests.session_model.SessionManager``
``manager.open_session(f, capabilities=)``  ``manager.open(f, capabilities=modes)``
``manager.close_session(f)``                ``manager.close(f)``
``manager.get(sid)``                        ``manager.get(sid)``
``session.bind_stage_request(s, rid, f)``   ``manager.bind_request(f, s, rid)``
``session.reserve_stage_request(s, rid,     ``manager.reserve_request(f, role,
f)``                                        request_id=rid)``
``session.append_input(mode=, fence=)``     ``manager.append(f, mode)`` -> ``AppendResult``
``session.release_fence(f)``                ``manager.release_fence(f)``
``session.accept_fence(f)``                 ``manager.accept_fence(f)``
``session.cancel_fence(c, n)``              ``manager.cancel_fence(c, n)``
``session.stage_bindings``                  ``session.bindings[(incarnation, epoch)]``
``session.stage_request_ids()`` /           ``manager.bound_requests(f)``
``session.resource_request_ids()``
``session.input_seq``                       ``session.seq``
``RuntimeError("fence mismatch")``          ``FenceMismatchError`` ("fence mismatch ...")
``DuplexInputMode.X``                       ``schemas.events.InputMode.X``
``DuplexRuntimeCapabilities(input_modes)``  the ``capabilities`` set of modes
``validate_duplex_runtime_extension(e,      ``load_extension(e, sampling_defaults=d)``
sampling_defaults=d)``
``MiniCPMO45DuplexRuntimeExtension``        ``workers.extensions.minicpmo.MiniCPMOExtension``
``DuplexOutputDecision`` /                  ``Decision`` / ``DecisionAction``; upstream's
``DuplexOutputAction.DIRECT_RESPONSE``      listen decision is ``LISTEN``, its ``None``
                                            (no decision) any other action
``decide_output(..., segment_token_ids,     ``decide_output(output, segment_token_ids=,
segment_output_metadata, output)``          segment_metadata=)``
``build_duplex_data_plane_prompt(...)``     ``plan_append(fence, mode, payload,
                                            first_append=, client_meta=)`` -> ``AppendPlan``
``prompt["model_intermediate_buffer"]       ``plan.buffer`` (``RequestBuffer``: ``fence``,
["duplex"]``                                ``incarnation``, ``budget``)
``duplex_scheduler_token_budget(json)``     ``unit_budget(UnitPayload).total`` (the JSON
                                            unit decoded into the wire payload)
``_duplex_hd_slice_count(size, n)``         ``workers.extensions.budget.hd_patch_count``
``duplex_resource_request_id``              ``dataplane.request_ids.make_request_id``
``duplex_resource_request_belongs_to_       ``dataplane.request_ids.belongs_to_session``
session``
``duplex_data_plane_request_info``          ``dataplane.request_ids.data_plane_request_info``
==========================================  ==============================================
"""

from __future__ import annotations

import base64
from io import BytesIO
from types import SimpleNamespace

import pytest
from PIL import Image
from vllm import SamplingParams

from dataplane.request_ids import belongs_to_session, data_plane_request_info, make_request_id
from schemas.errors import FenceMismatchError, UnsupportedModeError
from schemas.events import AudioPayload, InputMode, UnitPayload, VideoPayload
from schemas.fence import Fence
from tests.session_model import SessionManager
from workers.extensions import Decision, DecisionAction, load_extension
from workers.extensions.budget import decode_base64_audio, hd_patch_count, unit_budget
from workers.extensions.minicpmo import MiniCPMOExtension

LISTEN_ID = 151705


def test_duplex_fence_is_immutable():
    fence = Fence("session")
    with pytest.raises(AttributeError):
        fence.epoch = 1  # type: ignore[misc]
    assert not hasattr(fence, "__dict__")


def test_duplex_runtime_tracks_stage_bindings_and_barge_in_epoch():
    manager = SessionManager()
    fence = Fence("sid-1")
    session = manager.open(fence, capabilities={InputMode.APPEND_TOKENS})
    manager.bind_request(session.fence, 0, "req-stage0")
    manager.bind_request(session.fence, 1, "req-stage1")

    update = manager.append(session.fence, InputMode.APPEND_TOKENS)
    next_fence = Fence("sid-1", epoch=1)
    stale_request_ids = manager.release_fence(session.fence)
    manager.accept_fence(next_fence)

    assert update.seq == 1
    assert session.fence == next_fence
    assert stale_request_ids == ["req-stage0", "req-stage1"]
    assert session.bindings == {}


def test_duplex_runtime_tracks_same_request_id_for_each_pipeline_stage():
    manager = SessionManager()
    fence = Fence("sid-shared-pipeline-request")
    session = manager.open(fence)

    manager.reserve_request(fence, "stage0", request_id="req-shared")
    manager.bind_request(fence, 0, "req-shared")
    manager.bind_request(fence, 1, "req-shared")

    bindings = session.bindings[(fence.incarnation, fence.epoch)]
    assert bindings[0] == "req-shared"
    assert bindings[1] == "req-shared"
    assert manager.bound_requests(fence) == ["req-shared"]
    assert session.seq == 0


def test_duplex_runtime_extension_validation_rejects_missing_methods():
    class IncompleteExtension:
        def configure_sampling_params(self, *, runtime_config, defaults):
            del runtime_config
            return defaults

    with pytest.raises(TypeError, match="plan_append"):
        load_extension(IncompleteExtension())


def test_duplex_runtime_extension_validation_rejects_stage_count_mismatch():
    class WrongStageCountExtension(MiniCPMOExtension):
        def configure_sampling_params(self, *, runtime_config, defaults):  # type: ignore[override]
            del runtime_config
            return defaults[:1]

    with pytest.raises(ValueError, match="one sampling parameter per stage"):
        load_extension(
            WrongStageCountExtension(), sampling_defaults=(SamplingParams(), SamplingParams())
        )


def test_duplex_runtime_extension_validation_rejects_sampling_type_mismatch():
    class WrongSamplingTypeExtension(MiniCPMOExtension):
        def configure_sampling_params(self, *, runtime_config, defaults):  # type: ignore[override]
            del runtime_config
            return tuple(object() for _ in defaults)

    with pytest.raises(TypeError, match="sampling parameter type"):
        load_extension(
            WrongSamplingTypeExtension(), sampling_defaults=(SamplingParams(), SamplingParams())
        )


def test_duplex_output_decision_metadata_is_immutable():
    decision = Decision(action=DecisionAction.LISTEN, metadata={"model_listen": True})
    with pytest.raises(TypeError):
        decision.metadata["model_listen"] = False  # type: ignore[index]


def _decide(
    output: object,
    *,
    segment_token_ids: tuple[int, ...] = (),
    segment_output_metadata: dict | None = None,
) -> Decision:
    return load_extension(MiniCPMOExtension()).decide_output(
        output,
        segment_token_ids=segment_token_ids,
        segment_metadata=segment_output_metadata or {},
    )


def test_minicpmo_extension_owns_stage_sampling_overrides():
    defaults = (SamplingParams(max_tokens=4), SamplingParams(max_tokens=8))

    configured = MiniCPMOExtension().configure_sampling_params(
        runtime_config={
            "duplex_stage_max_tokens": {"0": 20},
            "duplex_stage_sampling_params": {"1": {"stop_token_ids": [151645]}},
        },
        defaults=defaults,
    )

    assert configured[0].max_tokens == 20
    assert configured[1].stop_token_ids == [151645]
    assert defaults[0].max_tokens == 4
    assert 151645 not in (defaults[1].stop_token_ids or [])


def test_minicpmo_output_decision_uses_raw_streaming_token_snapshot():
    decision = _decide(
        SimpleNamespace(outputs=[SimpleNamespace()]),
        segment_token_ids=(LISTEN_ID,),
        segment_output_metadata={"special_token_ids": {"listen_token_id": LISTEN_ID}},
    )

    assert decision.action is DecisionAction.LISTEN
    assert decision.metadata["duplex_native_decision"] == "listen"
    assert decision.metadata["model_listen"] is True


@pytest.mark.parametrize("attr", ["token_ids", "cumulative_token_ids"])
def test_minicpmo_output_decision_ignores_output_level_token_history(attr):
    output = SimpleNamespace(
        multimodal_output={"special_token_ids": {"listen_token_id": LISTEN_ID}},
        outputs=[SimpleNamespace()],
        **{attr: [42, LISTEN_ID]},
    )

    assert _decide(output).action is not DecisionAction.LISTEN


@pytest.mark.parametrize("attr", ["token_ids", "cumulative_token_ids"])
def test_minicpmo_output_decision_uses_completion_token_ids(attr):
    output = SimpleNamespace(
        multimodal_output={"special_token_ids": {"listen_token_id": LISTEN_ID}},
        outputs=[SimpleNamespace(**{attr: [42, LISTEN_ID]})],
    )

    assert _decide(output).action is DecisionAction.LISTEN


def test_minicpmo_output_decision_uses_completion_stop_reason():
    output = SimpleNamespace(
        multimodal_output={"special_token_ids": {"listen_token_id": LISTEN_ID}},
        outputs=[SimpleNamespace(stop_reason=LISTEN_ID)],
    )

    assert _decide(output).action is DecisionAction.LISTEN


def test_duplex_runtime_cancel_fence_rejects_late_append_and_accepts_next_epoch():
    manager = SessionManager()
    cancelled_fence = Fence("sid-cancel-race")
    next_fence = Fence("sid-cancel-race", epoch=1)
    session = manager.open(cancelled_fence, capabilities={InputMode.APPEND_AUDIO_CHUNK})
    manager.bind_request(cancelled_fence, 0, "req-cancelled")

    stale_request_ids = manager.cancel_fence(cancelled_fence, next_fence)

    assert stale_request_ids == ["req-cancelled"]
    assert session.fence == next_fence
    assert session.bindings == {}
    with pytest.raises(FenceMismatchError, match="fence mismatch"):
        manager.append(cancelled_fence, InputMode.APPEND_AUDIO_CHUNK)
    assert manager.append(next_fence, InputMode.APPEND_AUDIO_CHUNK).seq == 1


def test_duplex_runtime_stale_close_preserves_live_session_and_bindings():
    manager = SessionManager()
    current_fence = Fence("sid-stale-close", epoch=1)
    session = manager.open(current_fence, capabilities={InputMode.APPEND_AUDIO_CHUNK})
    manager.bind_request(current_fence, 0, "req-live")

    with pytest.raises(FenceMismatchError, match="fence mismatch"):
        manager.close(Fence("sid-stale-close"))

    assert manager.get("sid-stale-close") is session
    assert manager.bound_requests(current_fence) == ["req-live"]


def test_duplex_runtime_reopen_rejects_late_append_from_old_incarnation():
    manager = SessionManager()
    old_fence = Fence("sid-reopen", incarnation=0)
    old_session = manager.open(old_fence, capabilities={InputMode.APPEND_AUDIO_CHUNK})
    manager.close(old_fence)

    new_fence = Fence("sid-reopen", incarnation=1)
    manager.open(new_fence, capabilities=old_session.capabilities)

    with pytest.raises(FenceMismatchError, match="fence mismatch"):
        manager.append(old_fence, InputMode.APPEND_AUDIO_CHUNK)
    assert manager.append(new_fence, InputMode.APPEND_AUDIO_CHUNK).seq == 1


def _plan(fence: Fence, payload: AudioPayload | UnitPayload, *, seq: int, client_meta=None):
    """``build_duplex_data_plane_prompt``: the stage-0 prompt of one append."""
    mode = (
        InputMode.APPEND_AUDIO_CHUNK if isinstance(payload, AudioPayload) else InputMode.APPEND_UNIT
    )
    return MiniCPMOExtension().plan_append(
        fence, mode, payload, first_append=seq == 1, client_meta=client_meta
    )


def test_duplex_prompt_expands_incarnation_metadata():
    fence = Fence("sid-incarnation", incarnation=3)
    # The upstream payload ({"is_speech": True}) carries no audio samples.
    plan = _plan(fence, AudioPayload(b""), seq=1, client_meta={"is_speech": True})
    assert plan.buffer.incarnation == 3


def test_duplex_runtime_tracks_turn_local_append_sequence():
    manager = SessionManager()
    fence = Fence("sid-turn-seq")
    manager.open(fence, capabilities={InputMode.APPEND_AUDIO_CHUNK})
    mode = InputMode.APPEND_AUDIO_CHUNK

    first = manager.append(fence, mode)
    second = manager.append(fence, mode)
    next_turn = Fence("sid-turn-seq", turn_id=1, response_seq=1)
    third = manager.append(next_turn, mode)
    fourth = manager.append(next_turn, mode)

    assert [first.seq, second.seq, third.seq, fourth.seq] == [1, 2, 3, 4]
    assert [first.turn_seq, second.turn_seq, third.turn_seq, fourth.turn_seq] == [1, 2, 1, 2]
    assert [first.turn_id, second.turn_id, third.turn_id, fourth.turn_id] == [0, 0, 1, 1]


def test_duplex_runtime_rejects_unsupported_append_mode():
    manager = SessionManager()
    fence = Fence("sid-2")
    manager.open(fence, capabilities={InputMode.TURN_COMMIT_ONLY})

    with pytest.raises(UnsupportedModeError, match="not supported"):
        manager.append(fence, InputMode.APPEND_TOKENS)
    assert isinstance(UnsupportedModeError("x"), ValueError)


def test_duplex_data_plane_request_info_extracts_structured_stage_result():
    request_id, response_stage_id = data_plane_request_info(
        {
            "stage_results": [
                {"result": {"supported": True}},
                {
                    "result": {
                        "data_plane_append": True,
                        "request_id": "duplex-sid-e0-stage0-s1",
                        "response_stage_id": 1,
                    }
                },
            ]
        }
    )

    assert request_id == "duplex-sid-e0-stage0-s1"
    assert response_stage_id == 1


def test_duplex_data_plane_request_info_rejects_missing_request_id():
    reply = {
        "stage_results": [
            {"result": {"data_plane_append": True, "request_id": "", "response_stage_id": 1}}
        ]
    }
    assert data_plane_request_info(reply) == (None, None)


def _budget(unit: dict[str, object]) -> int:
    """``duplex_scheduler_token_budget``: the JSON unit decoded into the wire payload."""
    audio_b64 = unit.get("audio")
    audio = None
    if isinstance(audio_b64, str):
        data = decode_base64_audio(audio_b64)
        assert data is not None
        audio = AudioPayload(
            data, format=str(unit["format"]), sample_rate=int(unit.get("sample_rate_hz", 16000))
        )
    frames = tuple(_frame_bytes(frame) for frame in unit.get("video_frames", ()))  # type: ignore[attr-defined]
    video = VideoPayload(frames) if frames else None
    return unit_budget(UnitPayload(audio=audio, video=video)).total


def _frame_bytes(frame: str) -> bytes:
    try:
        return base64.b64decode(frame, validate=True)
    except ValueError:
        return frame.encode()  # not base64 at all: the bytes stay unreadable as an image


def test_duplex_scheduler_token_budget_estimates_pcm_slots():
    assert _budget({"audio": "AAAAAA==", "format": "pcm_f32le", "sample_rate_hz": 16000}) == 16


def test_duplex_scheduler_token_budget_ignores_client_budget_fields():
    fence = Fence("sid")
    plan = _plan(
        fence,
        AudioPayload(base64.b64decode("AAAAAA==")),
        seq=2,
        client_meta={"duplex_num_input_tokens": 999, "num_input_tokens": 999},
    )
    assert plan.buffer.budget == 16


def test_resource_state_rejects_fence_regression_and_requires_explicit_fence():
    current = Fence("sid", epoch=2, turn_id=3, response_seq=4)
    manager = SessionManager()
    session = manager.open(current, capabilities={InputMode.APPEND_AUDIO_CHUNK})

    for stale in (
        Fence("sid", epoch=1, turn_id=99, response_seq=99),
        Fence("sid", epoch=2, turn_id=2, response_seq=4),
        Fence("sid", epoch=2, turn_id=3, response_seq=3),
    ):
        with pytest.raises(FenceMismatchError, match="fence mismatch"):
            manager.accept_fence(stale)
        assert session.fence == current

    with pytest.raises(TypeError, match="fence"):
        manager.bind_request(stage_id=0, request_id="request")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="fence"):
        manager.append(mode=InputMode.APPEND_AUDIO_CHUNK)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="Fence"):
        manager.open("legacy-session")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Fence"):
        manager.close("legacy-session")  # type: ignore[arg-type]


def test_resource_request_id_is_derived_from_fence_and_role():
    fence = Fence("sid-with-dashes", epoch=7, turn_id=11, response_seq=13)

    assert make_request_id(fence, "stage0") == "duplex-s.c2lkLXdpdGgtZGFzaGVz.i.0.e.7.r.stage0"
    assert make_request_id(fence, "stage1") == "duplex-s.c2lkLXdpdGgtZGFzaGVz.i.0.e.7.r.stage1"


def test_resource_request_id_codec_separates_session_id_from_incarnation():
    embedded = make_request_id(Fence("foo-i1", incarnation=0), "stage0")
    actual = make_request_id(Fence("foo", incarnation=1), "stage0")
    assert embedded != actual


def test_resource_request_id_session_membership_uses_encoded_identity():
    request_id = make_request_id(Fence("sid-with-dashes", incarnation=2, epoch=7), "stage0")

    assert belongs_to_session(request_id, "sid-with-dashes") is True
    assert belongs_to_session(request_id, "sid") is False
    assert belongs_to_session("duplex-s.invalid.i.x.e.7.r.stage0", "sid") is False


def test_placeholder_budget_is_planned_inside_omni_engine_boundary():
    fence = Fence("sid", turn_id=1, response_seq=1)
    plan = _plan(
        fence,
        AudioPayload(base64.b64decode("AAAAAA==")),
        seq=2,
        client_meta={"duplex_num_input_tokens": 999, "num_input_tokens": 999},
    )

    assert len(plan.prompt_token_ids) == 16
    assert plan.buffer.fence == fence
    assert plan.buffer.budget == 16


def _jpeg_b64(width: int, height: int) -> str:
    buffer = BytesIO()
    Image.new("RGB", (width, height), (32, 64, 96)).save(buffer, format="JPEG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _pcm_unit(frames: list[str]) -> dict[str, object]:
    return {
        "audio": base64.b64encode(b"\x00" * (16000 * 4)).decode("ascii"),
        "format": "pcm_f32le",
        "sample_rate_hz": 16000,
        "video_frames": frames,
    }


def test_duplex_scheduler_token_budget_one_frame_is_one_block():
    audio_only = _budget(_pcm_unit([]))
    one_frame = _budget(_pcm_unit([_jpeg_b64(960, 540)]))
    assert one_frame - audio_only == 66


@pytest.mark.parametrize(
    ("base_size", "expected_blocks"),
    [((960, 540), 4), ((540, 960), 4), ((640, 360), 4), ((448, 448), 2), ((320, 240), 2)],
)
def test_duplex_scheduler_token_budget_matches_stage0_hd_slicing(base_size, expected_blocks):
    audio_only = _budget(_pcm_unit([]))
    pair = _budget(_pcm_unit([_jpeg_b64(*base_size), _jpeg_b64(448, 448)]))
    assert pair - audio_only == expected_blocks * 66


@pytest.mark.parametrize(
    ("size", "expected_patches"),
    [
        ((448, 448), 0),
        ((320, 240), 0),
        ((447, 449), 0),
        ((449, 449), 2),
        ((640, 360), 2),
        ((960, 540), 2),
        ((540, 960), 2),
        ((1920, 1080), 2),
    ],
)
def test_duplex_hd_slice_count_matches_official_grid(size, expected_patches):
    assert hd_patch_count(size, 2) == expected_patches


def test_duplex_scheduler_token_budget_unreadable_base_frame_keeps_hd_fallback():
    audio_only = _budget(_pcm_unit([]))
    pair = _budget(_pcm_unit(["not-an-image", _jpeg_b64(448, 448)]))
    assert pair - audio_only == 4 * 66
