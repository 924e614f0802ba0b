"""Scheduler token budgets for MiniCPM-o 4.5 duplex units.

Before a unit is appended to a running request, the scheduler has to know how
many prompt tokens it will occupy, so the stage-0 prompt is built from that
many placeholder tokens. The budget depends on the payload only; nothing a
client claims about its own size is trusted.

Audio (raw PCM, as ``AudioPayload.data`` carries it on the wire):

- only ``pcm_f32le`` at 16 kHz is understood; ``samples = len(data) // 4``;
- a whole number of seconds (``samples > 0`` and ``samples % 16000 == 0``)
  costs 12 tokens per second: 10 audio embeddings plus 2 boundary tokens;
- any other length costs ``max(16, min(768, samples // 1600 + 8))``;
- undecodable data (byte length not a multiple of 4, bad base64 for the text
  helper) and any other format or sample rate cost ``DEFAULT_AUDIO_TOKENS``.

The whole-second rule is not capped at 768: a client that streams exact
seconds is charged exactly what the model consumes.

Video (encoded frames, each an "image block" of 66 tokens):

- one frame is one block, never sliced;
- two or more frames are a stacked pair (base frame + followers). The base
  frame is sliced the MiniCPM-V way (``scale_resolution=448``, at most 2
  slices) and costs ``1 + patches`` blocks; every follower costs 1 block (its
  slice limit is 1, which never slices). Frames beyond the second are charged
  as followers rather than rejected, so a client that batches frames pays per
  frame instead of breaking the session.
- a base frame whose size cannot be read is charged as if it were sliced
  (the upper bound for a pair), so a bad image never under-reserves.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO

from schemas.events import AudioPayload, UnitPayload, VideoPayload

# --- audio ------------------------------------------------------------------
AUDIO_FORMAT = "pcm_f32le"
AUDIO_SAMPLE_RATE = 16_000
AUDIO_BYTES_PER_SAMPLE = 4
TOKENS_PER_WHOLE_SECOND = 12
"""10 audio embeddings per second plus 2 boundary tokens."""
SAMPLES_PER_AUDIO_TOKEN = 1_600
AUDIO_TOKEN_OFFSET = 8
MIN_AUDIO_TOKENS = 16
MAX_AUDIO_TOKENS = 768
DEFAULT_AUDIO_TOKENS = 64
"""Charged for audio whose length cannot be known (unknown format, bad data)."""

# --- video ------------------------------------------------------------------
TOKENS_PER_IMAGE_BLOCK = 66
SCALE_RESOLUTION = 448
BASE_FRAME_MAX_SLICES = 2
FOLLOWER_FRAME_MAX_SLICES = 1
UNREADABLE_BASE_PATCHES = BASE_FRAME_MAX_SLICES
"""Patches assumed for a base frame whose size cannot be read (worst case)."""


def audio_sample_count(data: bytes) -> int | None:
    """Number of ``pcm_f32le`` samples in ``data``; None if it is not whole samples."""
    if len(data) % AUDIO_BYTES_PER_SAMPLE:
        return None
    return len(data) // AUDIO_BYTES_PER_SAMPLE


def audio_tokens_for_samples(samples: int) -> int:
    """Token cost of ``samples`` 16 kHz samples (see the module docstring)."""
    if samples < 0:
        raise ValueError(f"sample count must be non-negative, got {samples}")
    if samples > 0 and samples % AUDIO_SAMPLE_RATE == 0:
        return (samples // AUDIO_SAMPLE_RATE) * TOKENS_PER_WHOLE_SECOND
    estimate = samples // SAMPLES_PER_AUDIO_TOKEN + AUDIO_TOKEN_OFFSET
    return max(MIN_AUDIO_TOKENS, min(MAX_AUDIO_TOKENS, estimate))


def audio_token_budget(
    data: bytes,
    *,
    audio_format: str = AUDIO_FORMAT,
    sample_rate: int = AUDIO_SAMPLE_RATE,
) -> int:
    """Token cost of raw PCM bytes (the wire form of ``AudioPayload.data``).

    ``data`` is used as is: raw bytes are never base64-decoded, because the
    wire carries binary audio. Text from a JSON client goes through
    ``audio_token_budget_base64`` instead.
    """
    if audio_format != AUDIO_FORMAT or sample_rate != AUDIO_SAMPLE_RATE:
        return DEFAULT_AUDIO_TOKENS
    samples = audio_sample_count(data)
    if samples is None:
        return DEFAULT_AUDIO_TOKENS
    return audio_tokens_for_samples(samples)


def decode_base64_audio(text: str) -> bytes | None:
    """Strictly decode base64 text; None when it is not valid base64."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        # ValueError covers non-ASCII characters in ``text``.
        return None


