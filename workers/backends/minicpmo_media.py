"""The media behind a MiniCPM-o duplex prompt, in the form vLLM's MiniCPM-o model takes.

The stage-0 prompt holds placeholder tokens for each unit's video and audio
(``workers.extensions.minicpmo``: a unit's video placeholders first, then its
audio). vLLM fills them from the request's ``multi_modal_data``: under
``image`` a list of PIL images, under ``audio`` a list of float32 arrays at
16 kHz, each list in the order its placeholders appear in the prompt. This
module is pure (no engine, no I/O):

- ``unit_media(payload)`` decodes one input's payload: every encoded frame
  becomes an RGB image (a stacked pair is two images, base first), the PCM
  becomes one float32 array at 16 kHz (``pcm_f32le`` or ``pcm_s16le``; any
  other rate is resampled linearly). What cannot be decoded is dropped and
  named in ``UnitMedia.problems`` so the stage can log it; its placeholders
  stay in the prompt, and the engine refuses a request whose placeholders
  have no data, so a bad frame shows as that request's error, not as silence.
- ``multi_modal_data(media)`` joins the media of the prompt's segments, in
  prompt order, into vLLM's dict; None when there is none (a text prompt).
- ``engine_prompt(...)``: the token ids the engine gets. The session prompt
  holds a budget-sized run of placeholders per unit, which is what the unit
  occupies once vLLM has expanded it (the budget is how the stage fits its
  prompt). vLLM expands a token-id prompt itself: it looks for the model's
  own marker per item (``(<image>./</image>)`` and ``(<audio>./</audio>)``
  for MiniCPM-o) and replaces each with that item's tokens. So each unit's
  run is sent as one image marker per frame and one audio marker per audio;
  after vLLM's expansion the prompt is again as long as the stage counted
  it, when the budget rules and the model's agree.

The prompt keeps one ``UnitMedia`` per segment (``DuplexPrompt``), so a
segment dropped from the prompt drops its media with it.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from schemas.events import AudioPayload, UnitPayload, VideoPayload

SAMPLE_RATE = 16_000
"""The rate MiniCPM-o's audio encoder (Whisper's feature extractor) takes."""
PCM_SCALE = {"pcm_f32le": None, "pcm_s16le": 32768.0}
"""Sample formats understood, and the divisor that brings integer PCM into [-1, 1]."""


@dataclass(frozen=True, slots=True)
class UnitMedia:
    """The decoded media of one prompt segment (empty for text and token appends)."""

    images: tuple[Image.Image, ...] = ()
    audio: tuple[np.ndarray, ...] = ()
    problems: tuple[str, ...] = ()
    """What could not be decoded (dropped), for the stage's log."""
    placeholders: int = 0
    """Leading tokens of the segment that stand for this media (its budget)."""

    def __bool__(self) -> bool:
        return bool(self.images or self.audio)


NO_MEDIA = UnitMedia()


def decode_frame(data: bytes) -> Image.Image | None:
    """An encoded frame as a loaded RGB image; None when Pillow cannot decode it."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None


def decode_audio(payload: AudioPayload) -> np.ndarray | None:
    """The payload's samples as float32 at 16 kHz; None for an unknown or broken format."""
    if payload.format not in PCM_SCALE:
        return None
    scale = PCM_SCALE[payload.format]
    width = 4 if scale is None else 2
    if not payload.data or len(payload.data) % width:
        return None
    dtype = "<f4" if scale is None else "<i2"
    samples = np.frombuffer(payload.data, dtype=dtype).astype(np.float32)
    if scale is not None:
        samples /= scale
    if payload.sample_rate != SAMPLE_RATE:
        samples = resample(samples, payload.sample_rate)
    return samples


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """Linear resampling to 16 kHz (speech-grade; enough for an encoder's features)."""
    count = max(1, round(len(samples) * SAMPLE_RATE / rate))
    source = np.arange(len(samples), dtype=np.float64) / rate
    target = np.arange(count, dtype=np.float64) / SAMPLE_RATE
    resampled: np.ndarray = np.interp(target, source, samples).astype(np.float32)
    return resampled


def unit_media(payload: object, placeholders: int = 0) -> UnitMedia:
    """The media of one input payload (module docstring); ``NO_MEDIA`` for text."""
    video: VideoPayload | None = None
    audio: AudioPayload | None = None
    if isinstance(payload, UnitPayload):
        video, audio = payload.video, payload.audio
    elif isinstance(payload, VideoPayload):
        video = payload
    elif isinstance(payload, AudioPayload):
        audio = payload
    images: list[Image.Image] = []
    problems: list[str] = []
    for index, frame in enumerate(video.frames if video is not None else ()):
        image = decode_frame(frame)
        if image is None:
            problems.append(f"frame {index} is not an image Pillow can decode")
        else:
            images.append(image)
    samples: tuple[np.ndarray, ...] = ()
    if audio is not None:
        decoded = decode_audio(audio)
        if decoded is None:
            problems.append(f"audio in {audio.format!r} cannot be decoded")
        else:
            samples = (decoded,)
    return UnitMedia(tuple(images), samples, tuple(problems), placeholders)


def multi_modal_data(media: Iterable[UnitMedia]) -> dict[str, Any] | None:
    """vLLM's ``multi_modal_data`` for the segments' media, in prompt order; None if empty."""
    images: list[Image.Image] = []
    audio: list[np.ndarray] = []
    for item in media:
        images.extend(item.images)
        audio.extend(item.audio)
    data: dict[str, Any] = {}
    if images:
        data["image"] = images
    if audio:
        data["audio"] = audio
    return data or None


def engine_prompt(
    prefix: Sequence[int],
    segments: Iterable[Sequence[int]],
    media: Iterable[UnitMedia],
    image_marker: Sequence[int],
    audio_marker: Sequence[int],
) -> list[int]:
    """The prompt for the engine: each segment's placeholder run as per-item markers.

    A segment with media starts with ``placeholders`` placeholder tokens (what
    follows is the model's answer to the unit); they become one
    ``image_marker`` per image and one ``audio_marker`` per audio, in the
    order of the unit's placeholders (video first, then audio).
    """
    ids = list(prefix)
    for segment, item in zip(segments, media, strict=True):
        if item.placeholders:
            ids.extend(list(image_marker) * len(item.images))
            ids.extend(list(audio_marker) * len(item.audio))
            ids.extend(segment[item.placeholders :])
        else:
            ids.extend(segment)
    return ids
