"""The client protocol: OpenAI Realtime events where they apply, duplex events where not.

Client events are validated fully here, at the edge: a JSON object with a
``type`` and the fields that type allows. Each field of a session
configuration takes effect or is refused by name, the rest of the update still
applying (``schemas.session_fields``); unknown *event types* are refused with
``unknown_event``.

Client events (duplexq's own are named ``duplexq.*``):

==================================  ==========================================
type                                effect
==================================  ==========================================
session.update                      change the session (GA or beta shape, merged)
input_audio_buffer.append           base64 audio (pcm16 24 kHz by default; G.711)
input_audio_buffer.commit           end of the user's turn
input_audio_buffer.clear            drop audio since the last commit
conversation.item.create            a user, assistant or system text message
conversation.item.delete            remove an item from the model's conversation
conversation.item.truncate          keep only what the user heard of an answer
conversation.item.retrieve          the server's view of one item (``.retrieved``)
response.create                     ask for a response now
response.cancel                     cancel the response in progress (an error if none)
output_audio_buffer.clear           cut the response's audio off (a cancel)
duplexq.input_video.append          a base64 image (JPEG/PNG/WebP)
duplexq.barge_in                    the user interrupts (cancels, never refused)
duplexq.playback.ack                how far the client played a response
duplexq.session.resume              reattach with a resume token (the first event)
==================================  ==========================================
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from schemas.tools import FunctionTool, ToolChoice

_MAX_TEXT = 32_768
_MAX_B64 = 16 * 1024 * 1024


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: str | None = Field(None, max_length=128)


class TurnDetection(BaseModel):
    """Server VAD settings; ``None`` in the session turns server VAD off. A field left
    out keeps the VAD stage's own option (``workers.backends.vad.VadOptions``).
    ``semantic_vad`` is served by the same VAD stage, its ``eagerness`` read as the
    silence that ends a turn (``schemas.session_fields.EAGERNESS_SILENCE_MS``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float | None = Field(None, ge=0.0, le=1.0)
    """Speech probability that counts as speech (the VAD uses 0.2..0.95 of it)."""
    prefix_padding_ms: int | None = Field(None, ge=0, le=2000)
    silence_duration_ms: int | None = Field(None, ge=100, le=5000)
    eagerness: Literal["low", "medium", "high", "auto"] | None = None
    """``semantic_vad`` only: how soon a pause ends the turn."""
    interrupt_response: bool = True

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        semantic = self.type == "semantic_vad"
        if semantic and self.silence_duration_ms is not None:
            raise ValueError("semantic_vad takes eagerness, not silence_duration_ms")
        if not semantic and self.eagerness is not None:
            raise ValueError("eagerness is semantic_vad's; server_vad takes silence_duration_ms")
        return self


class SessionConfig(BaseModel):
    """What a client may configure (``schemas.session_fields`` judges each field a
    ``session.update`` names: it takes effect here or is refused by name)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    instructions: str | None = Field(None, max_length=_MAX_TEXT)
    modalities: tuple[Literal["text", "audio"], ...] | None = None
    input_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw", "pcm_f32le"] = "pcm16"
    """The reference API's formats (G.711 is 8 kHz whatever the rate says) and
    duplexq's own 32-bit float PCM."""
    input_audio_sample_rate: int = Field(24_000, ge=8_000, le=48_000)
    output_audio_format: Literal["pcm16"] = "pcm16"
    max_output_tokens: int | None = Field(None, ge=1, le=4096)
    """The most tokens the model stage generates for one response (None: its own
    ``max_tokens``, which also caps this)."""
    speed: float = Field(1.0, ge=0.25, le=1.5)
    """How fast the TTS stage speaks, a multiple of its words per minute."""
    voice: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_+-]{0,39}$")
    """A reference voice name (``alloy``, ``marin``, ...) or a voice of the TTS stage
    (espeak-ng's ``en-us``, ``en+f3``, ...): ``workers.backends.tts.VOICES``."""
    turn_detection: TurnDetection | None = TurnDetection()
    tools: tuple[FunctionTool, ...] = Field((), max_length=64)
    tool_choice: ToolChoice = "auto"
    greedy: bool = False
    """duplexq's own: model stages decode greedily (``SettingsPayload.greedy``). Only a
    greedy replay sets it (it is stored for the stages' new owners); a client's
    ``session.update`` cannot (``schemas.session_shape`` takes only the API's fields)."""


