"""Data types of the Mage-VL adapter and the coercions that build them.

Pure code, no asyncio: what a visual window is, what a cognition-gate
decision is, and how the loose shapes callers and injected model functions
hand us are turned into those two types (or rejected with a clear error).

Accepted inputs (``parse_input``):

- text query: ``str``, ``schemas.events.TextPayload``, or a mapping with a
  ``text`` key and no frame data;
- visual window: ``VisualWindow``, ``VideoPayload``, ``UnitPayload`` carrying
  video, raw ``bytes`` (one frame), or any mapping / attribute-style object
  with ``frames`` or ``data`` plus optional ``codec``, ``kind``,
  ``segment_id`` (or ``segment``), ``pts_ms`` (or ``pts``), ``duration_ms``
  (or ``duration``) and ``metadata``;
- an ``InputEvent`` is unwrapped to its payload first; a ``CommitPayload``
  is accepted and means nothing here (``None``); audio-only and token
  payloads raise ``UnsupportedModeError`` (a ``ValueError``), and a unit's
  audio is ignored when it also carries video.

Accepted gate answers (``coerce_decision``): a ``GateDecision``; ``None``
(silent); a bool (respond or not); a string (non-empty: respond with that
text); a mapping or object with ``respond``/``should_respond``,
``text``/``answer``, ``event_id`` and ``metadata``. Without an explicit
respond flag, a decision responds when it carries text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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

_MISSING = object()


@dataclass(frozen=True, slots=True)
class VisualWindow:
    """One slice of video the model looks at: encoded frames plus timing."""

    frames: tuple[bytes, ...]
    codec: str = "jpeg"
    kind: str = "video"
    segment_id: str | None = None
    pts_ms: int = 0
    duration_ms: int = 0
    metadata: Mapping[str, object] = field(default_factory=lambda: EMPTY_METADATA)

    def __post_init__(self) -> None:
        if not isinstance(self.frames, tuple) or not self.frames:
            raise ValueError("VisualWindow.frames must be a non-empty tuple of bytes")
        if not all(isinstance(frame, bytes) for frame in self.frames):
            raise TypeError("VisualWindow.frames must hold bytes")
        for name in ("codec", "kind"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"VisualWindow.{name} must be a non-empty string")
        if self.segment_id is not None and not isinstance(self.segment_id, str):
            raise TypeError("VisualWindow.segment_id must be a string or None")
        for name in ("pts_ms", "duration_ms"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"VisualWindow.{name} must be a non-negative int, got {value!r}")
        object.__setattr__(self, "metadata", freeze_metadata(self.metadata))


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The cognition gate's verdict on the current windows (or on a query)."""

    respond: bool
    text: str = ""
    event_id: str | None = None
    metadata: Mapping[str, object] = field(default_factory=lambda: EMPTY_METADATA)

    def __post_init__(self) -> None:
        if not isinstance(self.respond, bool):
            raise TypeError("GateDecision.respond must be a bool")
        if not isinstance(self.text, str):
            raise TypeError("GateDecision.text must be a string")
        if self.event_id is not None and not isinstance(self.event_id, str):
            raise TypeError("GateDecision.event_id must be a string or None")
        object.__setattr__(self, "metadata", freeze_metadata(self.metadata))


SILENT = GateDecision(respond=False)


def _field(source: object, *names: str) -> Any:
    """The first of ``names`` present on a mapping or object, else ``_MISSING``."""
    for name in names:
        if isinstance(source, Mapping):
            if name in source:
                return source[name]
        elif hasattr(source, name):
            return getattr(source, name)
    return _MISSING


def _frames(value: object) -> tuple[bytes, ...]:
    if isinstance(value, bytes | bytearray | memoryview):
        return (bytes(value),)
    if isinstance(value, Sequence) and not isinstance(value, str):
        frames = []
        for frame in value:
            if not isinstance(frame, bytes | bytearray | memoryview):
                raise TypeError(f"a video frame must be bytes, not {type(frame).__name__}")
            frames.append(bytes(frame))
        return tuple(frames)
    raise TypeError(f"frames must be bytes or a sequence of bytes, not {type(value).__name__}")


