"""The realtime protocol core: client events in, server events out (no I/O).

``parse_client_event`` validates one client message; ``audio_payload`` and
``image_payload`` decode what it carries. ``ServerEventTranslator`` turns the
session journal (stage outputs, coordinator notices, fence barriers) into
Realtime server events. It is deterministic: replaying the same journal
through a fresh translator gives the same events, which is what makes
``duplexq.session.resume`` exact.

Every server event carries, in its ``duplexq`` object (``EXTENSION``), ``seq``
(derived from the journal's per-session counter, see SEQ_STRIDE) and the
``fence`` a client needs (``epoch``, ``turn_id``, ``response_seq``,
``incarnation``); a client never sets a fence.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from PIL import Image, UnidentifiedImageError
from pydantic import ValidationError

from coordinator import g711
from coordinator.frames import ResponseFrame, Timeline, created
from coordinator.items import ConversationItems, announced
from coordinator.response_requests import REQUESTED, RequestedResponses
from coordinator.responses import Change, Created, Item, ResponseLife
from schemas.errors import ErrorCode, ProtocolError
from schemas.events import (
    AudioPayload,
    ControlEvent,
    ControlKind,
    OutputEvent,
    OutputKind,
    SettingsPayload,
    VideoPayload,
    session_payload_of,
)
from schemas.fence import Fence
from schemas.items import response_id, speech_item
from schemas.realtime import CLIENT_EVENT_TYPES, ClientEvent, SessionConfig, client_event_adapter

ServerEvent = dict[str, Any]

EXTENSION = "duplexq"
"""duplexq's namespace: its own events are named ``duplexq.*`` and its own fields on any
server event live in one ``duplexq`` object (``seq``, ``fence``, ``stage``), so no
standard name is ever used with another meaning (docs/realtime.md)."""

EXTENSION_EVENTS = frozenset({
    "duplexq.response.cancelled", "duplexq.response.listen", "duplexq.response.speak",
    "duplexq.session.resumed", "duplexq.session.closed", "duplexq.session.failover",
})  # fmt: skip
"""duplexq's own server events, beside the reference API's."""

TIMELINES_KEPT = 64
"""Responses whose spoken timeline a connection keeps for truncation."""

SEQ_STRIDE = 1024
"""A server event's ``duplexq.seq`` = journal seq * SEQ_STRIDE + the event's index among those
its journal entry produced: strictly increasing, not dense. Outputs, notices and fence
barriers each have a journal seq, so an event's seq depends only on its entry's place in
the journal, never on what a reader delivered before it (a barrier written before
barriers had one continues the numbering of the entry before it)."""

_AUDIO_FORMATS = {"pcm16": ("pcm_s16le", 2), "pcm_f32le": ("pcm_f32le", 4)}
_IMAGE_FORMATS = {"JPEG": "jpeg", "PNG": "png", "WEBP": "webp"}


def parse_client_event(raw: str | bytes, max_bytes: int) -> ClientEvent:
    """Validate one client message or raise ProtocolError with a stable code."""
    if len(raw) > max_bytes:
        raise ProtocolError(ErrorCode.EVENT_TOO_LARGE, f"event exceeds {max_bytes} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorCode.INVALID_JSON, f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.INVALID_JSON, "an event must be a JSON object")
    kind = data.get("type")
    if kind not in CLIENT_EVENT_TYPES:
        raise ProtocolError(ErrorCode.UNKNOWN_EVENT, f"unknown event type {kind!r}")
    try:
        return client_event_adapter.validate_python(data)
    except ValidationError as exc:
        # The first location part is the event's tag (its type): not a field to name.
        raise invalid_event(kind, exc, skip=1, whole="event") from exc


def invalid_event(kind: str, exc: ValidationError, *, skip: int, whole: str) -> ProtocolError:
    """``invalid_event`` naming the first field pydantic refused (its location after
    ``skip`` parts; ``whole`` when that leaves none) and why."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"][skip:])
    return ProtocolError(ErrorCode.INVALID_EVENT, f"{kind}: {where or whole}: {first['msg']}")


