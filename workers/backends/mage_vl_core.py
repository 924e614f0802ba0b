"""The pure core of the ``mage_vl`` stage: options, windows, prompts, gate verdicts.

Nothing here awaits or touches Redis or the engine; ``mage_vl_stage`` (the
shell) calls it and carries out what it returns. Theory of operation:

- **What an event is** (``classify``): a video frame (``append_video_frame``,
  or the video of an ``append_unit``) becomes a *window*; text (and an
  upstream stage's text deltas and transcripts) is part of the user's next
  *query*; a turn commit (or an upstream ``done``) closes the query and asks
  for an answer; anything else means nothing to a video stage.
- **Windows** (``make_window``): each frame payload becomes one
  ``VisualWindow`` whose ``segment_id`` is ``pts_ms // segment_ms``: windows of
  one segment show the same moment of the stream. Its metadata records the
  session (the engine calls need it to name their requests), the input
  ``seq`` and each frame's size, read from the image header with Pillow; a
  frame that is not an image is refused here.
- **Prompts**: every window is described on one line (time, length, segment,
  frames, sizes, metadata). The gate asks whether the latest window holds
  something worth saying; an answer prompt puts a user's question to the
  windows; a remark prompt asks for the sentence that voices a gate decision.
  Each is a chat (optional system message, one user message) built from a
  template option; ``fit_lines`` drops the oldest window lines until the
  rendered prompt fits the engine's budget. This text description is what the
  tiny test model sees; a real Mage-VL gets the frames themselves (see
  ``mage_vl_stage`` and ``docs/gpu-mage-vl.md``).
- **Verdicts** (``verdict``): with ``gate_decision = "model"`` the gate's text
  is matched against ``gate_accept`` (a regex, case-insensitive, anchored at the
  start): a match means "speak", the rest of the text is the proposed remark
  and a named group ``event`` (if the pattern has one and it matched) names the
  event. ``"always"`` and ``"never"`` override the model's verdict (the model is
  still asked): for tests and benchmarks that need a fixed policy.
- **Events** (``event_id``): a positive verdict is tied to an event so that the
  adapter speaks each event once: the latest window's segment
  (``event_key = "segment"``), a digest of its frames (``"frames"``: an unchanged
  picture is the same event) or nothing (``"none"``: every verdict speaks).
"""

from __future__ import annotations

import hashlib
import io
import re
import string
from collections.abc import Callable, Mapping, Sequence
from enum import Enum, auto
from typing import Any, Literal, NamedTuple, Self

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas.events import (
    CommitPayload,
    OutputEvent,
    OutputKind,
    TextPayload,
    UnitPayload,
    VideoPayload,
)
from workers.adapters.base import OutputChunk
from workers.adapters.mage_vl_types import GateDecision, VisualWindow
from workers.backends.base import BackendError, OutputDraft, StageEvent
from workers.backends.mage_vl_media import MEDIA_ENGINE_KEYS, MageVLEngineOptions
from workers.backends.vllm_history import ChatMessages

ENGINE_KEYS = MEDIA_ENGINE_KEYS | frozenset(
    {
        "model",
        "tokenizer",
        "dtype",
        "max_model_len",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "enforce_eager",
        "seed",
        "temperature",
        "top_p",
        "fallback_model_dir",
    }
)
"""Options of a ``mage_vl`` stage that configure the engine (validated by
``MageVLEngineOptions``)."""

SESSION_META = "session_id"
"""Window metadata key naming the session the window belongs to."""
SEQ_META = "seq"
"""Window metadata key holding the input ``seq`` the window came from."""
SIZES_META = "sizes"
"""Window metadata key holding the frames' sizes, ``WxH`` comma-separated."""
_UNDESCRIBED = frozenset({SESSION_META, SEQ_META, SIZES_META})

_PLACEHOLDERS = {
    "gate_prompt": ({"windows"}, {"windows", "query"}),
    "answer_prompt": ({"windows", "query"}, {"windows", "query"}),
    "remark_prompt": ({"windows"}, {"windows", "remark"}),
}
"""Per template: placeholders it must hold, placeholders it may hold."""


