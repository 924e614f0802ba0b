import msgspec
import pytest

from schemas.errors import WireDecodeError
from schemas.events import (
    AudioPayload,
    CommitPayload,
    ControlEvent,
    ControlKind,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    TextPayload,
    TokensPayload,
    UnitPayload,
    VideoPayload,
    decode_control,
    decode_event,
    decode_input,
    decode_output,
    encode_event,
)
from schemas.fence import Fence

F = Fence("sess", 1, 2, 3, 4)

EVENTS = [
    InputEvent(F, 1, 1, InputMode.APPEND_TEXT, TextPayload("hello"), ts_ms=5),
    InputEvent(F, 2, 1, InputMode.APPEND_TOKENS, TokensPayload((1, 2, 3))),
    InputEvent(F, 3, 2, InputMode.APPEND_AUDIO_CHUNK, AudioPayload(b"\x00" * 64)),
    InputEvent(F, 4, 3, InputMode.APPEND_VIDEO_FRAME, VideoPayload((b"jpg1", b"jpg2"))),
    InputEvent(
        F, 5, 4, InputMode.APPEND_UNIT, UnitPayload(AudioPayload(b"ab"), VideoPayload((b"x",)))
    ),
    InputEvent(F, 6, 5, InputMode.TURN_COMMIT_ONLY, CommitPayload()),
    OutputEvent(F, "thinker", OutputKind.TEXT_DELTA, 1, source_seq=3, text="hi"),
    OutputEvent(F, "tts", OutputKind.AUDIO_DELTA, 2, data=b"\x01\x02", meta={"rate": 24000}),
    ControlEvent(ControlKind.CANCEL, F.next_epoch(), cancelled=F, reason="barge_in"),
    ControlEvent(ControlKind.OPEN, F),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip(event):
    raw = encode_event(event)
    assert decode_event(raw) == event


def test_typed_decoders_refuse_other_event_types():
    raw_in = encode_event(EVENTS[0])
    assert decode_input(raw_in) == EVENTS[0]
    with pytest.raises(WireDecodeError):
        decode_output(raw_in)
    with pytest.raises(WireDecodeError):
        decode_control(raw_in)
    assert decode_output(encode_event(EVENTS[6])) == EVENTS[6]
    assert decode_control(encode_event(EVENTS[8])) == EVENTS[8]


def test_payload_must_match_mode():
    with pytest.raises(ValueError, match="carries a TokensPayload"):
        InputEvent(F, 1, 1, InputMode.APPEND_TOKENS, TextPayload("x"))
    forged = msgspec.msgpack.encode(
        {
            "t": "in",
            "fence": ["s", 0, 0, 0, 0],
            "seq": 1,
            "turn_seq": 1,
            "mode": "append_tokens",
            "payload": {"type": "text", "text": "x"},
        }
    )
    with pytest.raises(WireDecodeError, match="carries a TokensPayload"):
        decode_event(forged)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"t": "pickle", "data": "x"}),
        msgspec.msgpack.encode({"t": "in", "fence": ["s", 0, 0, 0, 0], "seq": 0}),
        msgspec.msgpack.encode(
            {
                "t": "in",
                "fence": ["", 0, 0, 0, 0],
                "seq": 1,
                "turn_seq": 1,
                "mode": "append_text",
                "payload": {"type": "text", "text": "x"},
            }
        ),
    ],
)
def test_untrusted_bytes_raise_wire_decode_error(raw):
    with pytest.raises(WireDecodeError) as info:
        decode_event(raw)
    assert info.value.code == "invalid_wire_event"
    assert isinstance(info.value, ValueError)


def test_audio_bytes_are_carried_raw_not_base64():
    data = bytes(range(256)) * 4
    raw = encode_event(InputEvent(F, 1, 1, InputMode.APPEND_AUDIO_CHUNK, AudioPayload(data)))
    assert data in raw
