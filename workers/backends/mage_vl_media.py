"""How the ``mage_vl`` stage shows a vision-language model its frames (pure; no engine).

With ``image_placeholder`` set (the text that stands for one image in the
model's prompts: ``<image>`` for Idefics3/SmolVLM, ``(<image>./</image>)``
for MiniCPM-V), every window line of a prompt ends with one placeholder per
frame of the window, and the request carries the frames of the described
windows, decoded to RGB PIL images, as vLLM's ``multi_modal_data``
(``{"image": [...]}``) in the order of their placeholders. vLLM's processor
for the model then expands each placeholder into the model's image tokens.
Without it, prompts describe windows in text only (what a text model takes).

Budget: a placeholder is a few prompt tokens before vLLM expands it, so the
stage counts ``frame_tokens`` more per frame when it fits the window lines
into ``max_model_len`` (0: not counted, for a model whose expansion is small).

Engine options a vision-language checkpoint may need are here too
(``MageVLEngineOptions``: ``trust_remote_code``, ``limit_mm_per_prompt``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from PIL import Image, UnidentifiedImageError

from workers.adapters.mage_vl_types import VisualWindow
from workers.backends.base import BackendError
from workers.backends.vllm_options import MultimodalVllmOptions

MEDIA_ENGINE_KEYS = frozenset({"trust_remote_code", "limit_mm_per_prompt"})
"""Engine options a ``mage_vl`` stage has beyond the ``vllm`` stage's."""


class MageVLEngineOptions(MultimodalVllmOptions):
    """The ``vllm`` stage's engine options plus what a vision-language checkpoint needs."""


def with_placeholders(
    lines: Sequence[str], windows: Sequence[VisualWindow], placeholder: str
) -> list[str]:
    """Each window's line followed by one placeholder per frame of the window."""
    return [
        f"{line} {placeholder * len(window.frames)}"
        for line, window in zip(lines, windows, strict=True)
    ]


def decode_frames(windows: Sequence[VisualWindow]) -> list[Image.Image]:
    """The windows' frames as RGB images, in window and frame order."""
    images: list[Image.Image] = []
    for window in windows:
        for index, frame in enumerate(window.frames):
            try:
                with Image.open(io.BytesIO(frame)) as image:
                    images.append(image.convert("RGB"))
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                # make_window read the header; a frame can still fail to decode.
                raise BackendError(
                    f"window {window.segment_id}: frame {index} cannot be decoded"
                ) from exc
    return images


def image_data(windows: Sequence[VisualWindow]) -> dict[str, Any] | None:
    """vLLM's ``multi_modal_data`` for the described windows' frames; None without frames."""
    images = decode_frames(windows)
    return {"image": images} if images else None
