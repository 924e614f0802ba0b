"""The browser demo end to end: headless Chromium with a fake microphone and camera.

The page is served by the coordinator (uvicorn in the test's loop, real Redis,
in-process workers). Chromium's fake microphone plays a WAV file in a loop;
the test watches ``window.duplexqDemo`` and clicks the page's own controls.

- echo pipeline: the microphone comes back as audio (so capture, the 24 kHz
  PCM16 framing, playback and Interrupt are checked without any model) and a
  camera frame comes back as text;
- speech pipeline ``vad -> asr -> thinker (echo) -> tts``: a spoken turn is
  transcribed and answered with speech; Interrupt silences the answer at once;
  then the user speaking over a long answer silences it (server VAD barge-in);
- the stages' models: a turn sent while a stage's model loads is shown as waiting
  for it, and a stage serving the random-weight fallback gets a visible notice;
- the page itself: its status says "speaking" only while an answer's audio plays and
  rests when playback ends or is interrupted, and the latency values stay inside
  their pane at every width the layout has (screenshots under the test's tmp_path).

Chromium missing is a failure, not a skip: scripts/setup installs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataplane.readiness import StageModel
from dataplane.tracing import close_sink
from schemas.config import PipelineConfig, StageConfig, echo_pipeline, load_pipeline
from schemas.events import AudioPayload, InputEvent, PlaybackPayload
from tests.browser_helpers import DemoPage, demo_page, write_speech_wav, write_tone_wav
from tests.otlp_receiver import otlp_receiver
from tests.pipeline_helpers import fast_settings, running_worker
from tests.processes import ROOT
from tests.realtime_helpers import serving, streaming_echo
from workers.backends.asr import AsrBackend
from workers.backends.echo import EchoBackend
from workers.backends.tts import TtsBackend
from workers.backends.vad import VadBackend

pytestmark = pytest.mark.timeout(90)

TONE_HZ = 440.0
STOPPED_BY_SERVER = ("speech_started", "cancelled")
AUDIBLE = 0.01
"""Output level (RMS) above which the page's meter counts a response as heard."""
SILENCE_MEASURED = (
    "!s.playing && s.outputLevel < 1e-4 && s.latencies.bargeIns.at(-1).silenceMs !== null"
)
"""The last barge-in's silence was read on the page's output meter."""


@pytest.fixture
def settings(redis_server, key_prefix):
    # Leases long enough that a CPU-starved loop (Chromium, Whisper and the stack
    # share the machine) does not fail sessions over: failover has its own tests.
    return fast_settings(
        redis_server.url, key_prefix, api_keys=("k1",), lease_ttl_ms=5000, heartbeat_ms=500
    )


@pytest.fixture
def wav(tmp_path) -> Path:
    """The microphone's input for pages that do not speak: a tone."""
    path = tmp_path / "tone.wav"
    write_tone_wav(path, hz=TONE_HZ)
    return path


def http(base: str) -> str:
    return base.replace("ws://", "http://", 1)


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers["content-type"], response.read()


async def test_the_demo_page_and_its_files_are_served(settings):
    async with serving(settings, echo_pipeline("echo")) as base:
        page = await asyncio.to_thread(_get, f"{http(base)}/")
        script = await asyncio.to_thread(_get, f"{http(base)}/static/app.js")
        modules = [
            await asyncio.to_thread(_get, f"{http(base)}/static/{name}")
            for name in ("pcm.js", "player.js", "capture-worklet.js", "waterfall.js")
        ]
    assert page[0] == 200 and page[1].startswith("text/html")
    assert b'src="/static/app.js"' in page[2]
    assert script[0] == 200 and "javascript" in script[1]
    assert b"window.duplexqDemo" in script[2]
    assert all(status == 200 and "javascript" in kind for status, kind, _ in modules)


# -- echo: capture, playback and interruption without models -----------------------


