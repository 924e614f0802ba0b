"""MiniCPM-o token budgets: audio seconds, MiniCPM-V slicing and frame groups."""

from __future__ import annotations

import base64
from io import BytesIO

import pytest
from PIL import Image

from schemas.events import AudioPayload, UnitPayload, VideoPayload
from workers.extensions import budget
from workers.extensions.budget import (
    DEFAULT_AUDIO_TOKENS,
    TOKENS_PER_IMAGE_BLOCK,
    UnitBudget,
    audio_payload_budget,
    audio_token_budget,
    audio_token_budget_base64,
    audio_tokens_for_samples,
    decode_base64_audio,
    hd_patch_count,
    image_size,
    slice_grid,
    unit_budget,
    video_block_count,
    video_payload_budget,
    video_token_budget,
)

RATE = 16_000


def pcm(samples: int) -> bytes:
    """``samples`` silent pcm_f32le samples."""
    return b"\x00" * (4 * samples)


def image(width: int, height: int, fmt: str = "JPEG") -> bytes:
    out = BytesIO()
    Image.new("RGB", (width, height), (30, 90, 160)).save(out, fmt)
    return out.getvalue()


# --- audio --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("samples", "tokens"),
    [
        (RATE, 12),  # 1 s exact: 2 + 10
        (2 * RATE, 24),  # 2 s exact
        (100 * RATE, 1200),  # exact seconds are not capped
        (RATE // 2, 16),  # 0.5 s: 8000 // 1600 + 8 = 13 -> floor 16
        (RATE + RATE // 2, 23),  # 1.5 s: 15 + 8
        (160_800, 108),  # 10.05 s: 100 + 8
        (RATE + 1, 18),  # one sample over a second is no longer exact: 10 + 8
        (RATE - 1, 17),  # 9 + 8
        (0, 16),  # empty audio is not a whole second
        (2_000 * RATE + 1, 768),  # huge: capped
    ],
)
def test_audio_tokens_for_samples(samples, tokens):
    assert audio_tokens_for_samples(samples) == tokens
    assert audio_token_budget(pcm(samples)) == tokens


def test_audio_tokens_reject_negative_samples():
    with pytest.raises(ValueError):
        audio_tokens_for_samples(-1)


@pytest.mark.parametrize(
    ("data", "kwargs"),
    [
        (pcm(RATE) + b"\x00", {}),  # not whole f32 samples
        (pcm(RATE), {"audio_format": "pcm_s16le"}),
        (pcm(RATE), {"sample_rate": 24_000}),
    ],
)
def test_audio_undecodable_or_foreign_costs_default(data, kwargs):
    assert audio_token_budget(data, **kwargs) == DEFAULT_AUDIO_TOKENS == 64


def test_audio_payload_uses_its_format_and_rate():
    assert audio_payload_budget(AudioPayload(data=pcm(RATE))) == 12
    assert audio_payload_budget(AudioPayload(data=pcm(RATE), format="pcm_s16le")) == 64
    assert audio_payload_budget(AudioPayload(data=pcm(RATE), sample_rate=8_000)) == 64


def test_audio_payload_bytes_are_raw_never_base64_decoded():
    # The wire carries binary PCM: base64 text sent as bytes is measured as
    # 85 336 raw bytes (21 334 samples), not decoded back to one second.
    text_bytes = base64.b64encode(pcm(RATE))
    assert len(text_bytes) == 85_336
    assert audio_payload_budget(AudioPayload(data=text_bytes)) == 21_334 // 1_600 + 8


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        (base64.b64encode(pcm(RATE)).decode(), 12),
        (base64.b64encode(pcm(2 * RATE)).decode(), 24),
        (base64.b64encode(pcm(RATE // 2)).decode(), 16),
        ("not base64 at all!", 64),
        ("QUJD", 64),  # valid base64 of 3 bytes: not whole samples
        ("AAAA=", 64),  # bad padding
        ("ÄÖÜ", 64),  # non-ASCII
    ],
)
def test_audio_base64_helper(text, tokens):
    assert audio_token_budget_base64(text) == tokens


def test_decode_base64_audio_is_strict():
    assert decode_base64_audio("AAAAAA==") == b"\x00\x00\x00\x00"
    assert decode_base64_audio("AA AA") is None


# --- slicing ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "patches"),
    [
        ((447, 449), 0),  # just under one 448x448 area
        ((448, 448), 0),
        ((320, 240), 0),
        ((449, 449), 2),
        ((640, 360), 2),
        ((960, 540), 2),
        ((540, 960), 2),
        ((1920, 1080), 2),
        ((4000, 100), 2),
    ],
)
def test_hd_patch_count(size, patches):
    assert hd_patch_count(size) == patches


@pytest.mark.parametrize(
    ("size", "grid"),
    [((960, 540), (2, 1)), ((540, 960), (1, 2)), ((448, 448), None)],
)
def test_slice_grid_follows_aspect_ratio(size, grid):
    assert slice_grid(size, 2) == grid


def test_slice_grid_with_more_slices_picks_closest_aspect():
    # 1344x448 covers 3 areas: candidates 2, 3, 4 slices; (3, 1) matches 3:1 exactly.
    assert slice_grid((1344, 448), 9) == (3, 1)
    # A follower's limit of 1 never slices.
    assert slice_grid((1920, 1080), 1) is None


def test_slice_grid_rejects_empty_images():
    with pytest.raises(ValueError):
        slice_grid((0, 10), 2)


# --- frames -------------------------------------------------------------------
def test_image_size_reads_headers_and_tolerates_garbage():
    assert image_size(image(960, 540)) == (960, 540)
    assert image_size(image(64, 32, "PNG")) == (64, 32)
    assert image_size(b"definitely not an image") is None
    assert image_size(b"") is None
    assert image_size(image(960, 540)[:20]) is None  # truncated header


@pytest.mark.parametrize(
    ("base", "blocks"),
    [
        ((960, 540), 4),
        ((540, 960), 4),
        ((640, 360), 4),
        ((448, 448), 2),
        ((320, 240), 2),
    ],
)
def test_stacked_pair_blocks(base, blocks):
    frames = (image(*base), image(320, 240))
    assert video_block_count(frames) == blocks
    assert video_token_budget(frames) == blocks * TOKENS_PER_IMAGE_BLOCK
    if blocks == 4:
        assert video_token_budget(frames) == 264


def test_follower_frame_is_never_sliced():
    # A large follower still costs one block.
    assert video_block_count((image(320, 240), image(1920, 1080))) == 2


def test_unreadable_base_frame_costs_the_sliced_pair():
    assert video_block_count((b"garbage", image(320, 240))) == 4
    assert video_token_budget((b"garbage", b"garbage")) == 264


def test_single_frame_is_one_block_whatever_its_size():
    assert video_token_budget((image(1920, 1080),)) == 66
    assert video_token_budget((b"garbage",)) == 66


def test_frames_beyond_the_pair_cost_one_block_each():
    frames = (image(960, 540), image(320, 240), image(320, 240), image(1920, 1080))
    assert video_block_count(frames) == 1 + 2 + 3


def test_no_frames_cost_nothing():
    assert video_token_budget(()) == 0


def test_video_payload_ignores_declared_codec():
    payload = VideoPayload(frames=(image(960, 540, "PNG"), image(320, 240)), codec="jpeg")
    assert video_payload_budget(payload) == 264


# --- units --------------------------------------------------------------------
def test_unit_budget_sums_modalities():
    unit = UnitPayload(
        audio=AudioPayload(data=pcm(RATE)),
        video=VideoPayload(frames=(image(960, 540), image(320, 240))),
    )
    assert unit_budget(unit) == UnitBudget(audio_tokens=12, video_tokens=264)
    assert unit_budget(unit).total == 276
    assert unit_budget(UnitPayload(audio=AudioPayload(data=pcm(RATE // 2)))).total == 16
    assert unit_budget(UnitPayload()).total == 0


def test_budget_constants_match_the_documented_rules():
    assert budget.TOKENS_PER_WHOLE_SECOND == 12
    assert (budget.MIN_AUDIO_TOKENS, budget.MAX_AUDIO_TOKENS) == (16, 768)
    assert budget.SCALE_RESOLUTION == 448
    assert (budget.BASE_FRAME_MAX_SLICES, budget.FOLLOWER_FRAME_MAX_SLICES) == (2, 1)