def audio_token_budget_base64(
    text: str,
    *,
    audio_format: str = AUDIO_FORMAT,
    sample_rate: int = AUDIO_SAMPLE_RATE,
) -> int:
    """Token cost of base64-encoded PCM (as JSON clients send it)."""
    data = decode_base64_audio(text)
    if data is None:
        return DEFAULT_AUDIO_TOKENS
    return audio_token_budget(data, audio_format=audio_format, sample_rate=sample_rate)


def audio_payload_budget(payload: AudioPayload) -> int:
    """Token cost of one wire audio payload (raw bytes, its own format and rate)."""
    return audio_token_budget(
        payload.data, audio_format=payload.format, sample_rate=payload.sample_rate
    )


# --- video ------------------------------------------------------------------
def slice_grid(
    size: tuple[int, int],
    max_slice_nums: int,
    scale_resolution: int = SCALE_RESOLUTION,
) -> tuple[int, int] | None:
    """The (columns, rows) grid an image of ``size`` is sliced into, or None.

    ``multiple = min(ceil(w*h / scale_resolution**2), max_slice_nums)``; at most
    one slice means the image is not sliced. Otherwise the candidate slice
    counts are ``multiple - 1``, ``multiple`` and ``multiple + 1`` (kept when
    ``1 < n <= max_slice_nums``), each split into every ``(m, n // m)`` with
    ``m`` dividing ``n``; the grid whose log aspect ratio is closest to the
    image's wins (first one on ties).
    """
    width, height = size
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {size}")
    area_ratio = (width * height) / (scale_resolution * scale_resolution)
    multiple = min(math.ceil(area_ratio), max_slice_nums)
    if multiple <= 1:
        return None
    counts = [n for n in (multiple - 1, multiple, multiple + 1) if 1 < n <= max_slice_nums]
    grids = [(m, n // m) for n in counts for m in range(1, n + 1) if n % m == 0]
    log_ratio = math.log(width / height)
    return min(grids, key=lambda grid: abs(log_ratio - math.log(grid[0] / grid[1])))


def hd_patch_count(
    size: tuple[int, int],
    max_slice_nums: int = BASE_FRAME_MAX_SLICES,
    scale_resolution: int = SCALE_RESOLUTION,
) -> int:
    """HD patches (slices) an image of ``size`` adds on top of its overview block."""
    grid = slice_grid(size, max_slice_nums, scale_resolution)
    return 0 if grid is None else grid[0] * grid[1]


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of an encoded image, or None if Pillow cannot read it.

    Pillow is imported here so modules that never see video do not load it;
    ``Image.open`` only parses the header, so this does not decode pixels.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(BytesIO(data)) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        # Pillow signals truncated or foreign data with any of these.
        return None
    if width <= 0 or height <= 0:
        return None
    return int(width), int(height)


def video_block_count(frames: Sequence[bytes]) -> int:
    """Image blocks for a frame group (see the module docstring)."""
    if not frames:
        return 0
    if len(frames) == 1:
        return 1
    size = image_size(frames[0])
    patches = UNREADABLE_BASE_PATCHES if size is None else hd_patch_count(size)
    # Followers have a slice limit of 1, so hd_patch_count would always be 0.
    return 1 + patches + (len(frames) - 1)


def video_token_budget(frames: Sequence[bytes]) -> int:
    """Token cost of a frame group: 66 tokens per image block."""
    return video_block_count(frames) * TOKENS_PER_IMAGE_BLOCK


def video_payload_budget(payload: VideoPayload) -> int:
    """Token cost of one wire video payload; the codec is sniffed, not trusted."""
    return video_token_budget(payload.frames)


@dataclass(frozen=True, slots=True)
class UnitBudget:
    """Token cost of one duplex unit, split by modality."""

    audio_tokens: int = 0
    video_tokens: int = 0

    @property
    def total(self) -> int:
        return self.audio_tokens + self.video_tokens


def unit_budget(payload: UnitPayload) -> UnitBudget:
    """Token cost of a unit: its audio plus its video, each when present."""
    audio = 0 if payload.audio is None else audio_payload_budget(payload.audio)
    video = 0 if payload.video is None else video_payload_budget(payload.video)
    return UnitBudget(audio_tokens=audio, video_tokens=video)