def _window_from_fields(source: object) -> VisualWindow:
    raw_frames = _field(source, "frames", "data")
    if raw_frames is _MISSING or raw_frames is None:
        raise ValueError(f"{type(source).__name__} has no frames/data to make a visual window from")
    options: dict[str, Any] = {"frames": _frames(raw_frames)}
    for target, names in (
        ("codec", ("codec",)),
        ("kind", ("kind",)),
        ("segment_id", ("segment_id", "segment")),
        ("pts_ms", ("pts_ms", "pts")),
        ("duration_ms", ("duration_ms", "duration")),
        ("metadata", ("metadata",)),
    ):
        value = _field(source, *names)
        if value is not _MISSING and value is not None:
            options[target] = value
    segment = options.get("segment_id")
    if segment is not None and not isinstance(segment, str):
        # Integer segment counters are common; keep ids as strings.
        options["segment_id"] = str(segment)
    return VisualWindow(**options)


def coerce_window(item: object) -> VisualWindow:
    """Turn any accepted video shape into a ``VisualWindow`` (see module docs)."""
    if isinstance(item, VisualWindow):
        return item
    if isinstance(item, VideoPayload):
        return VisualWindow(
            frames=item.frames, codec=item.codec, pts_ms=item.pts_ms, duration_ms=item.duration_ms
        )
    if isinstance(item, UnitPayload):
        if item.video is None:
            raise UnsupportedModeError("a unit without video is not supported by Mage-VL")
        return coerce_window(item.video)
    if isinstance(item, AudioPayload | TokensPayload | CommitPayload):
        # These carry data/fields a loose lookup would misread as frames.
        raise UnsupportedModeError(f"{type(item).__name__} is not supported by Mage-VL")
    if isinstance(item, bytes | bytearray | memoryview):
        return VisualWindow(frames=(bytes(item),))
    if isinstance(item, str | int | float | bool) or item is None:
        raise TypeError(f"cannot make a visual window from {type(item).__name__}")
    return _window_from_fields(item)


def _query_text(item: object) -> str | None:
    """The query text if ``item`` is a text input, else ``None``."""
    if isinstance(item, str):
        return item
    if isinstance(item, TextPayload):
        return item.text
    if isinstance(item, Mapping) and "text" in item and not ({"frames", "data"} & item.keys()):
        text = item["text"]
        if not isinstance(text, str):
            raise TypeError(f"text input must be a string, not {type(text).__name__}")
        return text
    return None


def parse_input(item: object) -> str | VisualWindow | None:
    """Classify one input: a query string, a visual window, or ``None`` (a commit)."""
    if isinstance(item, InputEvent):
        item = item.payload
    if isinstance(item, CommitPayload):
        return None
    query = _query_text(item)
    if query is None:
        return coerce_window(item)
    if not query.strip():
        raise ValueError("an empty text query")
    return query


def _decision_from_fields(source: object) -> GateDecision:
    text = _field(source, "text", "answer")
    if text is _MISSING or text is None:
        text = ""
    if not isinstance(text, str):
        raise TypeError(f"gate text must be a string, not {type(text).__name__}")
    flag = _field(source, "respond", "should_respond")
    respond = bool(text) if flag is _MISSING or flag is None else bool(flag)
    event_id = _field(source, "event_id")
    event_id = None if event_id is _MISSING or event_id is None else str(event_id)
    metadata = _field(source, "metadata")
    return GateDecision(
        respond=respond,
        text=text,
        event_id=event_id,
        metadata=freeze_metadata(None if metadata is _MISSING else metadata),
    )


def coerce_decision(value: object) -> GateDecision:
    """Turn a gate's answer into a ``GateDecision`` (see module docs)."""
    if isinstance(value, GateDecision):
        return value
    if value is None:
        return SILENT
    if isinstance(value, bool):
        return GateDecision(respond=value)
    if isinstance(value, str):
        return GateDecision(respond=True, text=value) if value.strip() else SILENT
    if isinstance(value, int | float | bytes | bytearray):
        raise TypeError(f"cannot read a gate decision from {type(value).__name__}")
    if isinstance(value, Mapping) or any(
        hasattr(value, name) for name in ("respond", "should_respond", "text", "answer")
    ):
        return _decision_from_fields(value)
    raise TypeError(f"cannot read a gate decision from {type(value).__name__}")
