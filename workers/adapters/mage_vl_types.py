"""Data types of the Mage-VL adapter and the coercions that build them.

Pure code, no asyncio: what a visual window is, what a cognition-gate
decision is, and how the loose shapes callers and injected model functions
hand us are turned into those two types. The coercions follow the upstream
Mage-VL adapter (vLLM-Omni) shape for shape.

Accepted inputs (``parse_input``):

- text query: ``str``, ``schemas.events.TextPayload``, or a mapping with a
  ``text`` key and no window data; the text is stripped, and a blank query
  means nothing (``None``), like a turn commit;
- visual window: anything else. A ``VisualWindow`` is kept as is; a
  ``VideoPayload`` (or a ``UnitPayload``'s video) gives its frames, codec and
  timing; a mapping gives its payload from ``data``, else ``frames``, else
  ``frame``, else ``codec``, and ``kind``, ``segment_id``, ``pts_ms``,
  ``duration_ms`` and ``metadata`` (a non-mapping metadata value is kept
  under ``metadata``); any other object (encoded bytes, a decoded array,
  codec side information) is the window's opaque ``data``;
- an ``InputEvent`` is unwrapped to its payload first; a ``CommitPayload``
  means nothing here (``None``); audio-only and token payloads raise
  ``UnsupportedModeError`` (a ``ValueError``): Mage-VL takes text and video.

Accepted gate answers (``coerce_decision``): a ``GateDecision``; a mapping
whose respond flag is ``should_respond``, else ``respond``, else ``open``
(default false: a bare ``{"text": ...}`` does not respond), with ``text``,
``event_id``, ``score``, ``reason`` and ``metadata``; a string (stripped; it
responds with that text when non-blank); anything else by truth value
(``None`` and ``False`` are silent).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from schemas.errors import UnsupportedModeError
from schemas.events import (
    AudioPayload,
    CommitPayload,
    InputEvent,
    TextPayload,
    TokensPayload,
    UnitPayload,
    VideoPayload,
)
from workers.adapters.base import EMPTY_METADATA, freeze_metadata

__all__ = [
    "GateDecision",
    "VisualWindow",
    "coerce_decision",
    "coerce_window",
    "parse_input",
]

_T = TypeVar("_T")
_PAYLOAD_KEYS = ("data", "frames", "frame", "codec")
"""Mapping keys that carry a window's payload, in the order they are looked up."""


@dataclass(frozen=True, slots=True)
class VisualWindow:
    """One causal slice of video the model looks at.

    ``data`` is opaque: encoded frames (a tuple of bytes, as the wire carries
    them), decoded arrays or codec-native side information all fit, so
    classic codecs and neural codec tensors share one session API.
    ``frames`` is the encoded-frame view of ``data`` for the stages that
    decode images.
    """

    data: object
    kind: str = "video"
    codec: str = "jpeg"
    """Encoding of the frames in ``data`` when they are encoded images."""
    segment_id: str | None = None
    pts_ms: int | None = None
    duration_ms: int | None = None
    metadata: Mapping[str, object] = field(default_factory=lambda: EMPTY_METADATA)

    def __post_init__(self) -> None:
        if isinstance(self.data, bytearray | memoryview):
            object.__setattr__(self, "data", bytes(self.data))
        if isinstance(self.data, list):
            object.__setattr__(self, "data", tuple(self.data))
        for name in ("codec", "kind"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"VisualWindow.{name} must be a non-empty string")
        if self.segment_id is not None and not isinstance(self.segment_id, str):
            raise TypeError("VisualWindow.segment_id must be a string or None")
        for name in ("pts_ms", "duration_ms"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"VisualWindow.{name} must be a non-negative int, got {value!r}")
        object.__setattr__(self, "metadata", freeze_metadata(self.metadata))

    @property
    def frames(self) -> tuple[bytes, ...]:
        """The encoded frames in ``data``: one for bytes, each for a tuple of bytes; else none."""
        if isinstance(self.data, bytes):
            return (self.data,)
        if isinstance(self.data, tuple) and all(isinstance(f, bytes) for f in self.data):
            return self.data
        return ()


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The cognition gate's verdict on the current windows."""

    respond: bool
    text: str = ""
    event_id: str | None = None
    metadata: Mapping[str, object] = field(default_factory=lambda: EMPTY_METADATA)
    score: float | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.respond, bool):
            raise TypeError("GateDecision.respond must be a bool")
        if not isinstance(self.text, str) or not isinstance(self.reason, str):
            raise TypeError("GateDecision.text and reason must be strings")
        if self.event_id is not None and not isinstance(self.event_id, str):
            raise TypeError("GateDecision.event_id must be a string or None")
        object.__setattr__(self, "metadata", freeze_metadata(self.metadata))


