"""Events that cross Redis, and their wire codec.

Three event types travel on the streams:

- ``InputEvent``: one accepted client input, stamped by the coordinator with
  the fence it was accepted under, the session-wide ``seq`` (1, 2, 3 ...) and
  the turn-local ``turn_seq``. The session log is a list of these.
- ``OutputEvent``: something a stage produced, stamped with the fence it was
  produced under, the producing stage and what kind of output it is.
- ``ControlEvent``: session lifecycle (open, cancel, close) that must reach
  workers ahead of queued data.

Encoding is msgpack through msgspec: compact, binary-safe for audio, and
decoding validates every field against these types. Nothing is pickled and no
type named on the wire is ever imported.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, TypeAlias, TypeVar

import msgspec

from schemas.errors import WireDecodeError
from schemas.fence import Fence
from schemas.trace import TraceContext

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
MetaValue: TypeAlias = str | int | float | bool


class InputMode(StrEnum):
    """How an input event changes the model's context."""

    APPEND_TOKENS = "append_tokens"
    APPEND_TEXT = "append_text"
    APPEND_AUDIO_CHUNK = "append_audio_chunk"
    APPEND_VIDEO_FRAME = "append_video_frame"
    APPEND_UNIT = "append_unit"
    """One duplex unit: an audio chunk and/or video frames that belong together."""
    TURN_COMMIT_ONLY = "turn_commit_only"
    """Ends the user's turn without adding content (the model may now respond)."""
    CLEAR_AUDIO = "clear_audio"
    """Drops audio buffered since the last commit (input_audio_buffer.clear)."""
    PLAYBACK_ACK = "playback_ack"
    """How far the client actually played a response; history is truncated there."""
    UPDATE_SESSION = "update_session"
    """The client changed the session's settings (``session.update``): they apply from
    here on, in log order with the inputs around them."""
    EDIT_CONVERSATION = "edit_conversation"
    """The client edited the model's conversation: an assistant or system message
    added, an item deleted, an answer cut where the user stopped hearing it."""


class TokensPayload(msgspec.Struct, frozen=True, tag="tokens"):
    token_ids: tuple[NonNegative, ...]


class TextPayload(msgspec.Struct, frozen=True, tag="text"):
    text: str
    item_id: str = ""
    """The conversation item the text is (a client's own id); empty: the server names
    it by the input's seq (``schemas.items``)."""


class AudioPayload(msgspec.Struct, frozen=True, tag="audio"):
    """Raw audio samples; ``format`` names the sample encoding (``pcm_f32le``, ``pcm_s16le``)."""

    data: bytes
    format: str = "pcm_f32le"
    sample_rate: Positive = 16000


class VideoPayload(msgspec.Struct, frozen=True, tag="video"):
    """Encoded frames (JPEG/PNG/...); two frames are a stacked pair (base + one)."""

    frames: tuple[bytes, ...]
    codec: str = "jpeg"
    pts_ms: NonNegative = 0
    duration_ms: NonNegative = 0


class UnitPayload(msgspec.Struct, frozen=True, tag="unit"):
    audio: AudioPayload | None = None
    video: VideoPayload | None = None


class CommitPayload(msgspec.Struct, frozen=True, tag="commit", omit_defaults=True):
    """The end of the user's turn (``input_audio_buffer.commit``, ``response.create``)."""

    respond: bool = False
    """A ``response.create`` asked for this response: the model answers from the
    conversation even when the turn added nothing (no speech heard, a function's result,
    no new input at all), and every stage passes the turn's end on for it."""
    trace: TraceContext | None = None
    """The turn's trace, begun by the coordinator as it took the commit (only while
    tracing is on: ``docs/tracing.md``)."""


class ClearPayload(msgspec.Struct, frozen=True, tag="clear"):
    pass


class PlaybackPayload(msgspec.Struct, frozen=True, tag="playback"):
    """The client played ``played_ms`` of a response's audio (and stopped there)."""

    response_id: str = ""
    played_ms: NonNegative = 0