class RecordingEcho(EchoBackend):
    """Echo that keeps the microphone audio and playback acks it was sent."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.audio: list[AudioPayload] = []
        self.acks: list[PlaybackPayload] = []

    def _record(self, event: object) -> None:
        if isinstance(event, InputEvent):
            if isinstance(event.payload, AudioPayload):
                self.audio.append(event.payload)
            elif isinstance(event.payload, PlaybackPayload):
                self.acks.append(event.payload)

    async def handle(self, ctx, event):
        self._record(event)
        async for draft in super().handle(ctx, event):
            yield draft

    async def absorb(self, ctx, event):
        self._record(event)
        await super().absorb(ctx, event)


def browser_echo() -> PipelineConfig:
    """Echo streaming its answers in short steps; typed text answered when asked, as the
    shipped echo and a model answer it (answered at once, a typed turn's answer or its
    function call could begin before its ``response.create`` is taken, in the response
    before)."""
    return streaming_echo(chunks=4, step_ms=5)


async def click_interrupt(demo: DemoPage) -> dict[str, Any]:
    """Click Interrupt while audio plays, and read the state in the same task: silence
    must be immediate. The page waits for playback itself and clicks in the task that saw
    it: seen playing from the test, the echo's audio (answers to the microphone's, as
    they come) could run dry in the round trip before the click on a loaded machine, and
    an interrupt with nothing playing cuts nothing."""
    state: dict[str, Any] = await demo.evaluate(
        """async () => {
            const s = window.duplexqDemo;
            const until = performance.now() + 20000;
            while (!s.playing && performance.now() < until) {
                await new Promise((resolve) => setTimeout(resolve, 2));
            }
            document.getElementById("interrupt").click();
            return JSON.parse(JSON.stringify(s));
        }"""
    )
    return state


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


async def test_echo_page_captures_plays_and_interrupts(settings, wav):
    pipeline = browser_echo()
    backend = RecordingEcho(pipeline.stages[0].options)
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo", backend=backend),
        demo_page(http(base), wav) as demo,
    ):
        await demo.page.check("#camera")
        await demo.page.click("#connect")
        await demo.wait_for(
            "s.connected && s.playing && s.audioChunksPlayed >= 10"
            " && s.videoFramesSent >= 1 && s.assistantText.includes('frame')"
        )
        at_stop = await click_interrupt(demo)
        assert at_stop["playing"] is False
        assert at_stop["lastStopReason"] == "interrupt"
        cut = at_stop["stops"][-1]["responseIds"]
        assert cut
        # The server acknowledges the barge-in; audio of the new epoch plays again.
        after = await demo.wait_for(
            "s.latencies.bargeInCancelledMs !== null && Object.values(s.responses)"
            ".some((r) => r.epoch >= 1 && r.played > 0)"
        )
        assert after["errors"] == []
    assert_cut_for_good(at_stop["stops"][-1], at_stop, after)
    # What the page sent: 40 ms of 24 kHz PCM16 per append, the tone intact.
    assert {(a.format, a.sample_rate, len(a.data)) for a in backend.audio} == {
        ("pcm_s16le", 24_000, 1920)
    }
    samples = np.frombuffer(b"".join(a.data for a in backend.audio[5:30]), "<i2") / 32768
    assert abs(dominant_hz(samples, 24_000) - TONE_HZ) < 5
    # The interrupted response's playback was acknowledged with what was heard.
    assert {ack.response_id for ack in backend.acks} >= set(cut)
    assert all(ack.played_ms > 0 for ack in backend.acks if ack.response_id in cut)


# -- the real speech pipeline ------------------------------------------------------

PHRASE = "good morning, how are you today"
LONG_ANSWER = (
    "Here is a long answer that takes a while to say, so that you can talk over it. "
    "It goes on about the weather, the trains and the price of bread, "
    "and it does not stop until somebody interrupts it."
)


def speech_pipeline() -> PipelineConfig:
    return PipelineConfig(
        name="browser-speech",
        stages=(
            StageConfig(name="vad", backend="vad"),
            StageConfig(name="asr", backend="asr", input="vad", to_client=True),
            StageConfig(name="thinker", backend="echo", input="asr", to_client=True,
                        options={"chunks": 1}),
            StageConfig(name="tts", backend="tts", input="thinker", to_client=True,
                        options={"speak": ["text_delta", "transcript"],
                                 "words_per_minute": 110}),
        ),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def speech_workers(settings, pipeline):
    vad = VadBackend(pipeline.stage("vad").options)
    asr = AsrBackend(pipeline.stage("asr").options)
    # Load the models before the clock starts (Silero, Whisper tiny.en).
    assert vad.model is not None
    await asr.transcriber()
    backends = {
        "vad": vad,
        "asr": asr,
        "thinker": EchoBackend(pipeline.stage("thinker").options),
        "tts": TtsBackend(pipeline.stage("tts").options),
    }
    async with contextlib.AsyncExitStack() as stack:
        for name, backend in backends.items():
            await stack.enter_async_context(
                running_worker(settings, pipeline, name, backend=backend)
            )
        yield backends


def spoken_words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


async def test_spoken_turn_is_answered_and_interruptions_silence_it(settings, tmp_path):
    pipeline = speech_pipeline()
    wav = tmp_path / "speech.wav"
    # The fake microphone loops: 0.3 s quiet, the phrase, 4 s quiet.
    write_speech_wav(wav, PHRASE, lead_s=0.3, tail_s=4.0)
    async with (
        speech_workers(settings, pipeline),
        serving(settings, pipeline) as base,
        demo_page(http(base), wav) as demo,
    ):
        await demo.connect_and_speak_once()

        # 1. The spoken turn is transcribed and answered with speech that the output
        # meter hears (speech starts softly: a chunk that began may still be quiet).
        heard = await demo.wait_for(
            "/morning/i.test(s.transcript) && s.playing && Object.values(s.responses)"
            f".some((r) => r.peakLevel > {AUDIBLE})",
            40,
        )
        assert "morning" in spoken_words(heard["transcript"])

        # 2. Interrupt silences the answer at once and drops what was queued; the
        # output meter reads silence and the server acknowledges the cancel.
        at_stop = await click_interrupt(demo)
        assert at_stop["playing"] is False
        assert at_stop["lastStopReason"] == "interrupt"
        first_cut = at_stop["stops"][-1]
        assert first_cut["responseIds"] and first_cut["cutChunks"] > 0
        await demo.wait_for(f"{SILENCE_MEASURED} && s.latencies.bargeInCancelledMs !== null")

        # 3. A long typed answer plays; the user speaks over it (server VAD barge-in).
        await demo.page.fill("#text", LONG_ANSWER)
        await demo.page.click("#send")
        cut_ids = first_cut["responseIds"]
        playing = await demo.wait_for(
            f"s.playing && Object.values(s.responses).some((r) => r.peakLevel > {AUDIBLE} "
            f"&& !{json.dumps(cut_ids)}.includes(r.id))",
            30,
        )
        stops = len(playing["stops"])
        await demo.page.uncheck("#mute")
        barged = await demo.wait_for(f"s.stops.length > {stops} && {SILENCE_MEASURED}", 20)
        second_cut = barged["stops"][-1]
        assert second_cut["reason"] in STOPPED_BY_SERVER
        # Let the barge-in utterance finish, then check nothing cut was heard later.
        stopped_before = barged["eventCounts"]["input_audio_buffer.speech_stopped"]
        end = await demo.wait_for(
            f"s.eventCounts['input_audio_buffer.speech_stopped'] > {stopped_before}", 20
        )
        panes = await _panes(demo)
    assert_cut_for_good(first_cut, at_stop, end)
    # Each message shows once: the typed one under "You", each answer's text once
    # (its audio transcript, the text of an answer that is only spoken); the answers
    # the interruptions cut are marked where they were cut.
    assert panes["user"].count(LONG_ANSWER) == 1
    spoken_answers = [line for line in panes["assistant"] if "long answer" in line["text"]]
    assert spoken_answers and all(line["text"].count("Here is") == 1 for line in spoken_answers)
    cut = {line["id"] for line in panes["assistant"] if line["cut"]}
    assert set(first_cut["responseIds"]) | set(second_cut["responseIds"]) <= cut
    assert_cut_for_good(second_cut, barged, end)
    lat = end["latencies"]
    assert lat["turns"][0]["trigger"] == "speech_stopped"
    assert lat["turns"][0]["firstAudioMs"] is not None
    interrupt, voice = (b for b in lat["bargeIns"] if b["silenced"])
    assert interrupt["trigger"] == "interrupt" and voice["trigger"] in STOPPED_BY_SERVER
    assert interrupt["silenceMs"] < 500 and voice["silenceMs"] < 500
    print("turns:", [(t["trigger"], t["firstDeltaMs"], t["firstAudioMs"]) for t in lat["turns"]])
    print(
        "barge-ins:",
        [(b["trigger"], b["silenceMs"], b["cancelledMs"], b["voiceMs"]) for b in lat["bargeIns"]],
    )


async def test_the_page_shows_the_last_turns_waterfall(settings, tmp_path, monkeypatch):
    """With tracing on, a spoken turn's trace (begun by the server VAD at the end of
    speech) reaches the OTLP receiver with a span per stage, and the page draws the
    waterfall of the duplexq.turn.trace event it was sent."""
    pipeline = speech_pipeline()
    wav = tmp_path / "speech.wav"
    write_speech_wav(wav, PHRASE, lead_s=0.3, tail_s=4.0)
    with otlp_receiver() as receiver:
        # Tracing on for this process, where the coordinator and the workers run; the
        # batch exporter's delay (5 s by default) shortened so the spans come sooner.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        try:
            async with (
                speech_workers(settings, pipeline),
                serving(settings, pipeline) as base,
                demo_page(http(base), wav) as demo,
            ):
                await demo.connect_and_speak_once()
                state = await demo.wait_for("s.lastTurnTrace !== null", 40)
                names = await demo.page.eval_on_selector_all(
                    "#waterfall .wf-name", "els => els.map((e) => e.textContent)"
                )
                bars = await demo.page.eval_on_selector_all(
                    "#waterfall .wf-bar", "els => els.map((e) => e.getBoundingClientRect().width)"
                )
                shown = await demo.page.is_visible("#waterfall")
                summary = await demo.page.text_content("#waterfall .wf-summary")
        finally:
            close_sink()  # exports what is pending
        spans = receiver.spans
    trace = state["lastTurnTrace"]
    assert [s["stage"] for s in trace["stages"]] == ["vad", "asr", "thinker", "tts"]
    assert shown and names == ["vad", "asr", "thinker", "tts", "to you"]
    assert len(bars) == 9 and any(width > 10 for width in bars)
    assert summary is not None and "duplexq's own" in summary
    mine = {s.name for s in spans if s.trace_id == trace["trace_id"]}
    assert mine == {"duplexq.turn", "stage vad", "stage asr", "stage thinker", "stage tts"}


async def _panes(demo: DemoPage) -> dict[str, Any]:
    """The lines of the page's two panes, as a user sees them."""
    panes: dict[str, Any] = await demo.evaluate(
        """() => ({
            user: [...document.querySelectorAll("#user-transcript li")].map((li) => li.textContent),
            assistant: [...document.querySelectorAll("#assistant-text li")].map((li) => ({
                id: li.dataset.id || null, text: li.textContent,
                cut: li.classList.contains("cut"), call: li.classList.contains("call")})),
        })"""
    )
    return panes