SILENT = GateDecision(respond=False)


def _optional(value: object, convert: Callable[[Any], _T]) -> _T | None:
    return None if value is None else convert(value)


def _window_from_mapping(item: Mapping[str, Any]) -> VisualWindow:
    metadata = item.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        metadata = {"metadata": metadata}
    payload = None
    for key in _PAYLOAD_KEYS:
        if key in item:
            payload = item[key]
            break
    codec = item.get("codec")
    return VisualWindow(
        data=payload,
        kind=str(item.get("kind", "video")),
        # "codec" names the encoding when another key carries the payload.
        codec=codec if isinstance(codec, str) and codec and payload is not codec else "jpeg",
        segment_id=_optional(item.get("segment_id"), str),
        pts_ms=_optional(item.get("pts_ms"), int),
        duration_ms=_optional(item.get("duration_ms"), int),
        metadata=metadata,
    )


def coerce_window(item: object) -> VisualWindow:
    """Turn any accepted video shape into a ``VisualWindow`` (see module docs)."""
    if isinstance(item, VisualWindow):
        return item
    if isinstance(item, VideoPayload):
        return VisualWindow(
            data=item.frames, codec=item.codec, pts_ms=item.pts_ms, duration_ms=item.duration_ms
        )
    if isinstance(item, UnitPayload):
        if item.video is None:
            raise UnsupportedModeError("a unit without video is not supported by Mage-VL")
        return coerce_window(item.video)
    if isinstance(item, AudioPayload | TokensPayload):
        raise UnsupportedModeError(f"{type(item).__name__} is not supported by Mage-VL")
    if isinstance(item, Mapping):
        return _window_from_mapping(item)
    return VisualWindow(data=item)


def _has_payload(item: Mapping[str, Any]) -> bool:
    return any(key in item for key in _PAYLOAD_KEYS)


def _query_text(item: object) -> str | None:
    """The query text if ``item`` is a text input, else ``None``."""
    if isinstance(item, str):
        return item
    if isinstance(item, TextPayload):
        return item.text
    if isinstance(item, Mapping) and "text" in item and not _has_payload(item):
        return str(item["text"] or "")
    return None


def parse_input(item: object) -> str | VisualWindow | None:
    """Classify one input: a query string, a visual window, or ``None`` (nothing to keep)."""
    if isinstance(item, InputEvent):
        item = item.payload
    if isinstance(item, CommitPayload):
        return None
    query = _query_text(item)
    if query is None:
        return coerce_window(item)
    return query.strip() or None


def _decision_from_mapping(source: Mapping[str, Any]) -> GateDecision:
    flag = False
    for key in ("should_respond", "respond", "open"):
        if key in source:
            flag = source[key]
            break
    text = source.get("text")
    return GateDecision(
        respond=bool(flag),
        text="" if text is None else str(text),
        event_id=_optional(source.get("event_id"), str),
        score=_optional(source.get("score"), float),
        reason=str(source.get("reason") or ""),
        metadata=freeze_metadata(source.get("metadata")),
    )


def coerce_decision(value: object) -> GateDecision:
    """Turn a gate's answer into a ``GateDecision`` (see module docs)."""
    if isinstance(value, GateDecision):
        return value
    if isinstance(value, Mapping):
        return _decision_from_mapping(value)
    if isinstance(value, str):
        text = value.strip()
        return GateDecision(respond=bool(text), text=text)
    return GateDecision(respond=bool(value))