class SettingsPayload(msgspec.Struct, frozen=True, tag="settings"):
    """The session settings stages act on, as a client's ``session.update`` left them.

    Stages take them in log order (the worker runtime keeps the current ones in
    ``StageContext.session`` and passes them down the chain); a field left at its
    default means "the stage's own option". ``schemas.session_shape.stage_settings``
    derives them from the client's session configuration."""

    instructions: str = ""
    """The system prompt a model stage uses instead of its configured one."""
    audio_output: bool = True
    """False: text-only output (``output_modalities: ["text"]``), nothing is spoken."""
    voice: str = ""
    server_vad: bool = True
    """False (``turn_detection: null``): only the client's commits end a turn."""
    vad_threshold: float | None = None
    vad_silence_ms: int | None = None
    vad_prefix_padding_ms: int | None = None
    interrupt_response: bool = True
    """Speech starting over a response barges in on it."""
    tools: str = ""
    """The function tools the model may call, as ``schemas.tools.tools_text`` writes
    them (empty: none)."""
    tool_choice: str = "auto"
    """``auto``, ``none``, ``required`` or ``function:<name>``."""
    greedy: bool = False
    """Model stages decode greedily (temperature 0) whatever their sampling options say,
    so the same inputs give the same answers: set by a greedy replay, never by a client."""
    max_output_tokens: int | None = None
    """The most tokens a model stage generates for one response (None: its own
    ``max_tokens``, which also caps this)."""
    speed: float = 1.0
    """How fast the TTS stage speaks: a multiple of its words per minute."""


class ConversationPayload(msgspec.Struct, frozen=True, tag="conversation"):
    """One edit of the conversation a model stage keeps (``EDIT_CONVERSATION``).

    ``add``: a message of ``role`` (``assistant``, ``system``, or ``tool``: the result
    of the function call ``call_id``) with ``text``, named ``item_id``; ``delete``: the
    item ``item_id`` leaves the conversation; ``truncate``: the assistant item
    ``item_id`` keeps only ``text``, what the user heard of it; ``next_response``: the
    tools of the response the next commit asks for, ``text`` holding
    ``{"tools": ..., "tool_choice": ...}`` (``schemas.tools``)."""

    op: str
    item_id: str
    role: str = ""
    text: str = ""
    call_id: str = ""
    """For a ``tool`` message (a function's result): the call it answers."""


Payload: TypeAlias = (
    TokensPayload
    | TextPayload
    | AudioPayload
    | VideoPayload
    | UnitPayload
    | CommitPayload
    | ClearPayload
    | PlaybackPayload
    | SettingsPayload
    | ConversationPayload
)

PAYLOAD_FOR_MODE: dict[InputMode, type[Payload]] = {
    InputMode.APPEND_TOKENS: TokensPayload,
    InputMode.APPEND_TEXT: TextPayload,
    InputMode.APPEND_AUDIO_CHUNK: AudioPayload,
    InputMode.APPEND_VIDEO_FRAME: VideoPayload,
    InputMode.APPEND_UNIT: UnitPayload,
    InputMode.TURN_COMMIT_ONLY: CommitPayload,
    InputMode.CLEAR_AUDIO: ClearPayload,
    InputMode.PLAYBACK_ACK: PlaybackPayload,
    InputMode.UPDATE_SESSION: SettingsPayload,
    InputMode.EDIT_CONVERSATION: ConversationPayload,
}


class InputEvent(msgspec.Struct, frozen=True, tag="in", tag_field="t"):
    """One accepted input, as recorded in the session log."""

    fence: Fence
    seq: Positive
    turn_seq: Positive
    mode: InputMode
    payload: Payload
    ts_ms: NonNegative = 0
    """Coordinator wall clock when accepted; replay at recorded pace uses it."""

    def __post_init__(self) -> None:
        expected = PAYLOAD_FOR_MODE[self.mode]
        if type(self.payload) is not expected:
            raise ValueError(
                f"mode {self.mode.value} carries a {expected.__name__}, "
                f"not a {type(self.payload).__name__}"
            )


class OutputKind(StrEnum):
    TEXT_DELTA = "text_delta"
    AUDIO_DELTA = "audio_delta"
    TRANSCRIPT = "transcript"
    LISTEN = "listen"
    SPEAK = "speak"
    SPEECH_STARTED = "speech_started"
    SPEECH_STOPPED = "speech_stopped"
    DONE = "done"
    FUNCTION_CALL = "function_call"
    """The model calls a function: ``text`` its arguments (JSON), ``meta["name"]`` the
    function, ``meta["call_id"]`` the call's id."""
    ERROR = "error"
    NOTICE = "notice"
    """A coordinator's own server event (``text`` names its type, ``meta`` its fields),
    journaled like outputs so a resumed client misses none."""
    SETTINGS = "settings"
    """The session's settings passed down the chain (``data``: an encoded
    ``SettingsPayload``): not for the client, not bound to a response."""
    CONVERSATION = "conversation"
    """A conversation edit passed down the chain (``data``: an encoded
    ``ConversationPayload``): not for the client, not bound to a response."""