class SessionUpdate(_Event):
    """The fields to change, in the GA or the beta shape (``schemas.session_shape``)."""

    type: Literal["session.update"]
    session: dict[str, Any] = Field(default_factory=dict)


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str = Field(max_length=_MAX_B64)


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class VideoAppend(_Event):
    type: Literal["duplexq.input_video.append"]
    image: str = Field(max_length=_MAX_B64)
    pts_ms: int = Field(0, ge=0)


ITEM_ID = r"^[A-Za-z0-9_.:-]{1,64}$"
"""What an item id a client names may look like."""


class TextContent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["input_text", "text", "output_text"]
    text: str = Field(max_length=_MAX_TEXT)


class MessageItem(BaseModel):
    """A text message for the conversation: the user's (a turn the model may answer),
    or an assistant or system message the model takes as context."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str | None = Field(None, pattern=ITEM_ID)
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system"] = "user"
    content: tuple[TextContent, ...] = Field(min_length=1, max_length=64)


class FunctionCallOutputItem(BaseModel):
    """The client's result of a function call the model made (``call_id``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str | None = Field(None, pattern=ITEM_ID)
    type: Literal["function_call_output"]
    call_id: str = Field(pattern=ITEM_ID)
    output: str = Field(max_length=_MAX_TEXT)


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: FunctionCallOutputItem | MessageItem
    previous_item_id: str | None = None


class ItemDelete(_Event):
    """Remove an item from the model's conversation."""

    type: Literal["conversation.item.delete"]
    item_id: str = Field(pattern=ITEM_ID)


class ItemRetrieve(_Event):
    """Ask for one item of the conversation (answered ``conversation.item.retrieved``)."""

    type: Literal["conversation.item.retrieve"]
    item_id: str = Field(pattern=ITEM_ID)


class ItemTruncate(_Event):
    """Cut an assistant item's audio at ``audio_end_ms``: the model's conversation keeps
    only what the user heard of it."""

    type: Literal["conversation.item.truncate"]
    item_id: str = Field(pattern=ITEM_ID)
    content_index: int = Field(0, ge=0)
    audio_end_ms: int = Field(ge=0)


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: dict[str, Any] | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


class BargeIn(_Event):
    type: Literal["duplexq.barge_in"]


class OutputAudioClear(_Event):
    """Cut off the response's audio: the response is cancelled, as a barge-in."""

    type: Literal["output_audio_buffer.clear"]


class PlaybackAck(_Event):
    type: Literal["duplexq.playback.ack"]
    response_id: str = Field("", max_length=128)
    played_ms: int = Field(ge=0)


class SessionResume(_Event):
    type: Literal["duplexq.session.resume"]
    resume_token: str = Field(min_length=16, max_length=256)
    last_received_seq: int = Field(0, ge=0)
    """The ``duplexq.seq`` of the last server event the client received."""


ClientEvent = Annotated[
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | VideoAppend
    | ItemCreate
    | ItemDelete
    | ItemTruncate
    | ItemRetrieve
    | ResponseCreate
    | ResponseCancel
    | BargeIn
    | OutputAudioClear
    | PlaybackAck
    | SessionResume,
    Field(discriminator="type"),
]

CLIENT_EVENT_TYPES = frozenset(
    (
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "duplexq.input_video.append",
        "conversation.item.create",
        "conversation.item.delete",
        "conversation.item.truncate",
        "conversation.item.retrieve",
        "response.create",
        "response.cancel",
        "duplexq.barge_in",
        "output_audio_buffer.clear",
        "duplexq.playback.ack",
        "duplexq.session.resume",
    )
)

client_event_adapter: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