async def test_the_page_offers_a_tool_runs_the_call_and_shows_it(settings, wav):
    """The echo thinker calls the session's first tool for a ``call:`` message (and
    echoes the microphone's audio, muted here, as answers of its own)."""
    pipeline = browser_echo()
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        demo_page(http(base), wav) as demo,
    ):
        await demo.page.check("#mute")
        await demo.page.check("#tool")
        await demo.page.click("#connect")
        await demo.wait_for("s.connected")
        await demo.page.fill("#text", "call:what time is it")
        await demo.page.click("#send")
        state = await demo.wait_for(
            "s.calls.length === 1 && s.assistantText.includes(s.calls[0].result)"
        )
        panes = await _panes(demo)
    [call] = state["calls"]
    assert call["name"] == "get_current_time" and call["result"]
    assert panes["user"] == ["call:what time is it"]
    calls = [line["text"] for line in panes["assistant"] if line["call"]]
    assert calls == [f"get_current_time({call['arguments']}) → {call['result']}"]
    # The model's answer to the result: the echo says the result back.
    answers = [line["text"] for line in panes["assistant"] if not line["call"]]
    assert answers == [call["result"]]
    assert state["errors"] == []


# -- the stages' models: loading, and the random-weight fallback -----------------------


class LoadingEcho(EchoBackend):
    """A streaming echo with a "model" to load: ``load`` waits for ``gate`` and then
    says it serves ``model`` (the fallback when ``fallback``)."""

    def __init__(self, options: dict[str, Any], model: str, *, fallback: bool) -> None:
        super().__init__(options)
        self.served = StageModel(model, fallback=fallback)
        self.gate = asyncio.Event()
        self.loading = asyncio.Event()

    async def load(self) -> StageModel:
        self.loading.set()
        await self.gate.wait()
        return self.served