def _b64(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(ErrorCode.INVALID_BASE64, "payload is not valid base64") from exc


def audio_payload(data: str, config: SessionConfig) -> AudioPayload:
    """Decode base64 audio in the session's input format (G.711 expanded to PCM16)."""
    raw = _b64(data)
    if config.input_audio_format in g711.FORMATS:
        if not raw:
            raise ProtocolError(ErrorCode.INVALID_AUDIO, "audio is empty")
        return AudioPayload(g711.to_pcm16(raw, config.input_audio_format), "pcm_s16le", g711.RATE)
    fmt, width = _AUDIO_FORMATS[config.input_audio_format]
    if not raw or len(raw) % width:
        raise ProtocolError(
            ErrorCode.INVALID_AUDIO,
            f"{config.input_audio_format} audio needs a whole number of {width}-byte samples",
        )
    return AudioPayload(raw, fmt, config.input_audio_sample_rate)


def image_payload(data: str, pts_ms: int) -> VideoPayload:
    """Decode one base64 image; only formats a model stage can read are accepted.

    Blocking (base64 and PIL's verification take milliseconds for a large image): a
    caller on an event loop runs it in a thread."""
    raw = _b64(data)
    try:
        with Image.open(io.BytesIO(raw)) as image:
            image.verify()
            codec = _IMAGE_FORMATS.get(image.format or "")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ProtocolError(ErrorCode.INVALID_IMAGE, "image does not decode") from exc
    if codec is None:
        raise ProtocolError(ErrorCode.INVALID_IMAGE, "image must be JPEG, PNG or WebP")
    return VideoPayload((raw,), codec, pts_ms)


def error_event(
    code: str, message: str, event_id: str | None = None, param: str | None = None
) -> ServerEvent:
    """An ``error``; ``param`` names the field at fault (a refused session field)."""
    error: dict[str, Any] = {"type": "invalid_request_error", "code": code, "message": message}
    if event_id:
        error["event_id"] = event_id
    if param:
        error["param"] = param
    return {"type": "error", "error": error}


class ServerEventTranslator:
    """Journal items of one session -> Realtime server events.

    When responses begin and end is ``coordinator.responses.ResponseLife``'s call
    (its table is the rule); this class frames each piece: deltas, the parts a
    response carried and their ``done`` events, notices, speech events, errors.
    ``terminal_stages`` are the client-facing stages whose ``done`` ends a response
    (the last stage of each chain); other stages' ``done`` ends their own part
    (text, transcript) or marks the user's turn end (server VAD).
    """

    def __init__(self, terminal_stages: Sequence[str]) -> None:
        self.terminal = frozenset(terminal_stages)
        self.life = ResponseLife()
        self._frame_of: ResponseFrame | None = None
        """The streaming response's item and parts."""
        self.calls: dict[str, int] = {}
        """Function calls delivered (``call_id`` -> the epoch of their response)."""
        self.epoch = 0
        """The highest epoch of the journal items translated so far."""
        self._timelines: OrderedDict[str, Timeline] = OrderedDict()
        """The spoken timelines of the latest responses, by item id (``timeline``)."""
        self._journal_seq = 0
        self._index = 0
        self.spoken = True
        """Whether the session's output is audio where no settings in the journal said
        (a resumed connection sets it from the stored configuration)."""
        self._spoken_by: dict[str, bool] = {}
        """Each stage's ``audio_output`` as the settings it passed on said."""
        self.requested = RequestedResponses()
        """What the client asked of each response (``coordinator.response_requests``)."""
        self.items = ConversationItems()
        """The conversation's items as the journal told them (``coordinator.items``)."""

    @property
    def active(self) -> str | None:
        """The id of the response being streamed, if any."""
        return self.life.active

    def timeline(self, item_id: str) -> Timeline | None:
        """What was spoken of a response's item, and when: the streaming response's, or
        one of the ``TIMELINES_KEPT`` latest (None: unknown to this connection)."""
        frame = self._frame_of
        if frame is not None and frame.item_id == item_id:
            return frame.timeline
        return self._timelines.get(item_id)

    def translate(self, item: OutputEvent | ControlEvent, journal_seq: int) -> list[ServerEvent]:
        """Server events for one journal item (``journal_seq`` 0: a barrier written before
        barriers had a journal seq)."""
        self.epoch = max(self.epoch, item.fence.epoch)
        events = self._control(item) if isinstance(item, ControlEvent) else self._output(item)
        events = announced(self.requested.frame(events))
        if journal_seq:
            self._journal_seq, self._index = journal_seq, 0
        for event in events:
            seq = self._journal_seq * SEQ_STRIDE + self._index
            event["event_id"] = f"event_{seq}"  # unique in the session, the same on a resume
            own = event.setdefault(EXTENSION, {})
            own["seq"] = seq
            own.setdefault("fence", _fence_fields(item.fence))
            self._index += 1
            self.items.observe(event)
        return events

    def _control(self, control: ControlEvent) -> list[ServerEvent]:
        if control.kind is ControlKind.CANCEL:
            ended = self._frame(self.life.step(Item.CANCEL, reason=control.reason))
            return [*ended, {"type": "duplexq.response.cancelled", "reason": control.reason}]
        if control.kind is ControlKind.CLOSE:
            closed = {"type": "duplexq.session.closed"}
            return [*self._frame(self.life.step(Item.CLOSE)), closed]
        if control.kind is ControlKind.FAILOVER:
            return [{"type": "duplexq.session.failover", "stage": control.reason}]
        return []

    def _frame(
        self, changes: list[Change], error: dict[str, Any] | None = None
    ) -> list[ServerEvent]:
        """``response.created`` / the item's and parts' done events and ``response.done``
        for what the response life decided."""
        events: list[ServerEvent] = []
        for change in changes:
            if isinstance(change, Created):
                self._frame_of = ResponseFrame(change.response_id)
                events.append(created(change.response_id))
                continue
            frame = self._frame_of
            if frame is None or frame.response_id != change.response_id:
                frame = ResponseFrame(change.response_id)
            events += frame.end(change.status, change.reason, error)
            self._timelines[frame.item_id] = frame.timeline
            while len(self._timelines) > TIMELINES_KEPT:
                self._timelines.popitem(last=False)
            self._frame_of = None
        return events

    def _output(self, out: OutputEvent) -> list[ServerEvent]:
        kind = out.kind
        if kind is OutputKind.SETTINGS:
            settings = session_payload_of(out)
            if isinstance(settings, SettingsPayload):
                self._spoken_by[out.stage] = settings.audio_output
            return []  # passed down the chain for the stages, not for the client
        if kind is OutputKind.CONVERSATION:
            return []
        if kind is OutputKind.NOTICE:
            notice: ServerEvent = json.loads(out.text)
            if notice.get("type") == REQUESTED:  # a response.create taken: created now
                asked = self.life.step(Item.REQUEST, str(notice.get("response_id")))
                return [notice, *self._frame(asked)]
            return [notice]
        if kind is OutputKind.SPEECH_STARTED:
            return [{"type": "input_audio_buffer.speech_started",
                     "audio_start_ms": _ms(out, "audio_start_ms"),
                     "item_id": speech_item(out), EXTENSION: {"stage": out.stage}}]  # fmt: skip
        if kind is OutputKind.SPEECH_STOPPED:
            stopped = {
                "type": "input_audio_buffer.speech_stopped",
                "audio_end_ms": _ms(out, "audio_end_ms"),
                "item_id": speech_item(out),
                EXTENSION: {"stage": out.stage},
            }
            if out.meta.get("reason") == "cleared":
                return [stopped]
            # The end of an utterance ends the user's turn: announced here, before its
            # transcript, as the reference API does (the turn's done then says nothing).
            return [stopped, {"type": "input_audio_buffer.committed",
                              "item_id": stopped["item_id"],
                              EXTENSION: {"stage": out.stage}},
                    *spoken_item(speech_item(out))]  # fmt: skip
        if kind is OutputKind.ERROR:
            code = str(out.meta.get("code", ErrorCode.STAGE_ERROR.value))
            error = error_event(code, out.text)
            failed = self.life.step(Item.FAILURE, response_id(out.fence), reason=code)
            return [error, *self._frame(failed, error=error["error"])]
        if kind is OutputKind.TRANSCRIPT and out.meta.get("typed"):
            return []  # typed, not heard: its conversation.item.created said it already
        if kind is OutputKind.TRANSCRIPT and out.meta.get("role") != "assistant":
            usage = {"type": "duration", "seconds": _number(out, "audio_seconds")}
            return [{"type": "conversation.item.input_audio_transcription.completed",
                     "item_id": speech_item(out), "content_index": 0, "transcript": out.text,
                     "usage": usage}]  # fmt: skip
        if kind is OutputKind.DONE:
            return self._done(out)
        return self._delta(out)

    def _delta(self, out: OutputEvent) -> list[ServerEvent]:
        events = self._frame(self.life.step(Item.OUTPUT, response_id(out.fence)))
        frame = self._frame_of
        assert frame is not None  # the response life has just made this response active
        if out.kind is OutputKind.AUDIO_DELTA:
            return events + frame.audio(base64.b64encode(out.data).decode("ascii"), _ms_of(out))
        if out.kind is OutputKind.TRANSCRIPT:
            return events + frame.transcript(out.text)
        if out.kind is OutputKind.FUNCTION_CALL:
            call_id = str(out.meta.get("call_id", f"call_{out.stage}_{out.seq}"))
            self.calls[call_id] = out.fence.epoch
            return events + frame.function_call(call_id, str(out.meta.get("name", "")), out.text)
        if out.kind in (OutputKind.LISTEN, OutputKind.SPEAK):
            return [*events, {"type": f"duplexq.response.{out.kind.value}",
                              "response_id": frame.response_id}]  # fmt: skip
        if self._voiced(out):
            return events  # spoken downstream: its transcript and audio are the output
        return events + frame.text(out.text)

    def _voiced(self, text: OutputEvent) -> bool:
        """Whether a stage's text is spoken by a client-facing stage downstream of it (a
        thinker's, with the TTS stage after it) while the output is audio: an audio
        response streams the transcript of what was said, not the text beside it."""
        return text.stage not in self.terminal and self._spoken_by.get(text.stage, self.spoken)

    def _done(self, out: OutputEvent) -> list[ServerEvent]:
        if out.stage not in self.terminal:
            # A turn the client's commit ended was announced when it was accepted, one
            # the voice activity stage ended when its speech stopped.
            announced = "commit_seq" in out.meta or "segment" in out.meta
            if out.meta.get("turn_end") and not announced:
                item_id = speech_item(out)
                return [{"type": "input_audio_buffer.committed", "item_id": item_id,
                         EXTENSION: {"stage": out.stage}}, *spoken_item(item_id)]  # fmt: skip
            return []
        return self._frame(self.life.step(Item.FINAL_DONE, response_id(out.fence)))


def spoken_item(item_id: str) -> list[ServerEvent]:
    """The user's spoken item joining the conversation when its turn is committed, as the
    reference API announces it: added, then done, its transcript still unknown (it comes
    in ``conversation.item.input_audio_transcription.completed``). Clients that keep the
    conversation (LiveKit's chat context) learn of the item here."""
    item = {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_audio", "transcript": None}],
    }
    return [
        {"type": "conversation.item.added", "item": item},
        {"type": "conversation.item.done", "item": item},
    ]


def _ms_of(audio: OutputEvent) -> float:
    """How long an audio delta plays (16-bit PCM unless its meta says 32-bit float)."""
    width = 4 if audio.meta.get("format") == "pcm_f32le" else 2
    rate = _number(audio, "sample_rate") or 24_000
    return len(audio.data) / width / rate * 1000


def _number(out: OutputEvent, name: str) -> float:
    value = out.meta.get(name, 0)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _ms(out: OutputEvent, name: str) -> int:
    return int(_number(out, name))


def _fence_fields(fence: Fence) -> dict[str, int]:
    return {
        "incarnation": fence.incarnation,
        "epoch": fence.epoch,
        "turn_id": fence.turn_id,
        "response_seq": fence.response_seq,
    }


def server_seq(event: ServerEvent) -> int:
    """A server event's place in its session (``duplexq.seq``; 0 for one sent before any)."""
    own = event.get(EXTENSION)
    return int(own.get("seq", 0)) if isinstance(own, dict) else 0