class MageVLOptions(BaseModel):
    """The Mage-VL part of a ``mage_vl`` stage's options (engine keys go to
    ``MageVLEngineOptions``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    window_size: int = Field(4, ge=1, le=256)
    """Windows the gate looks at; the gate runs once this many exist, on every new one."""
    max_windows: int = Field(64, ge=1, le=4096)
    """Windows a session retains (oldest dropped); answers and remarks see the latest
    ``window_size`` of them."""
    max_gate_tasks: int = Field(4, ge=1, le=64)
    """Gate calls one session runs at once; a window arriving past that is not gated
    (bounds the engine load one video stream causes; upstream has no bound)."""
    image_placeholder: str | None = Field(None, min_length=1, max_length=64)
    """Text standing for one image in the model's prompts (``<image>`` for Idefics3 and
    SmolVLM, ``(<image>./</image>)`` for MiniCPM-V): set, each window line ends with one per
    frame and the request carries the frames as images (``mage_vl_media``); unset, windows
    are described in text only."""
    frame_tokens: int = Field(0, ge=0, le=65_536)
    """Prompt tokens one frame adds once vLLM expands its placeholder, counted when the
    window lines are fitted into ``max_model_len`` (0: not counted)."""
    hold_decisions_while_responding: bool = True
    """A gate decision waits while an answer or remark streams instead of cutting it
    short when the next frame arrives (upstream lets it start at once)."""
    segment_ms: int = Field(2000, ge=1, le=3_600_000)
    """Stream time one segment spans: windows whose pts fall in one segment show one moment."""
    event_key: Literal["segment", "frames", "none"] = "segment"
    """What names the event of a positive verdict (see the module docs); one event speaks once."""
    gate_decision: Literal["model", "always", "never"] = "model"
    """``model`` reads the verdict from the gate's text; ``always``/``never`` override it."""
    gate_accept: str = r"\W*yes\b\W*"
    """Regex matched (case-insensitive) at the start of the gate's text: a match means speak;
    the text after the match is the proposed remark; a named group ``event`` names the event."""
    system_prompt: str | None = (
        "You watch a live video stream with the viewer and speak up only when it matters."
    )
    """System message of every prompt; ``None`` for none."""
    gate_prompt: str = (
        "Video windows, oldest first:\n{windows}\n"
        "Did something new and worth telling the viewer happen in the latest window? "
        "Answer 'yes: <what to say>' or 'no'."
    )
    """User message of the gate; ``{windows}`` (required) is the window list, ``{query}`` the
    user's question or an empty string."""
    answer_prompt: str = "Video windows, oldest first:\n{windows}\nThe viewer asks: {query}"
    """User message answering a question; ``{windows}`` and ``{query}`` are required."""
    remark_prompt: str = (
        "Video windows, oldest first:\n{windows}\n"
        "Something worth saying just happened ({remark}). Tell the viewer in one sentence."
    )
    """User message voicing a gate decision; ``{windows}`` (required), ``{remark}`` the gate's
    proposed text (empty when it gave none)."""
    gate_max_tokens: int = Field(16, ge=1)
    """Most tokens one gate call generates: keep it short, the gate runs on every window."""
    generate_max_tokens: int = Field(96, ge=1)
    """Most tokens one spoken answer or remark generates."""

    @field_validator("gate_accept")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.window_size > self.max_windows:
            raise ValueError(
                f"window_size ({self.window_size}) exceeds max_windows ({self.max_windows})"
            )
        for name, (required, allowed) in _PLACEHOLDERS.items():
            names = _placeholders(getattr(self, name), name)
            if missing := required - names:
                raise ValueError(f"{name} lacks {{{', '.join(sorted(missing))}}}")
            if unknown := names - allowed:
                raise ValueError(f"{name} has unknown placeholder {{{', '.join(sorted(unknown))}}}")
        return self

    @property
    def accept(self) -> re.Pattern[str]:
        return re.compile(self.gate_accept, re.IGNORECASE)


def _placeholders(template: str, name: str) -> set[str]:
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template)]
    except ValueError as exc:
        raise ValueError(f"{name} is not a valid template: {exc}") from exc
    names = {field for field in fields if field is not None}
    if any(not field.isidentifier() for field in names):
        raise ValueError(f"{name}: placeholders are plain names like {{windows}}")
    return names


class MageVLConfig(NamedTuple):
    """A ``mage_vl`` stage's validated options: the engine's and the stage's own."""

    engine: MageVLEngineOptions
    stage: MageVLOptions