async def _notice(demo: DemoPage, element: str) -> dict[str, Any]:
    shown: dict[str, Any] = await demo.evaluate(
        f"""() => {{ const e = document.getElementById("{element}");
                    return {{hidden: e.hidden, text: e.textContent}}; }}"""
    )
    return shown


async def test_the_page_shows_the_models_loading_until_every_stage_is_ready(settings, wav):
    pipeline = browser_echo()
    backend = LoadingEcho(pipeline.stages[0].options, "echo-model", fallback=False)
    async with serving(settings, pipeline) as base, demo_page(http(base), wav) as demo:
        # No worker yet: the page names the stage as loading.
        await demo.wait_for("s.loading && s.loading.includes('echo')")
        models = await _notice(demo, "models")
        assert not models["hidden"] and "echo" in models["text"]
        await demo.page.check("#mute")
        await demo.page.click("#connect")
        await demo.wait_for("s.connected")
        await demo.page.fill("#text", "are you there")
        await demo.page.click("#send")
        await demo.wait_for("s.status === 'loading the models (echo)…'")
        async with running_worker(settings, pipeline, "echo", backend=backend):
            # The worker is up but its model still loads: still loading, no answer.
            await asyncio.wait_for(backend.loading.wait(), 10)
            await asyncio.sleep(2.5)  # more than one of the page's polls
            state = await demo.state()
            assert state["status"] == "loading the models (echo)…", state["status"]
            assert state["loading"] == ["echo"] and state["assistantText"] == ""
            backend.gate.set()
            done = await demo.wait_for(
                "s.loading.length === 0 && s.assistantText.includes('are you there')"
            )
            models = await _notice(demo, "models")
            fallback = await _notice(demo, "fallback")
    assert models["hidden"]
    assert not done["status"].startswith("loading"), done["status"]
    assert done["fallback"] == [] and fallback["hidden"]
    assert done["errors"] == []


