"""The speech stages (vad, asr, tts) on real speech that espeak-ng makes on the spot.

Tiers: the pure cores (PCM codecs, resampler, detector, sentence splitter,
pacer) with no model; each backend driven directly on real audio with its
real model; then the pipeline vad -> asr -> thinker (echo) -> tts through
in-process workers on a real redis-server, including a barge-in by voice.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time

import numpy as np
import pytest

from coordinator.service import Coordinator
from schemas.config import PipelineConfig, StageConfig
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
)
from schemas.fence import Fence
from tests.pipeline_helpers import fast_settings, running_worker
from tests.speech import chunks, silence, speak
from workers.backends.asr import AsrBackend
from workers.backends.audio import (
    AudioError,
    StreamResampler,
    WavStream,
    decode_pcm,
    encode_pcm,
    resample,
)
from workers.backends.base import OutputDraft, StageContext
from workers.backends.echo import EchoBackend
from workers.backends.tts import Pacer, TtsBackend, split_ready
from workers.backends.vad import SpeechDetector, Transition, VadBackend

SID = "s1"


def words(text: str) -> list[str]:
    """Lower-case words without punctuation, to compare transcripts."""
    return re.findall(r"[a-z0-9']+", text.lower())


# -- pure cores ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pcm_f32le", "pcm_s16le"])
def test_pcm_round_trip(fmt):
    samples = np.array([0.0, 0.5, -0.5, 0.999, -1.0], dtype=np.float32)
    back = decode_pcm(encode_pcm(samples, fmt), fmt)
    assert np.allclose(back, samples, atol=1e-4)


@pytest.mark.parametrize(
    ("data", "fmt", "message"),
    [
        (b"\x00" * 4, "pcm_mulaw", "unsupported"),
        (b"\x00" * 3, "pcm_s16le", "whole"),
        (b"\x00" * 6, "pcm_f32le", "whole"),
        (np.array([np.nan], dtype="<f4").tobytes(), "pcm_f32le", "NaN"),
    ],
)
def test_bad_pcm_is_refused(data, fmt, message):
    with pytest.raises(AudioError, match=message):
        decode_pcm(data, fmt)


@pytest.mark.parametrize(("src", "dst"), [(22050, 24000), (24000, 16000), (16000, 24000)])
def test_resampler_is_accurate_and_chunking_does_not_matter(src, dst):
    t = np.arange(src) / src
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    whole = resample(tone, src, dst)
    assert len(whole) == -(-src * dst // src)
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(len(whole)) / dst)
    assert np.abs(whole - expected)[200:-200].max() < 1e-3
    streamed = StreamResampler(src, dst)
    pieces = [streamed.process(tone[i : i + 641]) for i in range(0, len(tone), 641)]
    assert np.array_equal(np.concatenate([*pieces, streamed.flush()]), whole)


def test_wav_stream_reads_espeak_style_headers_in_pieces():
    samples = np.linspace(-0.5, 0.5, 101).astype(np.float32)
    pcm = encode_pcm(samples)
    header = (
        b"RIFF\xff\xff\xff\x7fWAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00"
        + (22050).to_bytes(4, "little")
        + (44100).to_bytes(4, "little")
        + b"\x02\x00\x10\x00data\xff\xff\xff\x7f"
    )
    stream = WavStream()
    raw = header + pcm
    got = np.concatenate([stream.feed(raw[i : i + 7]) for i in range(0, len(raw), 7)])
    assert stream.sample_rate == 22050
    assert np.allclose(got, samples, atol=1e-4)
    with pytest.raises(AudioError):
        WavStream().feed(b"RIFX0000WAVE")


def test_detector_needs_onset_and_silence_with_hysteresis():
    detector = SpeechDetector(0.5, onset_windows=2, silence_windows=3)
    # One loud window is a click; two start speech.
    assert [detector.step(p) for p in (0.9, 0.1, 0.9)] == [None, None, None]
    assert detector.step(0.9) is Transition.START
    # Between the thresholds (0.35..0.5) nothing changes until silence began.
    assert [detector.step(p) for p in (0.4, 0.4, 0.2, 0.4)] == [None, None, None, None]
    assert detector.silence_run == 2
    assert detector.step(0.9) is None  # speech again: the silence run restarts
    assert [detector.step(p) for p in (0.1, 0.1)] == [None, None]
    assert detector.step(0.1) is Transition.STOP
    assert not detector.speaking


@pytest.mark.parametrize(
    ("text", "final", "ready", "rest"),
    [
        ("Hello there. How are", False, ["Hello there."], "How are"),
        ("Hello there. How are", True, ["Hello there.", "How are"], ""),
        ("Wait!  Really? yes", False, ["Wait!", "Really?"], "yes"),
        ('He said "stop." Then', False, ['He said "stop."'], "Then"),
        ("no end yet", False, [], "no end yet"),
        ("... ", True, [], ""),
        ("line one\nline two", False, ["line one"], "line two"),
        ("aaaa bbbb, cccc dddd", False, ["aaaa bbbb,"], "cccc dddd"),
    ],
)
def test_split_ready(text, final, ready, rest):
    assert split_ready(text, final=final, max_chars=12) == (ready, rest)


def test_pacer_holds_audio_to_real_time_with_a_lead():
    pacer = Pacer(1.0, lead_s=0.5)
    waits = [pacer.delay(0.2, now=0.0) for _ in range(5)]
    # 0.2 s pieces: the first three fit in the lead (0, 0.2, 0.4 s ahead), then wait.
    assert waits == pytest.approx([0.0, 0.0, 0.0, 0.1, 0.3])
    # After a pause longer than what was sent, sending starts afresh.
    assert pacer.delay(0.2, now=10.0) == 0.0
    assert Pacer(0.0, 0.5).delay(5.0, now=0.0) == 0.0


@pytest.mark.parametrize(
    ("backend", "options", "field"),
    [
        (VadBackend, {"threshold": 2}, "threshold"),
        (VadBackend, {"min_silence_ms": "long"}, "min_silence_ms"),
        (VadBackend, {"silence": 500}, "silence"),
        (AsrBackend, {"model_path": "/nonexistent"}, "model_path"),
        (AsrBackend, {"beam_size": 0}, "beam_size"),
        (TtsBackend, {"voice": "--help"}, "voice"),
        (TtsBackend, {"sample_rate": 12345}, "sample_rate"),
        (TtsBackend, {"speak": ["audio_delta"]}, "speak"),
    ],
)
def test_bad_options_are_refused_by_name(backend, options, field):
    with pytest.raises(ValueError, match=f"(?s)invalid {backend.name} stage options.*{field}"):
        backend(options)


# -- backends on real speech -----------------------------------------------------


def audio_event(seq: int, payload: AudioPayload, epoch: int = 0) -> InputEvent:
    return InputEvent(Fence(SID, 0, epoch), seq, seq, InputMode.APPEND_AUDIO_CHUNK, payload)


def output_of(draft: OutputDraft, seq: int, stage: str = "vad") -> OutputEvent:
    return OutputEvent(
        Fence(SID), stage, draft.kind, seq, seq, draft.text, draft.data, draft.token_ids,
        dict(draft.meta),
    )  # fmt: skip


async def run_vad(backend, payloads, *, interrupt=True, start_seq=1):
    """Feed audio chunks through ``handle``; returns (seq, draft) pairs and interrupts."""
    reasons: list[str] = []

    async def barge_in(reason: str) -> Fence:
        reasons.append(reason)
        return Fence(SID, 0, len(reasons))

    ctx = StageContext(SID, "vad", Fence(SID), {}, interrupt=barge_in if interrupt else None)
    await backend.start(ctx, [], [])
    got = []
    for seq, payload in enumerate(payloads, start_seq):
        got += [(seq, d) async for d in backend.handle(ctx, audio_event(seq, payload))]
    return got, reasons, ctx


async def test_vad_hears_speech_then_silence():
    speech = speak("hello world this is a test")
    audio = np.concatenate([silence(0.5), speech, silence(1.0)])
    got, reasons, _ = await run_vad(VadBackend(), chunks(audio, ms=40))
    kinds = [d.kind for _, d in got]
    assert kinds == [
        OutputKind.SPEECH_STARTED,
        OutputKind.SPEECH_STOPPED,
        OutputKind.AUDIO_DELTA,
        OutputKind.AUDIO_DELTA,
        OutputKind.DONE,
    ]
    assert reasons == ["speech_started"]
    # The start barged in, so its draft went out with the next chunk (seq + 1).
    started_seq, started = got[0]
    assert started.flush and 0.5 <= started.meta["audio_start_ms"] / 1000 <= 0.8
    assert started_seq * 0.04 - started.meta["audio_start_ms"] / 1000 < 0.2
    stopped = got[1][1]
    assert stopped.flush
    deltas = [d for _, d in got if d.kind is OutputKind.AUDIO_DELTA]
    assert [d.meta["last"] for d in deltas] == [False, True]
    assert {(d.meta["format"], d.meta["sample_rate"]) for d in deltas} == {("pcm_s16le", 16000)}
    segment = np.concatenate([decode_pcm(d.data, "pcm_s16le") for d in deltas])
    # The utterance holds the speech plus some padding, and not the second of silence after.
    assert len(speech) * 0.7 < len(segment) < len(speech) + 0.6 * 16000
    assert got[-1][1].meta["reason"] == "silence"


async def test_vad_ignores_silence_and_feeds_of_any_shape_agree():
    quiet, _, _ = await run_vad(VadBackend(), chunks(silence(3.0), ms=40))
    assert quiet == []
    audio = np.concatenate([silence(0.3), speak("good morning how are you today"), silence(1.0)])
    small, _, _ = await run_vad(VadBackend(), chunks(audio, ms=40), interrupt=False)
    whole, _, _ = await run_vad(VadBackend(), chunks(audio, ms=len(audio) // 16), interrupt=False)
    assert [(d.kind, d.data) for _, d in small] == [(d.kind, d.data) for _, d in whole]
    # 24 kHz pcm_s16le input is resampled to the same utterance, give or take.
    audio24 = resample(audio, 16000, 24000)
    other, _, _ = await run_vad(
        VadBackend(), chunks(audio24, ms=40, rate=24000, fmt="pcm_s16le"), interrupt=False
    )
    assert [d.kind for _, d in other] == [d.kind for _, d in small]


async def test_vad_text_and_commit_pass_through_and_commit_ends_speech():
    backend = VadBackend()
    ctx = StageContext(SID, "vad", Fence(SID), {})
    await backend.start(ctx, [], [])
    text = InputEvent(Fence(SID), 1, 1, InputMode.APPEND_TEXT, TextPayload("typed"))
    assert [(d.kind, d.text) async for d in backend.handle(ctx, text)] == [
        (OutputKind.TEXT_DELTA, "typed")
    ]
    speech = speak("good morning how are you today")[:16000]  # cut mid-utterance
    drafts = [d async for d in backend.handle(ctx, audio_event(2, chunks(speech, ms=1000)[0]))]
    assert [d.kind for d in drafts] == [OutputKind.SPEECH_STARTED]
    commit = InputEvent(Fence(SID), 3, 1, InputMode.TURN_COMMIT_ONLY, CommitPayload())
    kinds = [d.kind async for d in backend.handle(ctx, commit)]
    assert kinds[0] is OutputKind.SPEECH_STOPPED and kinds[-1] is OutputKind.DONE
    assert [d.kind async for d in backend.handle(ctx, commit)] == [OutputKind.DONE]


async def test_vad_failover_rebuild_continues_the_utterance_without_repeating_its_start():
    audio = np.concatenate([silence(0.3), speak("what time is it in london"), silence(1.0)])
    pieces = chunks(audio, ms=40)
    first, _, _ = await run_vad(VadBackend(), pieces[:30], interrupt=False)
    assert [d.kind for _, d in first] == [OutputKind.SPEECH_STARTED]
    # A new owner rebuilds from the applied inputs and the outputs already published.
    backend = VadBackend()
    ctx = StageContext(SID, "vad", Fence(SID, 1), {})
    published = [output_of(d, seq) for seq, d in first]
    await backend.start(ctx, [audio_event(i + 1, p) for i, p in enumerate(pieces[:30])], published)
    rest = []
    for seq, payload in enumerate(pieces[30:], 31):
        rest += [d async for d in backend.handle(ctx, audio_event(seq, payload))]
    assert [d.kind for d in rest][:2] == [OutputKind.SPEECH_STOPPED, OutputKind.AUDIO_DELTA]
    assert OutputKind.SPEECH_STARTED not in [d.kind for d in rest]
    assert rest[-1].kind is OutputKind.DONE


async def run_asr(backend, events):
    ctx = StageContext(SID, "asr", Fence(SID), {})
    await backend.start(ctx, [], [])
    got = []
    for event in events:
        got += [d async for d in backend.handle(ctx, event)]
    return got, ctx


def utterance_events(samples: np.ndarray, *, mark_last: bool = True) -> list[OutputEvent]:
    """What the vad stage sends for one utterance: audio deltas, then done."""
    pcm = encode_pcm(samples)
    step = 32000
    pieces = [pcm[i : i + step] for i in range(0, len(pcm), step)]
    events = [
        OutputEvent(
            Fence(SID),
            "vad",
            OutputKind.AUDIO_DELTA,
            i + 1,
            data=piece,
            meta={
                "format": "pcm_s16le",
                "sample_rate": 16000,
                "last": mark_last and i == len(pieces) - 1,
            },
        )
        for i, piece in enumerate(pieces)
    ]
    return [*events, OutputEvent(Fence(SID), "vad", OutputKind.DONE, len(pieces) + 1)]


async def test_asr_transcribes_real_speech():
    backend = AsrBackend()
    pad = silence(0.3)
    hello = np.concatenate([pad, speak("hello world this is a test"), pad])
    got, _ = await run_asr(backend, utterance_events(hello))
    assert [d.kind for d in got] == [OutputKind.TRANSCRIPT, OutputKind.DONE]
    assert got[0].flush
    assert {"hello", "world", "this", "is", "test"} <= set(words(got[0].text))
    # A source that never marks the last delta: the done ends the utterance.
    morning = np.concatenate([pad, speak("good morning how are you today"), pad])
    got, _ = await run_asr(backend, utterance_events(morning, mark_last=False))
    assert [d.kind for d in got] == [OutputKind.TRANSCRIPT, OutputKind.DONE]
    assert words(got[0].text) == ["good", "morning", "how", "are", "you", "today"]


async def test_asr_silent_turn_and_passthrough():
    backend = AsrBackend()
    events = [
        *utterance_events(silence(0.05)),  # too short to hold words: nothing heard
        OutputEvent(Fence(SID), "vad", OutputKind.SPEECH_STARTED, 10, meta={"segment": 2}),
        OutputEvent(Fence(SID), "vad", OutputKind.TEXT_DELTA, 11, text="typed words"),
        OutputEvent(Fence(SID), "vad", OutputKind.DONE, 12),
    ]
    got, _ = await run_asr(backend, events)
    assert [(d.kind, d.text) for d in got] == [
        (OutputKind.SPEECH_STARTED, ""),
        (OutputKind.TRANSCRIPT, "typed words"),
        (OutputKind.DONE, ""),
    ]
    assert backend.transcriptions == 0


async def test_asr_keeps_a_transcript_when_its_handle_is_cancelled():
    backend = AsrBackend()
    await backend.transcriber()  # loaded beforehand, so the cancel hits the transcription
    speech = np.concatenate([silence(0.3), speak("what time is it in london"), silence(0.3)])
    *audio, done = utterance_events(speech)
    ctx = StageContext(SID, "asr", Fence(SID), {})
    await backend.start(ctx, [], [])
    for event in audio[:-1]:
        assert [d async for d in backend.handle(ctx, event)] == []

    async def drain(event):
        return [d async for d in backend.handle(ctx, event)]

    task = asyncio.create_task(drain(audio[-1]))
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()  # a barge-in released the fence while Whisper was working
    with pytest.raises(asyncio.CancelledError):
        await task
    # The next event (here the turn's done) publishes the transcript first.
    got = await drain(done)
    assert [d.kind for d in got] == [OutputKind.TRANSCRIPT, OutputKind.DONE]
    assert words(got[0].text) == ["what", "time", "is", "it", "in", "london"]


def text_event(seq: int, text: str, kind: OutputKind = OutputKind.TEXT_DELTA) -> OutputEvent:
    return OutputEvent(Fence(SID), "thinker", kind, seq, text=text)


async def test_tts_speaks_sentences_as_24k_pcm16_chunks():
    backend = TtsBackend({"chunk_ms": 100})
    ctx = StageContext(SID, "tts", Fence(SID), {})
    await backend.start(ctx, [], [])
    first = [d async for d in backend.handle(ctx, text_event(1, "Hello there. How are"))]
    # The finished sentence is spoken at once; the rest waits for more text.
    assert first[0].kind is OutputKind.TRANSCRIPT and first[0].text == "Hello there."
    audio = [d for d in first if d.kind is OutputKind.AUDIO_DELTA]
    assert audio and all(d.flush for d in audio)
    assert {(d.meta["format"], d.meta["sample_rate"]) for d in audio} == {("pcm_s16le", 24000)}
    assert all(len(d.data) == 2 * 2400 for d in audio[:-1]) and audio[-1].meta["last"]
    samples = np.concatenate([decode_pcm(d.data, "pcm_s16le") for d in audio])
    expected = len(speak("Hello there.", rate=24000))
    assert abs(len(samples) - expected) < 0.05 * expected
    assert np.abs(samples).max() > 0.1  # real speech, not silence
    rest = [d async for d in backend.handle(ctx, text_event(2, "", OutputKind.DONE))]
    # Each later sentence's transcript follows on with a space: they concatenate.
    assert rest[0].text == " How are" and rest[-1].kind is OutputKind.DONE
    assert backend.killed == 0


LONG_TEXT = (
    "This answer is deliberately long so that the listener has plenty of time to "
    "interrupt it, and it keeps going on about nothing in particular for many more "
    "words than anyone would want to hear before they finally decide to speak up."
)


async def test_tts_cancel_kills_espeak_mid_utterance():
    backend = TtsBackend({"pace": 1.0, "lead_ms": 200, "max_clause_chars": 1000})
    ctx = StageContext(SID, "tts", Fence(SID), {})
    await backend.start(ctx, [], [])
    session = ctx.state["tts"]
    got: list[OutputDraft] = []

    async def produce():
        async for draft in backend.handle(ctx, text_event(1, LONG_TEXT + " ")):
            got.append(draft)

    task = asyncio.create_task(produce())
    async with asyncio.timeout(10):
        while sum(d.kind is OutputKind.AUDIO_DELTA for d in got) < 3:
            await asyncio.sleep(0.01)
    (process,) = session.running
    assert process.returncode is None  # still synthesizing (paced output fills the pipe)
    before = len(got)
    began = time.monotonic()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert time.monotonic() - began < 0.5
    assert process.returncode == -signal.SIGKILL
    assert backend.killed == 1 and not session.running
    await asyncio.sleep(0.3)
    assert len(got) == before  # nothing after the cancel
    spoken = sum(len(d.data) for d in got if d.kind is OutputKind.AUDIO_DELTA) / 2 / 24000
    assert spoken < 2.0  # a ~14 s answer, cut after well under two seconds


async def test_tts_release_forgets_unspoken_text():
    backend = TtsBackend()
    ctx = StageContext(SID, "tts", Fence(SID), {})
    await backend.start(ctx, [], [])
    assert [d async for d in backend.handle(ctx, text_event(1, "half a sentence"))] == []
    await backend.release(ctx, Fence(SID))
    ctx.stage_fence.on_cancel(Fence(SID, 0, 1))
    got = [d async for d in backend.handle(ctx, text_event(2, "", OutputKind.DONE))]
    assert [d.kind for d in got] == [OutputKind.DONE]
    await backend.stop(ctx)
    await backend.aclose()


# -- the pipeline through workers on real Redis ----------------------------------


def speech_pipeline(**tts_options: object) -> PipelineConfig:
    return PipelineConfig(
        name="speech",
        stages=(
            StageConfig(name="vad", backend="vad"),
            StageConfig(name="asr", backend="asr", input="vad", to_client=True),
            StageConfig(name="thinker", backend="echo", input="asr", to_client=True),
            StageConfig(name="tts", backend="tts", input="thinker", to_client=True,
                        options={"speak": ["text_delta", "transcript"], **tts_options}),
        ),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def speech_stack(settings, pipeline):
    stages = {stage.name: stage for stage in pipeline.stages}
    backends = {
        "vad": VadBackend(stages["vad"].options),
        "asr": AsrBackend(stages["asr"].options),
        "thinker": EchoBackend(),
        "tts": TtsBackend(stages["tts"].options),
    }
    coordinator = Coordinator(settings, pipeline)
    try:
        async with contextlib.AsyncExitStack() as stack:
            for name, backend in backends.items():
                await stack.enter_async_context(
                    running_worker(settings, pipeline, name, backend=backend)
                )
            await coordinator.open(SID)
            yield coordinator, backends
    finally:
        await coordinator.aclose()


async def deliveries_until(coordinator, got, done, timeout=20.0):
    async with asyncio.timeout(timeout):
        while not done(got):
            got.extend(await coordinator.outputs(block_ms=100))
    return got


def outs(got, stage=None, kind=None):
    return [
        d.event
        for d in got
        if isinstance(d.event, OutputEvent)
        and (stage is None or d.event.stage == stage)
        and (kind is None or d.event.kind is kind)
    ]


async def say(coordinator, samples):
    for payload in chunks(samples, ms=40):
        await coordinator.append(SID, "append_audio_chunk", payload)


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix)


async def test_spoken_turn_flows_from_vad_to_tts(settings):
    async with speech_stack(settings, speech_pipeline()) as (coordinator, backends):
        await say(
            coordinator, np.concatenate([silence(0.3), speak("good morning how are you today")])
        )
        await say(coordinator, silence(1.0))
        got = await deliveries_until(coordinator, [], lambda got: outs(got, "tts", OutputKind.DONE))
    heard = outs(got, "asr", OutputKind.TRANSCRIPT)
    assert len(heard) == 1
    assert words(heard[0].text) == ["good", "morning", "how", "are", "you", "today"]
    # The speech events reach the client through the asr stage; the start barged in.
    assert [o.kind for o in outs(got, "asr")][:2] == [
        OutputKind.SPEECH_STARTED,
        OutputKind.SPEECH_STOPPED,
    ]
    controls = [d.event for d in got if isinstance(d.event, ControlEvent)]
    assert [(c.kind, c.reason) for c in controls if c.kind is ControlKind.CANCEL] == [
        (ControlKind.CANCEL, "speech_started")
    ]
    assert {o.fence.epoch for o in outs(got)} == {1}
    # The thinker got the transcript; the tts spoke it as 24 kHz PCM16.
    assert [o.text for o in outs(got, "thinker", OutputKind.TRANSCRIPT)] == [heard[0].text]
    audio = outs(got, "tts", OutputKind.AUDIO_DELTA)
    assert audio and {o.meta["sample_rate"] for o in audio} == {24000}
    seconds = sum(len(o.data) for o in audio) / 2 / 24000
    assert 1.0 < seconds < 4.0
    assert backends["asr"].transcriptions == 1


async def test_barge_in_by_voice_cuts_the_spoken_answer(settings):
    pipeline = speech_pipeline(pace=1.0, lead_ms=200, max_clause_chars=1000)
    async with speech_stack(settings, pipeline) as (coordinator, backends):
        await coordinator.append(SID, "append_text", TextPayload(LONG_TEXT))
        await coordinator.commit(SID)
        got = await deliveries_until(
            coordinator, [], lambda got: len(outs(got, "tts", OutputKind.AUDIO_DELTA)) >= 3
        )
        assert {o.fence.epoch for o in outs(got)} == {0}
        # The user speaks over the answer.
        await say(coordinator, np.concatenate([silence(0.2), speak("what time is it in london")]))
        await say(coordinator, silence(1.0))
        got = await deliveries_until(
            coordinator, got, lambda got: outs(got, "tts", OutputKind.DONE)
        )
        tts = backends["tts"]
    barrier = next(
        i for i, d in enumerate(got)
        if isinstance(d.event, ControlEvent) and d.event.kind is ControlKind.CANCEL
    )  # fmt: skip
    epoch = got[barrier].event.fence.epoch
    assert epoch == 1 and got[barrier].event.reason == "speech_started"
    after = outs(got[barrier:])
    # Nothing of the interrupted answer after the barrier; the new turn is whole.
    assert all(o.fence.epoch == epoch for o in after)
    answered = outs(got[barrier:], "asr", OutputKind.TRANSCRIPT)
    assert [words(o.text) for o in answered] == [["what", "time", "is", "it", "in", "london"]]
    assert outs(got[barrier:], "tts", OutputKind.AUDIO_DELTA)
    # The old answer was cut: far less than its ~14 s was sent, and espeak was killed.
    old = outs(got[:barrier], "tts", OutputKind.AUDIO_DELTA)
    assert sum(len(o.data) for o in old) / 2 / 24000 < 5.0
    assert not outs(got[:barrier], "tts", OutputKind.DONE)
    assert tts.killed == 1