def parse_options(stage: str, options: Mapping[str, Any]) -> MageVLConfig:
    """Validate a stage's options; raises ValueError naming the stage and each bad field."""
    engine_part = {key: value for key, value in options.items() if key in ENGINE_KEYS}
    own_part = {key: value for key, value in options.items() if key not in ENGINE_KEYS}
    problems: list[str] = []
    engine: MageVLEngineOptions | None = None
    own: MageVLOptions | None = None
    try:
        # The chat options of VllmOptions do not apply here; max_tokens=1 only keeps its
        # budget check out of the way (the two budgets below are checked instead).
        engine = MageVLEngineOptions.model_validate({**engine_part, "max_tokens": 1})
    except ValidationError as exc:
        problems += _problems(exc)
    try:
        own = MageVLOptions.model_validate(own_part)
    except ValidationError as exc:
        problems += _problems(exc)
    if engine is not None and own is not None:
        for name in ("gate_max_tokens", "generate_max_tokens"):
            if getattr(own, name) >= engine.max_model_len:
                problems.append(f"{name}: must be below max_model_len ({engine.max_model_len})")
    if problems or engine is None or own is None:
        raise ValueError(f"mage_vl stage {stage!r}: bad options: {'; '.join(problems)}")
    return MageVLConfig(engine, own)


def _problems(exc: ValidationError) -> list[str]:
    return [f"{'.'.join(map(str, err['loc'])) or 'options'}: {err['msg']}" for err in exc.errors()]


# -- events ----------------------------------------------------------------------------


class Kind(Enum):
    NOTHING = auto()
    WINDOW = auto()
    QUERY_PART = auto()
    COMMIT = auto()


class Classified(NamedTuple):
    kind: Kind
    video: VideoPayload | None = None
    text: str = ""


def classify(event: StageEvent) -> Classified:
    """What one event means to the video stage (see the module docs)."""
    if isinstance(event, OutputEvent):
        if event.kind in (OutputKind.TEXT_DELTA, OutputKind.TRANSCRIPT) and event.text:
            return Classified(Kind.QUERY_PART, text=event.text)
        if event.kind is OutputKind.DONE:
            return Classified(Kind.COMMIT)
        return Classified(Kind.NOTHING)
    payload = event.payload
    if isinstance(payload, VideoPayload):
        return Classified(Kind.WINDOW, video=payload)
    if isinstance(payload, UnitPayload) and payload.video is not None:
        return Classified(Kind.WINDOW, video=payload.video)
    if isinstance(payload, TextPayload) and payload.text:
        return Classified(Kind.QUERY_PART, text=payload.text)
    if isinstance(payload, CommitPayload):
        return Classified(Kind.COMMIT)
    return Classified(Kind.NOTHING)