async def test_the_page_announces_a_stage_serving_the_random_weight_fallback(settings, wav):
    pipeline = browser_echo()
    backend = LoadingEcho(pipeline.stages[0].options, "package:smollm2", fallback=True)
    backend.gate.set()
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo", backend=backend),
        demo_page(http(base), wav) as demo,
    ):
        state = await demo.wait_for("s.loading && s.loading.length === 0")
        notice = await _notice(demo, "fallback")
        console = list(demo.console)
    assert state["fallback"] == ["echo"]
    assert not notice["hidden"]
    text = notice["text"]
    assert "gibberish" in text and "random-weight" in text, text
    assert "echo (its model package:smollm2 is not available" in text, text
    assert "scripts/setup" in text and "docs/models.md" in text, text
    assert not [line for line in console if "error" in line.lower()], console


def assert_cut_for_good(stop: dict[str, Any], at_stop: dict[str, Any], end: dict[str, Any]) -> None:
    """A response cut by ``stop`` was audible before it and never played again after."""
    for rid in stop["responseIds"]:
        then, now = at_stop["responses"][rid], end["responses"][rid]
        assert then["peakLevel"] > AUDIBLE, f"{rid} was never audible"
        assert now["played"] == then["played"], f"{rid} played on after it was cut"
        assert now["playedAfterStop"] == 0 and now["receivedAfterCancel"] == 0
    acked = {ack["response_id"] for ack in end["acks"]}
    assert set(stop["responseIds"]) <= acked


# -- the page: its status and its layout -------------------------------------------------

TYPED = "Hello there, who are you?"
WIDTHS = (1280, 1024, 900, 700, 600, 360)
"""Viewport widths the layout is checked at: three panes, two with latency below, one
column, and a phone's."""
WATCH_STATUS = """() => {
    // Samples, every 5 ms, of what the status says beside what playback does.
    const seen = (window.statusSeen = { samples: 0, speaking: 0, speakingIdle: [] });
    setInterval(() => {
        const s = window.duplexqDemo, shown = document.getElementById("playback").textContent;
        seen.samples++;
        if (s.status !== "speaking") return;
        seen.speaking++;
        if (!s.playing || shown !== "playing") seen.speakingIdle.push({ shown, s: s.playing });
    }, 5);
}"""
BOXES = """() => [...document.querySelectorAll("#latency dt, #latency dd")].map((el) => {
    const pane = el.closest(".pane"), style = getComputedStyle(pane);
    const outer = pane.getBoundingClientRect();
    const left = outer.left + pane.clientLeft + parseFloat(style.paddingLeft);
    const top = outer.top + pane.clientTop + parseFloat(style.paddingTop);
    const inner = { left, top, right: outer.left + pane.clientLeft + pane.clientWidth -
                    parseFloat(style.paddingRight), bottom: outer.top + pane.clientTop +
                    pane.clientHeight - parseFloat(style.paddingBottom) };
    const text = document.createRange();
    text.selectNodeContents(el);
    const box = (r) => ({ left: r.left, top: r.top, right: r.right, bottom: r.bottom });
    return { tag: el.tagName, id: el.id, text: el.textContent, pane: inner,
             box: box(el.getBoundingClientRect()), glyphs: box(text.getBoundingClientRect()),
             lines: text.getClientRects().length };
})"""