class OutputEvent(msgspec.Struct, frozen=True, tag="out", tag_field="t", omit_defaults=True):
    """One output of a stage, stamped with the fence it was produced under (fields at
    their default are left off the wire)."""

    fence: Fence
    stage: str
    kind: OutputKind
    seq: Positive
    """Per (session, stage, incarnation) output counter; consumers dedupe on it."""
    source_seq: NonNegative = 0
    """Highest input ``seq`` the producer had applied when it produced this."""
    text: str = ""
    data: bytes = b""
    token_ids: tuple[NonNegative, ...] = ()
    meta: dict[str, MetaValue] = {}
    ts_ms: NonNegative = 0
    trace: TraceContext | None = None
    """The trace of the turn this output answers (only while tracing is on)."""


class ControlKind(StrEnum):
    OPEN = "open"
    CANCEL = "cancel"
    CLOSE = "close"
    FAILOVER = "failover"
    """A stage of the session moved to another worker; the incarnation grew."""


class ControlEvent(msgspec.Struct, frozen=True, tag="ctl", tag_field="t"):
    """Session lifecycle; ``fence`` is the session's fence once the control applies."""

    kind: ControlKind
    fence: Fence
    cancelled: Fence | None = None
    """For CANCEL: the fence whose work is released."""
    reason: str = ""
    ts_ms: NonNegative = 0


WireEvent: TypeAlias = InputEvent | OutputEvent | ControlEvent

_encoder = msgspec.msgpack.Encoder()
_any_decoder: msgspec.msgpack.Decoder[WireEvent] = msgspec.msgpack.Decoder(WireEvent)
_input_decoder = msgspec.msgpack.Decoder(InputEvent)
_output_decoder = msgspec.msgpack.Decoder(OutputEvent)
_control_decoder = msgspec.msgpack.Decoder(ControlEvent)


def encode_event(event: WireEvent) -> bytes:
    return _encoder.encode(event)


_T = TypeVar("_T")


def _decode(decoder: msgspec.msgpack.Decoder[_T], raw: bytes) -> _T:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireDecodeError(f"undecodable wire event: {exc}") from exc


def decode_event(raw: bytes) -> WireEvent:
    """Decode and validate any wire event; raises WireDecodeError on bad bytes."""
    return _decode(_any_decoder, raw)


def decode_input(raw: bytes) -> InputEvent:
    return _decode(_input_decoder, raw)


def decode_output(raw: bytes) -> OutputEvent:
    return _decode(_output_decoder, raw)


def decode_control(raw: bytes) -> ControlEvent:
    return _decode(_control_decoder, raw)


_session_decoder = msgspec.msgpack.Decoder(SettingsPayload | ConversationPayload)
SessionPayload: TypeAlias = SettingsPayload | ConversationPayload
"""What a session event carries: it belongs to the session, not to a response, and every
stage passes it down the chain (``workers.actor``)."""
_PASSED_DOWN = {
    InputMode.UPDATE_SESSION: OutputKind.SETTINGS,
    InputMode.EDIT_CONVERSATION: OutputKind.CONVERSATION,
}


def encode_session_payload(payload: SessionPayload) -> bytes:
    """A session payload as the ``data`` of the output that passes it on."""
    return _encoder.encode(payload)


def passed_down_kind(payload: SessionPayload) -> OutputKind:
    mode = (
        InputMode.UPDATE_SESSION
        if isinstance(payload, SettingsPayload)
        else InputMode.EDIT_CONVERSATION
    )
    return _PASSED_DOWN[mode]


def carries_settings(event: InputEvent | OutputEvent) -> bool:
    """Whether ``event`` is the session's settings (accepted, or passed on)."""
    if isinstance(event, InputEvent):
        return event.mode is InputMode.UPDATE_SESSION
    return event.kind is OutputKind.SETTINGS


def is_session_event(event: InputEvent | OutputEvent) -> bool:
    """Whether ``event`` is a session event: settings or a conversation edit, as accepted
    or as a stage passes it on."""
    if isinstance(event, InputEvent):
        return event.mode in _PASSED_DOWN
    return event.kind in _PASSED_DOWN.values()


def session_payload_of(event: InputEvent | OutputEvent) -> SessionPayload | None:
    """What a session event carries (None for any other event, and for a passed-on
    one whose data does not decode)."""
    if isinstance(event, InputEvent):
        payload = event.payload
        return payload if isinstance(payload, SettingsPayload | ConversationPayload) else None
    if not is_session_event(event):
        return None
    try:
        return _session_decoder.decode(event.data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
