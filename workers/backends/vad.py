"""Server voice activity detection (Silero), for turn detection and barge-in.

The ``vad`` stage reads a session's input log. Audio chunks (``pcm_f32le`` or
``pcm_s16le`` at any rate) are resampled to 16 kHz and cut into 32 ms
windows; the Silero network gives each window a speech probability and a
small state machine (``SpeechDetector``, pure) turns those into utterances:

- speech starts after ``min_speech_ms`` of windows at or above ``threshold``:
  the stage emits ``speech_started`` and, with ``interrupt_response``, barges
  in on the session (``ctx.interrupt``), which bumps its epoch and so cancels
  whatever the model and the TTS are saying, as OpenAI Realtime's server VAD
  does;
- speech stops after ``min_silence_ms`` below ``threshold - 0.15``: the stage
  emits ``speech_stopped``, the utterance as 16 kHz ``pcm_s16le`` audio deltas
  (``prefix_padding_ms`` of audio before the start included; the last delta
  has ``meta["last"] = True``) and a ``done`` that ends the user's turn;
- an utterance that ends by itself (silence, or ``max_segment_s`` reached) also
  ends the user's turn in the session (``ctx.end_turn``): the answer to it is a
  response of its own, with the next ``turn_id`` and ``response_seq``;
- an utterance longer than ``max_segment_s`` is cut there (stopped and
  committed); if the user goes on, that is a new utterance.

Text and tokens pass through as ``text_delta`` (a typed turn reaches a
text-only thinker downstream); a ``turn_commit_only`` ends the turn at once
(the utterance in progress, if any, is committed); ``clear_audio`` drops the
utterance in progress (``speech_stopped`` with ``reason = "cleared"``, no
audio, no ``done``); video and playback acks are ignored.

The session's settings (``ctx.session``, from ``session.update``) tune it:
a client's ``threshold``, ``silence_duration_ms`` and ``prefix_padding_ms``
replace the stage's options, ``interrupt_response: false`` stops barge-ins,
and ``turn_detection: null`` turns detection off: the network is not run, no
speech is announced, and the audio is kept until the client commits it (one
utterance, as above) or clears it (a buffer reaching ``max_segment_s`` is
committed, as an utterance that long is with detection on).

Why drafts go through the outbox: the runtime publishes a ``handle`` call's
drafts under the fence the call started with, and drops them once that fence
is released. A chunk that barges in therefore keeps its drafts (the
``speech_started`` and anything before it) in the session's outbox and
interrupts last; once the new epoch is in, it hands them to ``ctx.emit``,
which publishes them under the new fence at once (without ``emit``, the next
chunk publishes them first). Every state change of a chunk is made before it
interrupts, so a cancel landing during the interrupt loses nothing.

The network runs off the event loop: all the windows of one event go to a
thread in one hop (about 0.3 ms of inference per window), so the worker's
loop goes on serving leases and other sessions meanwhile. Per session one
event is detected at a time, in order: the next call waits for the one in
flight, so the detector and the network's recurrent state are never touched
by two threads. The hop is a task the session owns and is never cancelled
(the thread would go on changing the state while the drafts were lost): a
``handle`` cancelled during it leaves the chunk's drafts, and its speech start,
to the next call, which hands them out first. A rebuild's replayed audio is
detected in one hop, too.

The network is loaded once per process from the ``silero-vad`` package (its
ONNX file, run by onnxruntime); each session keeps its own recurrent state.
``continuous_input`` is true: audio accepted before an interruption is still
the user speaking.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dataplane.readiness import StageModel
from schemas.events import (
    AudioPayload,
    ClearPayload,
    CommitPayload,
    InputEvent,
    OutputEvent,
    OutputKind,
    SettingsPayload,
    TextPayload,
    TokensPayload,
    UnitPayload,
)
from schemas.fence import Fence
from schemas.items import input_item
from workers.backends.audio import (
    AudioError,
    Samples,
    StreamResampler,
    decode_pcm,
    encode_pcm,
)
from workers.backends.base import OutputDraft, RebuildWindow, StageContext, StageEvent

RATE = 16_000
WINDOW = 512
"""Samples per Silero window at 16 kHz (32 ms)."""
_CONTEXT = 64
"""Samples of the previous window the network sees before each window."""
_STATE_KEY = "vad"


class VadOptions(BaseModel):
    """Options of a ``vad`` stage (``StageConfig.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    threshold: float = Field(0.5, ge=0.2, le=0.95)
    """Speech probability at or above which a window is speech."""
    min_speech_ms: int = Field(64, ge=32, le=2000)
    """Speech must last this long before it counts (a click does not barge in)."""
    min_silence_ms: int = Field(500, ge=32, le=10_000)
    """Silence that ends an utterance (and the user's turn)."""
    prefix_padding_ms: int = Field(300, ge=0, le=2000)
    """Audio before the detected start that the utterance keeps."""
    suffix_padding_ms: int = Field(200, ge=0, le=2000)
    """Audio after the last speech window that the utterance keeps."""
    max_segment_s: float = Field(30.0, ge=1.0, le=120.0)
    """Longest utterance; a longer one is committed in pieces this long."""
    segment_chunk_ms: int = Field(1000, ge=100, le=30_000)
    """Audio per output delta of a committed utterance."""
    interrupt_response: bool = True
    """Barge in on the session (bump its epoch) when speech starts."""


class Transition(Enum):
    START = auto()
    STOP = auto()
    """Enough silence after speech."""
    CUT = auto()
    """The utterance reached ``max_segment_s``."""


class SpeechDetector:
    """Speech start and stop from per-window probabilities (pure).

    Hysteresis as in Silero's own streaming iterator: a window is speech at or
    above ``threshold`` and silence below ``threshold - 0.15``; a window between
    the two continues a silence run already begun and otherwise changes nothing.
    """

    def __init__(self, threshold: float, onset_windows: int, silence_windows: int) -> None:
        self.threshold = threshold
        self.low = max(0.01, threshold - 0.15)
        self.onset_windows = onset_windows
        self.silence_windows = silence_windows
        self.speaking = False
        self.onset_run = 0
        """Consecutive speech windows while silent."""
        self.silence_run = 0
        """Windows since speech last stopped, while speaking."""

    def step(self, prob: float) -> Transition | None:
        if not self.speaking:
            self.onset_run = self.onset_run + 1 if prob >= self.threshold else 0
            if self.onset_run < self.onset_windows:
                return None
            self.speaking, self.onset_run, self.silence_run = True, 0, 0
            return Transition.START
        if prob >= self.threshold:
            self.silence_run = 0
        elif prob < self.low or self.silence_run:
            self.silence_run += 1
        if self.silence_run >= self.silence_windows:
            self.speaking = False
            return Transition.STOP
        return None

    def reset(self) -> None:
        self.speaking, self.onset_run, self.silence_run = False, 0, 0


_END_REASONS = {Transition.STOP: "silence", Transition.CUT: "max_segment"}


def _windows(ms: float) -> int:
    return max(0, round(ms * RATE / 1000 / WINDOW))


class SileroModel:
    """The Silero VAD network, shared by every session of the process."""

    def __init__(self, path: Path) -> None:
        import onnxruntime  # type: ignore[import-untyped]

        options = onnxruntime.SessionOptions()
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._rate = np.array(RATE, dtype=np.int64)

    def probability(self, window: Samples, state: SileroState) -> float:
        """Speech probability of one 512-sample window; advances ``state``."""
        frame = np.concatenate([state.context, window])[None, :]
        prob, state.rnn = self._session.run(
            None, {"input": frame, "state": state.rnn, "sr": self._rate}
        )
        state.context = window[-_CONTEXT:].copy()
        return float(prob[0][0])


@dataclass
class SileroState:
    """One session's recurrent state of the network."""

    rnn: np.ndarray[Any, np.dtype[np.float32]] = field(
        default_factory=lambda: np.zeros((2, 1, 128), dtype=np.float32)
    )
    context: Samples = field(default_factory=lambda: np.zeros(_CONTEXT, dtype=np.float32))


_model: SileroModel | None = None
_model_lock = threading.Lock()


def silero_model_path() -> Path:
    """The ONNX file inside the installed ``silero-vad`` package (not imported: its
    ``__init__`` loads torch and changes torch's thread count for the process)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the vad stage needs the silero-vad package (pip install silero-vad)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise RuntimeError(f"silero-vad is installed but {path} is missing")
    return path


def shared_model() -> SileroModel:
    """The process's Silero network, loaded on first use."""
    global _model  # noqa: PLW0603 - one network per process, by design
    with _model_lock:
        if _model is None:
            _model = SileroModel(silero_model_path())
        return _model


@dataclass
class VadSession:
    """One session's detection state."""

    detector: SpeechDetector
    preroll: deque[Samples]
    """Recent windows while silent: the start of an utterance and its prefix padding."""
    silero: SileroState = field(default_factory=SileroState)
    pending: Samples = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    """Resampled audio short of a whole window."""
    resampler: StreamResampler | None = None
    segment: list[Samples] = field(default_factory=list)
    windows: int = 0
    """Windows processed: the session's audio clock."""
    segments: int = 0
    outbox: list[OutputDraft] = field(default_factory=list)
    """Drafts held back from a chunk that barged in; published with the next event."""
    detecting: asyncio.Task[tuple[list[OutputDraft], bool]] | None = None
    """An event's detection running in a thread (at most one per session)."""
    fresh: list[OutputDraft] = field(default_factory=list)
    """Drafts of detected events not yet handed out by ``handle``."""
    fresh_start: bool = False
    """Speech started in one of those events (the barge-in is still to be made)."""
    settings: SettingsPayload | None = None
    """The session settings the detector is tuned to (``VadBackend._tune``)."""
    manual: bool = False
    """Turn detection is off: audio is kept until the client commits or clears it."""

    def keep(self, drafts: list[OutputDraft], started: bool) -> None:
        self.fresh += drafts
        self.fresh_start = self.fresh_start or started

    def take(self) -> tuple[list[OutputDraft], bool]:
        taken = self.fresh, self.fresh_start
        self.fresh, self.fresh_start = [], False
        return taken


class VadBackend:
    """Silero voice activity detection: utterances, turn ends and barge-in."""

    name = "vad"
    continuous_input = True
    follows_responses = False
    """Speech events and utterances describe the input; a response reserved meanwhile
    does not make them stale."""
    edits_conversation = False

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        try:
            self.options = VadOptions.model_validate(dict(options or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid vad stage options: {exc}") from exc
        self._model: SileroModel | None = None
        # A takeover rebuilds from the audio since the last turn end, which is cut at
        # max_segment_s: that many seconds of 10 ms chunks (and outputs) bound it.
        window = int((self.options.max_segment_s + 1) * 100)
        self.rebuild = RebuildWindow(inputs=window, outputs=window)

    async def load(self) -> StageModel:
        """Load the Silero network (in a thread) before the worker takes sessions."""
        self._model = await asyncio.to_thread(shared_model)
        return StageModel("silero-vad")

    @property
    def model(self) -> SileroModel:
        """The network (loaded here on first use when ``load`` was not called)."""
        if self._model is None:
            self._model = shared_model()
        return self._model

    def new_session(self) -> VadSession:
        opts = self.options
        onset = _windows(opts.min_speech_ms) or 1
        return VadSession(
            detector=SpeechDetector(opts.threshold, onset, max(1, _windows(opts.min_silence_ms))),
            preroll=deque(maxlen=onset + _windows(opts.prefix_padding_ms)),
        )

    # -- contract ----------------------------------------------------------------

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        """Fresh state, or (failover) the state rebuilt from the audio since the last turn
        end this stage published; drafts that rebuild finds unpublished go to the outbox."""
        session = self.new_session()
        ctx.state[_STATE_KEY] = session
        self._tune(session, ctx.session)
        boundary = max((o.source_seq for o in outputs if o.kind is OutputKind.DONE), default=0)
        announced = any(
            o.kind is OutputKind.SPEECH_STARTED and o.source_seq > boundary for o in outputs
        )
        tail = _recent_audio(
            [e for e in inputs if e.seq > boundary], self.options.max_segment_s + 1
        )
        replayed = await asyncio.to_thread(self._replay, session, tail)
        if announced:
            starts = [i for i, d in enumerate(replayed) if d.kind is OutputKind.SPEECH_STARTED]
            if starts:
                del replayed[starts[0]]
        session.outbox = replayed

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        session = self._session(ctx)
        await self._detect(session, event, ctx.session)  # bad audio raises: the outbox stays
        new, started = session.take()
        drafts, session.outbox = session.outbox + new, []
        if ctx.end_turn is not None and any(_ends_turn(draft) for draft in new):
            # The user's turn ended here, not by a client commit (which reserved the
            # model's turn already): reserve it, so the answer is a response of its own.
            await ctx.end_turn()
        interrupts = self.options.interrupt_response and ctx.session.interrupt_response
        if started and interrupts and ctx.interrupt is not None:
            # Everything is decided; publish at the new epoch once the barge-in is in.
            session.outbox = drafts
            await ctx.interrupt("speech_started")
            if ctx.emit is not None:
                drafts, session.outbox = session.outbox, []
                for draft in drafts:
                    ctx.emit(draft)
            return
        for draft in drafts:
            yield draft

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        """Not called for continuous input; if it is, the audio still counts."""
        session = self._session(ctx)
        await self._detect(session, event, ctx.session)
        session.outbox += session.take()[0]

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        """Nothing to abort: the detector goes on listening through an interruption."""

    async def stop(self, ctx: StageContext) -> None:
        session = ctx.state.pop(_STATE_KEY, None)
        if isinstance(session, VadSession):
            await self._settle(session, raise_refusal=False)  # no thread outlives it

    async def aclose(self) -> None:
        """The network stays loaded for the process; sessions hold no resources."""

    # -- core --------------------------------------------------------------------

    def _session(self, ctx: StageContext) -> VadSession:
        session = ctx.state.get(_STATE_KEY)
        if not isinstance(session, VadSession):
            session = ctx.state[_STATE_KEY] = self.new_session()
        return session

    async def _detect(
        self, session: VadSession, event: StageEvent, settings: SettingsPayload
    ) -> None:
        """Run one event through the detector, tuned to the session's settings; its drafts
        join ``session.fresh``.

        An event with audio is detected in a thread, after the one in flight (a cancelled
        call's), whose drafts come first; other events change the state inline."""
        # A cancelled call's refused audio is not raised here: this event is not at fault.
        await self._settle(session, raise_refusal=False)
        self._tune(session, settings)
        if _audio_of(event) is None:
            session.keep(*self._consume(session, event))
            return
        session.detecting = asyncio.create_task(
            asyncio.to_thread(self._consume, session, event), name="vad detect"
        )
        await self._settle(session, raise_refusal=True)

    async def _settle(self, session: VadSession, *, raise_refusal: bool) -> None:
        """Wait for the detection in flight, if any, and keep its drafts in the session."""
        job = session.detecting
        if job is None:
            return
        await asyncio.wait([job])  # never cancels the job; a cancel of ours leaves it
        session.detecting = None
        if job.cancelled():
            return  # only at loop shutdown: the session goes with it
        if (exc := job.exception()) is None:
            session.keep(*job.result())
        elif raise_refusal:
            raise exc

    def _tune(self, session: VadSession, settings: SettingsPayload) -> None:
        """Follow the session's turn detection settings (``session.update``): threshold,
        silence and prefix padding override the stage's options; with turn detection off
        the network is not run and the audio waits for the client's commit. Nothing
        heard is lost in a switch: audio kept for a commit becomes an utterance in
        progress when detection comes back on (silence or a commit ends it), and an
        utterance in progress is kept for the commit when detection goes off."""
        if session.settings == settings:
            return
        session.settings = settings
        opts = self.options
        threshold = opts.threshold
        if settings.vad_threshold is not None:
            threshold = min(0.95, max(0.2, settings.vad_threshold))
        silence_ms = settings.vad_silence_ms or opts.min_silence_ms
        prefix_ms = opts.prefix_padding_ms
        if settings.vad_prefix_padding_ms is not None:
            prefix_ms = settings.vad_prefix_padding_ms
        detector = session.detector
        detector.threshold, detector.low = threshold, max(0.01, threshold - 0.15)
        detector.silence_windows = max(1, _windows(silence_ms))
        session.preroll = deque(
            session.preroll, maxlen=detector.onset_windows + _windows(prefix_ms)
        )
        if session.manual == (not settings.server_vad):
            return
        session.manual = not settings.server_vad
        session.preroll.clear()
        detector.reset()
        detector.speaking = not session.manual and bool(session.segment)

    def _replay(self, session: VadSession, tail: Sequence[AudioPayload]) -> list[OutputDraft]:
        """The drafts of a rebuild's audio (blocking: run in a thread)."""
        replayed: list[OutputDraft] = []
        for audio in tail:
            with contextlib.suppress(AudioError):  # refused when first handled, too
                replayed += self._feed(session, audio)[0]
        return replayed

    def _consume(self, session: VadSession, event: StageEvent) -> tuple[list[OutputDraft], bool]:
        """Drafts for one event and whether speech started in it (blocking for audio: the
        network runs; no awaits: atomic)."""
        audio = _audio_of(event)
        if audio is not None:
            return self._feed(session, audio)
        if isinstance(event, OutputEvent):
            return [OutputDraft(event.kind, text=event.text, token_ids=event.token_ids)], False
        payload = event.payload
        typed = {"item": input_item(event.seq)}  # the client's item, as it was announced
        if isinstance(payload, TextPayload):
            typed["item"] = payload.item_id or typed["item"]
            return [OutputDraft(OutputKind.TEXT_DELTA, text=payload.text, meta=typed)], False
        if isinstance(payload, TokensPayload):
            draft = OutputDraft(OutputKind.TEXT_DELTA, token_ids=payload.token_ids, meta=typed)
            return [draft], False
        if isinstance(payload, CommitPayload):
            # The client's commit names the utterance it ends (its input seq), so its
            # announcement and the transcript agree on the user's item.
            heard = session.detector.speaking or (session.manual and session.segment)
            drafts = self._end(session, "commit", commit_seq=event.seq) if heard else []
            if not drafts:
                ended: dict[str, str | int | float | bool] = {"reason": "commit", "turn_end": True}
                ended["commit_seq"] = event.seq
                drafts.append(OutputDraft(OutputKind.DONE, meta=ended))
            if payload.respond:  # a response.create: the turn's end asks for an answer
                done = drafts[-1]
                drafts[-1] = OutputDraft(done.kind, meta={**done.meta, "respond": True})
            return drafts, False
        if isinstance(payload, ClearPayload):
            return self._clear(session), False
        return [], False  # video, a unit without audio, a playback ack

    def _clear(self, session: VadSession) -> list[OutputDraft]:
        """Forget the audio heard since the last turn end (input_audio_buffer.clear)."""
        speaking = session.detector.speaking
        session.detector.reset()
        session.segment = []
        session.preroll.clear()
        if not speaking:
            return []
        meta: dict[str, str | int | float | bool] = {"segment": session.segments + 1}
        meta["reason"] = "cleared"
        return [OutputDraft(OutputKind.SPEECH_STOPPED, meta=meta, flush=True)]

    def _feed(self, session: VadSession, audio: AudioPayload) -> tuple[list[OutputDraft], bool]:
        samples = decode_pcm(audio.data, audio.format)
        if session.resampler is None or session.resampler.src_rate != audio.sample_rate:
            session.resampler = StreamResampler(audio.sample_rate, RATE)
        buffered = np.concatenate([session.pending, session.resampler.process(samples)])
        whole = len(buffered) - len(buffered) % WINDOW
        session.pending = buffered[whole:]
        drafts: list[OutputDraft] = []
        started = False
        for offset in range(0, whole, WINDOW):
            window = buffered[offset : offset + WINDOW]
            transition = (
                self._keep(session, window) if session.manual else self._step(session, window)
            )
            if transition is Transition.START:
                started = True
                drafts.append(self._started(session))
            elif transition is not None:
                drafts += self._end(session, _END_REASONS[transition])
        return drafts, started

    def _step(self, session: VadSession, window: Samples) -> Transition | None:
        prob = self.model.probability(window, session.silero)
        session.windows += 1
        transition = session.detector.step(prob)
        if transition is Transition.START:
            session.segment = list(session.preroll)
            session.preroll.clear()
        if session.detector.speaking or transition is not None:
            session.segment.append(window)
        else:
            session.preroll.append(window)
        if (
            transition is None
            and session.detector.speaking
            and len(session.segment) * WINDOW >= self.options.max_segment_s * RATE
        ):
            return Transition.CUT
        return transition

    def _keep(self, session: VadSession, window: Samples) -> Transition | None:
        """Turn detection off: keep the window for the commit; a buffer reaching
        ``max_segment_s`` is committed as an utterance that long is with detection on."""
        session.windows += 1
        session.segment.append(window)
        if len(session.segment) * WINDOW >= self.options.max_segment_s * RATE:
            return Transition.CUT
        return None

    def _started(self, session: VadSession) -> OutputDraft:
        start_ms = (session.windows - session.detector.onset_windows) * WINDOW * 1000 // RATE
        return OutputDraft(
            OutputKind.SPEECH_STARTED,
            meta={"audio_start_ms": start_ms, "segment": session.segments + 1},
            flush=True,
        )

    def _end(
        self, session: VadSession, reason: str, *, commit_seq: int | None = None
    ) -> list[OutputDraft]:
        """Close the utterance: stopped, its audio in deltas, the turn's end."""
        silent = session.detector.silence_run if reason == "silence" else 0
        keep = len(session.segment) - max(0, silent - _windows(self.options.suffix_padding_ms))
        audio = np.concatenate(session.segment[:keep]) if keep > 0 else np.zeros(0, np.float32)
        session.segment = []
        session.detector.reset()
        session.segments += 1
        end_ms = (session.windows - silent) * WINDOW * 1000 // RATE
        meta: dict[str, str | int | float | bool] = {"segment": session.segments}
        if commit_seq is not None:
            meta["commit_seq"] = commit_seq
        drafts = []
        if not session.manual:  # with turn detection off no speech is announced
            drafts.append(
                OutputDraft(
                    OutputKind.SPEECH_STOPPED, meta={**meta, "audio_end_ms": end_ms}, flush=True
                )
            )
        step = max(1, self.options.segment_chunk_ms * RATE // 1000)
        pieces = [audio[i : i + step] for i in range(0, len(audio), step)] or [audio]
        for index, piece in enumerate(pieces):
            drafts.append(
                OutputDraft(
                    OutputKind.AUDIO_DELTA,
                    data=encode_pcm(piece, "pcm_s16le"),
                    meta={
                        **meta,
                        "format": "pcm_s16le",
                        "sample_rate": RATE,
                        "chunk": index,
                        "last": index == len(pieces) - 1,
                    },
                )
            )
        drafts.append(
            OutputDraft(OutputKind.DONE, meta={**meta, "reason": reason, "turn_end": True})
        )
        return drafts


def _ends_turn(draft: OutputDraft) -> bool:
    """A turn end this stage decided (silence, the longest segment), not a commit's."""
    return (
        draft.kind is OutputKind.DONE
        and bool(draft.meta.get("turn_end"))
        and draft.meta.get("reason") != "commit"
    )


def _audio_of(event: StageEvent) -> AudioPayload | None:
    """The audio an event carries, whatever its shape."""
    if isinstance(event, OutputEvent):
        if event.kind is not OutputKind.AUDIO_DELTA:
            return None
        fmt = event.meta.get("format", "pcm_s16le")
        rate = event.meta.get("sample_rate", RATE)
        if not isinstance(fmt, str) or type(rate) is not int or rate <= 0:
            return None
        return AudioPayload(event.data, fmt, rate)
    assert isinstance(event, InputEvent)
    payload = event.payload
    if isinstance(payload, AudioPayload):
        return payload
    if isinstance(payload, UnitPayload):
        return payload.audio
    return None


def _recent_audio(events: Sequence[StageEvent], seconds: float) -> list[AudioPayload]:
    """The audio of the last ``seconds`` of ``events``, oldest first."""
    tail: list[AudioPayload] = []
    total = 0.0
    for event in reversed(events):
        audio = _audio_of(event)
        if audio is None:
            continue
        width = 4 if audio.format == "pcm_f32le" else 2
        total += len(audio.data) / width / audio.sample_rate
        tail.append(audio)
        if total >= seconds:
            break
    return tail[::-1]