def spoken_pipeline() -> PipelineConfig:
    """The shipped echo thinker, spoken by the TTS stage: an answer's audio that ends."""
    thinker = load_pipeline(ROOT / "configs" / "echo.toml").stage("thinker")
    return PipelineConfig(
        name="browser-spoken",
        stages=(
            thinker,
            StageConfig(name="tts", backend="tts", input="thinker", to_client=True),
        ),
    )


def _inside(inner: dict[str, float], box: dict[str, float]) -> bool:
    slack = 0.5  # sub-pixel rounding
    return all(box[side] >= inner[side] - slack for side in ("left", "top")) and all(
        box[side] <= inner[side] + slack for side in ("right", "bottom")
    )


async def check_layout(demo: DemoPage, tmp_path: Path) -> list[Path]:
    """At each width, every latency label and value lies inside its pane (a value on
    one line); the screenshots taken, one per width."""
    shots = []
    for width in WIDTHS:
        await demo.page.set_viewport_size({"width": width, "height": 900})
        shot = tmp_path / f"demo-page-{width}.png"
        await demo.page.screenshot(path=str(shot), full_page=True)
        shots.append(shot)
        boxes = await demo.evaluate(BOXES)
        outside = [
            (b["text"], b["box"], b["pane"])
            for b in boxes
            if not (_inside(b["pane"], b["box"]) and _inside(b["pane"], b["glyphs"]))
        ]
        wrapped = [b["text"] for b in boxes if b["tag"] == "DD" and b["lines"] != 1]
        assert not outside and not wrapped, (
            f"at {width} px, outside their pane (text, box, pane): {outside}; values on "
            f"more than one line: {wrapped}; screenshot: {shot}"
        )
    return shots


async def test_the_status_follows_playback_and_latency_values_stay_in_their_pane(
    settings, wav, tmp_path
):
    pipeline = spoken_pipeline()
    async with contextlib.AsyncExitStack() as stack:
        base = await stack.enter_async_context(serving(settings, pipeline))
        for stage in ("thinker", "tts"):
            await stack.enter_async_context(running_worker(settings, pipeline, stage))
        demo = await stack.enter_async_context(demo_page(http(base), wav))
        await demo.page.set_viewport_size({"width": WIDTHS[0], "height": 900})
        await demo.evaluate(WATCH_STATUS)
        await demo.page.check("#mute")
        await demo.page.click("#connect")
        await demo.wait_for("s.connected && s.status === 'listening'")

        # A typed turn: "speaking" while its answer plays, "listening" once it has played.
        await demo.page.fill("#text", TYPED)
        await demo.page.click("#send")
        speaking = await demo.wait_for("s.status === 'speaking'", 30)
        assert speaking["playing"] and speaking["speaking"]
        played = await demo.wait_for(
            "!s.playing && Object.values(s.responses).some((r) => r.played > 0)"
            " && Object.values(s.responses).every((r) => r.status !== 'in_progress')",
            30,
        )
        answers = (await _panes(demo))["assistant"]
        turn_shot = tmp_path / "demo-page-after-a-turn.png"
        await demo.page.screenshot(path=str(turn_shot), full_page=True)
        assert played["status"] == "listening", (played["statusLog"], turn_shot)

        # A long answer, interrupted while it plays: the status rests at once and stays
        # there when the server's cancel arrives.
        await demo.page.fill("#text", LONG_ANSWER)
        await demo.page.click("#send")
        await demo.wait_for("s.status === 'speaking' && s.stops.length === 0", 30)
        at_stop = await click_interrupt(demo)
        assert (at_stop["status"], at_stop["playing"]) == ("listening", False)
        after = await demo.wait_for(
            f"{SILENCE_MEASURED} && s.latencies.bargeInCancelledMs !== null"
        )
        assert after["status"] == "listening", after["statusLog"]
        seen = await demo.evaluate("() => window.statusSeen")
        shots = await check_layout(demo, tmp_path)
    shown = f"screenshots: {turn_shot}, {', '.join(map(str, shots))}"
    log = [(entry["status"], entry["playing"]) for entry in played["statusLog"]]
    assert ("speaking", True) in log and ("speaking", False) not in log, (log, shown)
    assert log[-1] == ("listening", False), (log, shown)
    assert seen["speaking"] > 0 and seen["speakingIdle"] == [], (seen, shown)
    assert [a["text"] for a in answers] == [TYPED] and not answers[0]["cut"], (answers, shown)
    assert after["errors"] == [], shown
    print(shown)
