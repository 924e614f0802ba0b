"""Every session field takes effect or is refused by name, and a refused one never
discards the rest of the update: the rules without I/O (``schemas.session_fields``),
the stage sides (the thinker's token budget, the TTS stage's speed on espeak-ng), then
a client on real uvicorn and Redis."""

import numpy as np
import pytest

from dataplane.bus import RedisBus
from schemas.config import echo_pipeline
from schemas.errors import ErrorCode
from schemas.events import InputMode, OutputKind, SettingsPayload, decode_input
from schemas.fence import Fence
from schemas.keys import Keys
from schemas.realtime import SessionConfig
from schemas.session_fields import judged
from schemas.session_shape import merged, session_object, stage_settings
from tests.pipeline_helpers import fast_settings
from tests.realtime_helpers import Client, serving
from workers.backends.audio import decode_pcm
from workers.backends.base import StageContext
from workers.backends.tts import TtsBackend, words_per_minute
from workers.backends.vllm_engine import response_max_tokens
from workers.backends.vllm_options import VllmOptions

UNSUPPORTED = ErrorCode.UNSUPPORTED_FIELD
INVALID = ErrorCode.INVALID_EVENT


def _refused(update):
    config, refusals = judged(SessionConfig(), update)
    return config, {(r.param, r.code) for r in refusals}


# -- the rules, no I/O -------------------------------------------------------------------


def test_a_refused_field_leaves_the_rest_of_the_update_to_apply():
    config, refused = _refused({
        "type": "realtime", "instructions": "Be brief.", "tracing": "auto",
        "max_output_tokens": 32, "truncation": {"type": "retention_ratio"},
        "include": ["item.input_audio_transcription.logprobs"], "prompt": {"id": "pmpt_1"},
        "no_such_field": 1,
        "audio": {"input": {"noise_reduction": {"type": "near_field"}},
                  "output": {"format": {"type": "audio/pcmu"}, "voice": "marin"}},
    })  # fmt: skip
    assert refused == {
        ("session.tracing", UNSUPPORTED), ("session.truncation", UNSUPPORTED),
        ("session.include", UNSUPPORTED), ("session.prompt", UNSUPPORTED),
        ("session.no_such_field", UNSUPPORTED),
        ("session.audio.input.noise_reduction", UNSUPPORTED),
        ("session.audio.output.format", UNSUPPORTED),
    }  # fmt: skip
    assert (config.instructions, config.max_output_tokens, config.voice) == (
        "Be brief.", 32, "marin")  # fmt: skip


def test_the_null_and_default_forms_of_what_duplexq_does_not_do_are_taken():
    config, refused = _refused({
        "type": "realtime", "tracing": None, "truncation": "auto", "include": [],
        "prompt": None, "model": "gpt-realtime",
        "audio": {"input": {"noise_reduction": None, "transcription": None},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}}},
    })  # fmt: skip
    assert refused == set() and config == SessionConfig()
    _, refused = _refused({"type": "realtime", "audio": {"input": {
        "transcription": {"model": "whisper-1", "language": "fr"}}}})  # fmt: skip
    assert refused == {("session.audio.input.transcription.language", UNSUPPORTED)}
    _, refused = _refused({"type": "realtime", "audio": {"input": {
        "transcription": {"model": "gpt-4o-mini-transcribe"}}}})  # fmt: skip
    assert refused == set()


@pytest.mark.parametrize(
    ("value", "taken"),
    [(1, 1), (4096, 4096), ("inf", None), (0, "no"), (4097, "no"), ("12", "no"),
     (True, "no"), (1.5, "no"), (None, "no")],
)  # fmt: skip
def test_max_output_tokens_is_an_integer_up_to_4096_or_inf(value, taken):
    config, _ = _refused({"type": "realtime", "max_output_tokens": 7})
    config, refusals = judged(config, {"type": "realtime", "max_output_tokens": value})
    if taken == "no":
        assert [(r.param, r.code) for r in refusals] == [("session.max_output_tokens", INVALID)]
        assert config.max_output_tokens == 7  # unchanged
    else:
        assert refusals == [] and config.max_output_tokens == taken
        assert stage_settings(config).max_output_tokens == taken
        assert session_object("s", config)["max_output_tokens"] == (taken or "inf")
    # The beta's name for it.
    beta, _ = judged(SessionConfig(), {"max_response_output_tokens": 5})
    assert beta.max_output_tokens == 5