def make_window(video: VideoPayload, *, seq: int, session_id: str, segment_ms: int) -> VisualWindow:
    """The window for one frame payload; raises ``BackendError`` for a frame that is no image."""
    if not video.frames:
        raise BackendError(f"input {seq}: a video payload without frames")
    sizes = []
    for index, frame in enumerate(video.frames):
        try:
            with Image.open(io.BytesIO(frame)) as image:
                width, height = image.size
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise BackendError(f"input {seq}: frame {index} is not an image") from exc
        sizes.append(f"{width}x{height}")
    return VisualWindow(
        data=video.frames,
        codec=video.codec,
        segment_id=str(video.pts_ms // segment_ms),
        pts_ms=video.pts_ms,
        duration_ms=video.duration_ms,
        metadata={SESSION_META: session_id, SEQ_META: seq, SIZES_META: ",".join(sizes)},
    )


# -- prompts ---------------------------------------------------------------------------


def describe(window: VisualWindow, index: int) -> str:
    """One line of a prompt's window list."""
    frames = len(window.frames)
    line = (
        f"{index}. t={window.pts_ms} ms, {window.duration_ms} ms long, "
        f"segment {window.segment_id or '-'}, {frames} {window.codec} "
        f"frame{'s' if frames != 1 else ''}"
    )
    sizes = window.metadata.get(SIZES_META)
    if sizes:
        line += f" ({sizes})"
    extra = [f"{key}={value}" for key, value in window.metadata.items() if key not in _UNDESCRIBED]
    if extra:
        line += f"; {', '.join(extra)}"
    return line


def describe_all(windows: Sequence[VisualWindow]) -> list[str]:
    return [describe(window, index) for index, window in enumerate(windows, 1)]


PromptBuilder = Callable[[Sequence[str]], ChatMessages]
"""Builds a chat from (a suffix of) the window lines."""


def _chat(options: MageVLOptions, user: str) -> ChatMessages:
    chat: ChatMessages = []
    if options.system_prompt:
        chat.append({"role": "system", "content": options.system_prompt})
    chat.append({"role": "user", "content": user})
    return chat


def gate_builder(options: MageVLOptions, query: str | None) -> PromptBuilder:
    def build(lines: Sequence[str]) -> ChatMessages:
        text = options.gate_prompt.format(windows="\n".join(lines), query=query or "")
        return _chat(options, text)

    return build


def answer_builder(options: MageVLOptions, query: str) -> PromptBuilder:
    def build(lines: Sequence[str]) -> ChatMessages:
        return _chat(options, options.answer_prompt.format(windows="\n".join(lines), query=query))

    return build


def remark_builder(options: MageVLOptions, decision: GateDecision) -> PromptBuilder:
    def build(lines: Sequence[str]) -> ChatMessages:
        text = options.remark_prompt.format(windows="\n".join(lines), remark=decision.text)
        return _chat(options, text)

    return build


def fit_lines(
    build: PromptBuilder, lines: Sequence[str], count: Callable[[ChatMessages], int], budget: int
) -> tuple[ChatMessages, int]:
    """The chat with as many of the newest window lines as fit ``budget`` tokens, and how many.

    Raises ``BackendError`` when not even the newest window fits.
    """
    for start in range(len(lines)):
        chat = build(lines[start:])
        if count(chat) <= budget:
            return chat, len(lines) - start
    raise BackendError(f"the prompt does not fit {budget} tokens even with one window")


# -- verdicts --------------------------------------------------------------------------


def event_id(options: MageVLOptions, windows: Sequence[VisualWindow]) -> str | None:
    """The event a positive verdict on ``windows`` is about (the latest window's)."""
    if not windows or options.event_key == "none":
        return None
    latest = windows[-1]
    if options.event_key == "segment":
        return None if latest.segment_id is None else f"segment-{latest.segment_id}"
    digest = hashlib.sha256()
    for frame in latest.frames:
        digest.update(len(frame).to_bytes(8, "big"))
        digest.update(frame)
    return f"frames-{digest.hexdigest()[:16]}"


def verdict(options: MageVLOptions, text: str, windows: Sequence[VisualWindow]) -> GateDecision:
    """The gate's decision from its generated ``text`` (see the module docs)."""
    match = options.accept.match(text)
    remark = text[match.end() :].strip() if match else ""
    if options.gate_decision == "always":
        respond = True
    elif options.gate_decision == "never":
        respond = False
    else:
        respond = match is not None
    if not respond:
        return GateDecision(respond=False, metadata={"gate_text": text})
    named = match.groupdict().get("event") if match else None
    return GateDecision(
        respond=True,
        text=remark,
        event_id=named or event_id(options, windows),
        metadata={"gate_text": text},
    )


# -- outputs ---------------------------------------------------------------------------


class Speaking(NamedTuple):
    """The engine request voicing a session's current response, and why it speaks."""

    request_id: str
    trigger: Literal["query", "gate"]


def to_draft(chunk: OutputChunk, speaking: Speaking | None) -> OutputDraft:
    """The output draft for one chunk of the session's adapter runtime.

    Every draft names the runtime's ``response`` number; deltas and ``done`` also
    name the engine request that produced them and the ``trigger`` (``query`` for
    an answer, ``gate`` for a proactive remark). ``done`` keeps the adapter's
    metadata (``trigger``, ``event_id``, ``answered``) where it is a plain value.
    """
    meta: dict[str, str | int | float | bool] = {"response": chunk.response_id}
    if chunk.kind is OutputKind.ERROR:
        meta["code"] = "backend_error"
        meta.update(_plain(chunk.metadata))
        return OutputDraft(OutputKind.ERROR, text=chunk.text, meta=meta)
    if speaking is not None:
        meta["request_id"] = speaking.request_id
        meta["trigger"] = speaking.trigger
    if chunk.kind is OutputKind.DONE:
        meta.update(_plain(chunk.metadata))
    return OutputDraft(chunk.kind, text=chunk.text, data=chunk.data, meta=meta)


def _plain(metadata: Mapping[str, object]) -> dict[str, str | int | float | bool]:
    return {
        key: value for key, value in metadata.items() if isinstance(value, str | int | float | bool)
    }