def test_ga_takes_one_output_modality_the_beta_its_pair():
    config, refused = _refused({"type": "realtime", "output_modalities": ["text", "audio"]})
    assert refused == {("session.output_modalities", UNSUPPORTED)} and config.modalities is None
    config, refused = _refused({"type": "realtime", "output_modalities": ["text"]})
    assert refused == set() and not stage_settings(config).audio_output
    config, refused = _refused({"modalities": ["text", "audio"]})
    assert refused == set() and stage_settings(config).audio_output


@pytest.mark.parametrize(
    ("eagerness", "silence_ms"), [("high", 300), ("medium", 700), ("auto", 700), ("low", 1500),
                                  (None, 700)],
)  # fmt: skip
def test_semantic_vad_is_served_with_its_eagerness_as_a_silence(eagerness, silence_ms):
    detection = {"type": "semantic_vad", "create_response": True, "interrupt_response": True}
    if eagerness:
        detection["eagerness"] = eagerness
    update = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
    config, refused = _refused(update)
    assert refused == set()
    settings = stage_settings(config)
    assert settings.server_vad and settings.vad_silence_ms == silence_ms
    shown = session_object("s", config)["audio"]["input"]["turn_detection"]
    assert shown["type"] == "semantic_vad" and shown.get("eagerness") == eagerness


def test_turn_detection_settings_duplexq_lacks_are_refused_by_name():
    for detection, param, code in [
        ({"type": "semantic_vad", "create_response": False}, "create_response", UNSUPPORTED),
        ({"type": "server_vad", "idle_timeout_ms": 5000}, "idle_timeout_ms", UNSUPPORTED),
        ({"type": "server_vad", "loudness": 3}, "loudness", UNSUPPORTED),
        ({"type": "semantic_vad", "silence_duration_ms": 500}, "", INVALID),
        ({"type": "server_vad", "eagerness": "low"}, "", INVALID),
        ({"type": "near_vad"}, "type", INVALID),
    ]:
        update = {"type": "realtime", "instructions": "x",
                  "audio": {"input": {"turn_detection": detection}}}  # fmt: skip
        config, refused = _refused(update)
        where = "session.audio.input.turn_detection" + (f".{param}" if param else "")
        assert refused == {(where, code)}, detection
        assert (
            config.instructions == "x" and config.turn_detection == SessionConfig().turn_detection
        )


def test_speed_is_taken_from_a_quarter_to_one_and_a_half():
    config, refused = _refused({"type": "realtime", "audio": {"output": {"speed": 1.25}}})
    assert refused == set() and stage_settings(config).speed == 1.25
    assert session_object("s", config)["audio"]["output"]["speed"] == 1.25
    for bad in (0.2, 1.6, "fast"):
        _, refused = _refused({"type": "realtime", "audio": {"output": {"speed": bad}}})
        assert refused == {("session.audio.output.speed", INVALID)}
    assert words_per_minute(175, 1.0) == 175 and words_per_minute(175, 1.5) == 262
    assert words_per_minute(175, 0.25) == 80  # espeak-ng's slowest


def test_merged_raises_on_a_bad_value_and_leaves_out_what_duplexq_does_not_do():
    assert merged(SessionConfig(), {"tracing": "auto", "instructions": "y"}).instructions == "y"
    with pytest.raises(ValueError, match=r"session\.audio"):
        merged(SessionConfig(), {"type": "realtime", "audio": "loud"})


def test_the_thinker_generates_at_most_the_sessions_max_output_tokens():
    options = VllmOptions(model="m", max_tokens=96)
    assert response_max_tokens(options, SettingsPayload()) == 96
    assert response_max_tokens(options, SettingsPayload(max_output_tokens=12)) == 12
    assert response_max_tokens(options, SettingsPayload(max_output_tokens=4096)) == 96


# -- the TTS stage's speed, on espeak-ng -------------------------------------------------


async def test_the_tts_stage_speaks_faster_at_a_higher_speed():
    from schemas.events import OutputEvent

    async def spoken_samples(speed: float) -> int:
        backend = TtsBackend({"chunk_ms": 100})
        ctx = StageContext("s1", "tts", Fence("s1"), {})
        ctx.session = SettingsPayload(speed=speed)
        await backend.start(ctx, [], [])
        text = OutputEvent(Fence("s1"), "thinker", OutputKind.TEXT_DELTA, 1,
                           text="Speaking at a chosen speed is a session setting.")  # fmt: skip
        done = OutputEvent(Fence("s1"), "thinker", OutputKind.DONE, 2)
        drafts = [d for e in (text, done) async for d in backend.handle(ctx, e)]
        audio = [d.data for d in drafts if d.kind is OutputKind.AUDIO_DELTA]
        return len(decode_pcm(b"".join(audio), "pcm_s16le"))

    slow, normal, fast = [await spoken_samples(s) for s in (0.5, 1.0, 1.5)]
    assert slow > 1.3 * normal and fast < 0.8 * normal
    assert np.isfinite([slow, normal, fast]).all()


# -- a client ------------------------------------------------------------------------------


async def test_a_client_update_applies_what_it_can_and_names_each_refusal(redis_server, key_prefix):
    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)
    async with serving(settings, echo_pipeline("echo")) as base, Client.connect(base) as client:
        sid = (await client.recv())["session"]["id"]
        await client.send({"type": "session.update", "event_id": "evt_u", "session": {
            "type": "realtime", "max_output_tokens": 32, "tracing": "auto",
            "output_modalities": ["text", "audio"],
            "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"},
                                "transcription": None},
                      "output": {"format": {"type": "audio/pcmu"}, "speed": 1.25}}}})  # fmt: skip
        got = await client.until("session.updated")
    errors = {e["error"]["param"]: e["error"] for e in got if e["type"] == "error"}
    assert set(errors) == {
        "session.tracing",
        "session.output_modalities",
        "session.audio.output.format",
    }
    assert {e["code"] for e in errors.values()} == {"unsupported_field"}
    assert {e["type"] for e in errors.values()} == {"invalid_request_error"}
    assert {e["event_id"] for e in errors.values()} == {"evt_u"}
    session = got[-1]["session"]
    assert session["max_output_tokens"] == 32 and session["audio"]["output"]["speed"] == 1.25
    assert session["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert session["output_modalities"] == ["audio"]
    # What the stages act on went down the session log.
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    try:
        entries = await bus.xrange(bus.keys.session(sid).input)
    finally:
        await bus.aclose()
    log = [decode_input(e.event) for e in entries]
    assert [e.mode for e in log] == [InputMode.UPDATE_SESSION]
    payload = log[0].payload
    assert (payload.max_output_tokens, payload.speed, payload.vad_silence_ms) == (32, 1.25, 300)


# -- what an audio response streams, no I/O ------------------------------------------------


def test_an_audio_response_streams_the_transcript_and_a_text_one_the_text():
    from coordinator.realtime import ServerEventTranslator
    from schemas.events import OutputEvent, encode_session_payload

    translator = ServerEventTranslator(["tts"])  # thinker -> tts -> client
    seq = iter(range(1, 100))

    def types(stage, kind, response, text="", data=b""):
        fence = Fence("s1", 0, 0, 0, response)
        meta = {"role": "assistant"} if kind is OutputKind.TRANSCRIPT else {}
        out = OutputEvent(fence, stage, kind, next(seq), text=text, data=data, meta=meta)
        return [e["type"] for e in translator.translate(out, next(seq))]

    def settings(stage, audio):
        data = encode_session_payload(SettingsPayload(audio_output=audio))
        return types(stage, OutputKind.SETTINGS, 0, data=data)

    # Audio (the default): the thinker's text is spoken downstream; its transcript streams.
    spoken = types("thinker", OutputKind.TEXT_DELTA, 1, "Hi there.")
    spoken += types("tts", OutputKind.TRANSCRIPT, 1, "Hi there.")
    spoken += types("tts", OutputKind.AUDIO_DELTA, 1, data=b"\0\0" * 240)
    spoken += types("thinker", OutputKind.DONE, 1) + types("tts", OutputKind.DONE, 1)
    assert spoken[0] == "response.created"
    assert not [t for t in spoken if t.startswith("response.output_text")]
    assert "response.output_audio_transcript.delta" in spoken and "response.done" in spoken
    # Text: the settings the stages passed on say so; the thinker's text streams.
    assert settings("thinker", False) == settings("tts", False) == []
    written = types("thinker", OutputKind.TEXT_DELTA, 2, "Hi again.")
    written += types("thinker", OutputKind.DONE, 2) + types("tts", OutputKind.DONE, 2)
    assert "response.output_text.delta" in written and "response.output_text.done" in written
    assert not [t for t in written if t.startswith("response.output_audio")]
